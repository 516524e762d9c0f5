"""Hybrid drafting: per request and step, which sources draft and how the node budget is split.

Prompt lookup is nearly free to draft; the head costs a drafting pass and a bigger tree to verify.
So, per request: while lookup carries it (it matched, and recently accepted at least as much as
the head), the head sits the step out. When lookup has nothing, the head drafts only if its trees
pay for themselves on this machine: its recent accepted tokens per step against the measured cost
of a head step relative to a plain one (both measured per batch-size bucket). A skipped head still
drafts now and then so its estimate stays current, less often while skipping keeps being right.
When both draft, the budget is split by each source's recent acceptance.
"""
from __future__ import annotations

from collections import defaultdict

from eagle_worker.spec.drafter import DraftState
from eagle_worker.spec.policy import bucket


class HybridSplit:
    PROBE_EVERY = 4            # a skipped head still drafts on the 4th skipped step, then the 8th after
    MAX_PROBE_EVERY = 32       # that, ... up to every 32nd while skipping keeps being right

    def __init__(self, ema: float = 0.2):
        self.ema = ema
        self.seconds: dict[tuple[int, str], float] = {}      # (bucket, "head" | "plain") -> step seconds
        self.samples: dict[tuple[int, str], int] = defaultdict(int)

    def use_head(self, st: DraftState, branches, batch_size: int) -> bool:
        carried = bool(branches) and st.ema_lookup >= st.ema_head
        if not carried and (branches or self._pays(st, batch_size)):
            st.probe_every = self.PROBE_EVERY
            return True
        st.skipped_steps += 1
        if st.skipped_steps < st.probe_every:
            return False
        st.skipped_steps, st.probe_every = 0, min(2 * st.probe_every, self.MAX_PROBE_EVERY)
        return True

    def _pays(self, st: DraftState, batch_size: int) -> bool:
        """Head trees beat plain steps: (1 + recent accepted) tokens per head step against the
        measured cost of a head step in plain steps. Unmeasured: draft, then time plain steps."""
        b = bucket(batch_size)
        if self.samples[(b, "head")] < 2:
            return True
        if self.samples[(b, "plain")] < 2:
            return False
        return (1.0 + st.ema_head) * self.seconds[(b, "plain")] > self.seconds[(b, "head")]

    @staticmethod
    def head_nodes(st: DraftState, budget: int) -> int:
        """Nodes the head keeps when lookup branches share the tree (the rest go to lookup)."""
        share = (st.ema_lookup + 0.1) / (st.ema_head + st.ema_lookup + 0.2)
        return budget - max(1, round(budget * share))

    def observe(self, batch_size: int, kind: str, seconds: float) -> None:
        """One pure-decode step: `kind` "head" (the head drafted) or "plain" (no tree at all)."""
        key = (bucket(batch_size), kind)
        self.samples[key] += 1
        ema = max(self.ema, 1.0 / self.samples[key])
        self.seconds[key] = seconds if key not in self.seconds else (1 - ema) * self.seconds[key] + ema * seconds
