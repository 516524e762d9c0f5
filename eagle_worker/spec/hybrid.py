"""Hybrid drafting: per request and step, whether the head drafts beside prompt lookup, and how
the node budget is split when both do.

Prompt lookup is nearly free to draft; the head costs a drafting pass and a bigger tree to verify.
So each step picks, per request, the mode with the higher expected tokens per second. With lookup
branches: lookup alone, (1 + lookup's recent accepted tokens) per lookup step, against lookup merged
with the head's tree, which adds what the head's own nodes recently added on top of lookup's, per
(slower) merged step. Without branches: a plain step against a head tree, (1 + the head's recent
accepted tokens) per head step. Each request's estimates start from the worker's running averages;
step seconds are measured per mode and batch-size bucket. A head that sat out must first catch up
on the stretch it missed (one pass of its layer over those tokens): it rejoins only when the time
it saves over the request's remaining tokens repays that. A head that sits out still probes now and
then so its estimates stay current, less often while sitting out keeps being right, and not when
the catch-up would cost more than a twentieth of the request's remaining time. When both draft,
the budget is split by each source's recent acceptance for the request.
"""
from __future__ import annotations

from eagle_worker.spec.drafter import DraftState
from eagle_worker.spec.policy import StepMeans, bucket

MODES = ("plain", "lookup", "head", "merged")     # which sources drafted a step's tree
# accepted draft tokens per step: lookup's; the head's own nodes' beside lookup; the head's alone
GAINS = ("lookup", "extra", "head")


def step_mode(from_head: bool, from_lookup: bool) -> str:
    return ("merged" if from_lookup else "head") if from_head else ("lookup" if from_lookup else "plain")


class HybridSplit:
    PROBE_EVERY = 16           # a skipped head still drafts on the 16th skipped step, then the 32nd after
    MAX_PROBE_EVERY = 64       # that, ... up to every 64th while skipping keeps being right
    PROBE_SHARE = 0.05         # a probe's catch-up may cost at most this share of the remaining time

    def __init__(self, ema: float = 0.2, prior_ema: float = 0.05):
        self.prior_ema = prior_ema
        self.steps = StepMeans(ema)                            # (bucket, mode) -> (step seconds,)
        self.prior = dict.fromkeys(GAINS, 1.0)                 # accepted per step, all requests
        self.catch_up = StepMeans(ema)                         # ("catch_up",) -> (tokens, seconds)

    def new_gains(self) -> dict[str, float]:
        """A new request's expected accepted tokens: what this worker has seen so far."""
        return dict(self.prior)

    def use_head(self, st: DraftState, branches, batch_size: int, remaining: int | None = None,
                 stretch: int = 0) -> bool:
        """`remaining`: tokens the request may still generate (None: unbounded); `stretch`: pending
        tokens the head must catch up on beyond one step's worth before it can draft."""
        catch_up_s = self.catch_up_seconds(stretch)
        pays, seconds_left = self._head_pays(st, bool(branches), batch_size, remaining, catch_up_s)
        if pays:
            st.probe_every = self.PROBE_EVERY
            return True
        st.skipped_steps += 1
        every = st.probe_every or self.PROBE_EVERY
        if st.skipped_steps < every or catch_up_s > self.PROBE_SHARE * seconds_left:
            return False
        st.skipped_steps, st.probe_every = 0, min(2 * every, self.MAX_PROBE_EVERY)
        return True

    def _head_pays(self, st: DraftState, branches: bool, batch_size: int, remaining: int | None,
                   catch_up_s: float) -> tuple[bool, float]:
        """Whether the head's tokens per second, over the request's remaining tokens, repay its
        catch-up; and the remaining seconds without the head. Unmeasured: draft with the head
        first, then measure the step without it."""
        b = bucket(batch_size)
        with_head, without = ("merged", "lookup") if branches else ("head", "plain")
        if self.steps.samples[(b, with_head)] < 2:
            return True, float("inf")
        if self.steps.samples[(b, without)] < 2:
            return False, float("inf")
        g = st.gains or self.prior
        base = 1.0 + g["lookup"] if branches else 1.0
        more = g["extra"] if branches else g["head"]
        (t_with,), (t_without,) = self.steps.means[(b, with_head)], self.steps.means[(b, without)]
        per_token_without, per_token_with = t_without / base, t_with / (base + more)
        if remaining is None:
            return per_token_with < per_token_without, float("inf")
        return remaining * (per_token_without - per_token_with) > catch_up_s, remaining * per_token_without

    def catch_up_seconds(self, tokens: int) -> float:
        if not tokens or not self.catch_up.samples[("catch_up",)]:
            return 0.0
        n, s = self.catch_up.means[("catch_up",)]
        return tokens * s / n

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """A catch-up over a stretch: `tokens` pending pairs (all sequences) through the head in `seconds`."""
        self.catch_up.observe(("catch_up",), tokens, seconds)

    @staticmethod
    def alone_nodes(budget: int) -> int:
        """Nodes of a head tree drafted where lookup has nothing: a quarter of the budget. The head
        fills the gaps between lookup's matches, where its acceptance is lowest, and a small tree
        costs the least to draft and verify (on a CPU, 3 nodes pay where 9 do not)."""
        return max(1, budget // 4)

    @staticmethod
    def head_nodes(st: DraftState, budget: int) -> int:
        """Nodes the head keeps when lookup branches share the tree (the rest go to lookup)."""
        share = (st.ema_lookup + 0.1) / (st.ema_head + st.ema_lookup + 0.2)
        return budget - max(1, round(budget * share))

    def observe_accepted(self, st: DraftState, mode: str, from_lookup: int, head_only: int) -> None:
        """One step's accepted draft tokens: `from_lookup` on lookup's nodes, `head_only` on nodes only
        the head proposed. Updates the request's estimates and the worker's."""
        if not st.gains:
            st.gains = self.new_gains()
        seen = {"lookup": {"lookup": from_lookup}, "merged": {"lookup": from_lookup, "extra": head_only},
                "head": {"head": head_only}}.get(mode, {})
        for key, n in seen.items():
            st.gains[key] = 0.7 * st.gains[key] + 0.3 * n
            self.prior[key] = (1 - self.prior_ema) * self.prior[key] + self.prior_ema * n

    def observe(self, batch_size: int, mode: str, seconds: float) -> None:
        """Seconds of one pure-decode step whose trees were drafted in `mode`."""
        self.steps.observe((bucket(batch_size), mode), seconds)
