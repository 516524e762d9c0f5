"""Hybrid drafting: per request and step, which sources draft (prompt lookup, the head, both or
neither) and how many nodes each gets: the batch-aware budget.

Prompt lookup is nearly free to draft but its branches cost verification rows; the head costs a
drafting pass and rows too. So each step picks, per request, the drafting with the fewest expected
seconds per token: plain (1 token per step), lookup with its branches cut to the depth that pays
best (1 + what that much of lookup's proposal is expected to add), head (its first guess alone or
its small tree: 1 + the head's recent accepted tokens, scaled to the tree) or merged (lookup's +
what the head's own nodes recently added beside lookup).
A request's seconds are its share of the step's fixed cost (the fixed cost over the batch size),
its rows and its share of the head's passes, priced by `StepCost`, the device's measured cost of a
row (and a sampled row's extra, the keyed draw of each row acceptance visits): at batch 1 the
fixed cost dominates and a likely token is worth a row; at batch 64 a row costs about as much as a
request's whole share, so only a source that is likely to hit keeps its nodes (a copy lookup is
certain of keeps its branch, a head that rarely hits drafts nothing).
Lookup's expectation depends on how its previous proposal for the request did: a copy
that was followed to the end keeps going, a miss is usually followed by more misses; the worker
keeps, after each outcome, the share of proposals that reached each depth, so a merged tree whose
lookup branches are cut short to make room for the head is charged for the tokens they give up. A
proposal left unverified is still scored against the tokens that follow (shadow scoring), so a
request learns when its copying resumes without paying for it. The head's gains start from the
worker's running averages.

A head that sat out must first catch up on the stretch it missed (one pass of its layer over those
tokens): it rejoins only when the time it saves repays that, counted over the share of the
request's remaining tokens that lookup is not expected to carry (the request's recent share of
tokens made on steps lookup did not carry: tokens, not steps, since a copying step makes several;
a new request starts from the worker's), and only at a step where
lookup has nothing (the head is then the only source), not beside lookup's branches (where it adds
least), and not at a request's first step, before anything says whether lookup will carry it: a
copying request with a long prompt does not pay that catch-up for a node beside a copy.
A head that sits out still probes now and then so its estimates stay current, less often while
sitting out keeps being right, and only when the probe's expected loss (its catch-up and what its
step costs beyond making the same tokens the cheapest way) is at most a fiftieth of the time the
head sat out and of the request's remaining time: a probe that costs a sampled row's price for a
head that rarely hits at temperature 1 waits longer than one that costs a greedy row. When both
draft, the budget is split by each source's recent acceptance.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from eagle_worker.speculative.draft_tree import StepMode
from eagle_worker.speculative.policy import StepMeans
from eagle_worker.speculative.step_cost import StepCost, StepWork

GAINS = ("extra", "head")       # accepted per step: the head's own nodes beside lookup; the head alone
LOOKUP_OUTCOMES = ("new", "miss", "partial", "complete")   # how a request's previous lookup proposal did


_HEAD_MODES = (StepMode.HEAD, StepMode.MERGED)


def lookup_outcome(accepted: int, complete: bool) -> str:
    return "miss" if accepted == 0 else ("complete" if complete else "partial")


@dataclass
class ShadowProposal:
    """A lookup proposal that was not verified (or only cut short), kept to score against the
    tokens that follow."""

    position: int                  # the proposal continues the first `position` tokens
    branches: list[list[int]]
    outcome_before: str            # the request's lookup outcome when it was proposed
    matched: int = 0               # tokens the generated text has followed so far
    cut: bool = False              # verified cut short this step: the verification does not learn


@dataclass
class HybridState:
    """What the hybrid chooser knows about one request."""

    ema_head: float = 1.0          # recent accepted tokens per step from each source
    ema_lookup: float = 1.0
    skipped_steps: int = 0         # steps the head sat out since it last drafted
    sat_out_s: float = 0.0         # and the expected seconds of those steps (what probes may spend a share of)
    probe_every: int = 0           # the head drafts after this many skipped steps (0: HybridSplit's first)
    gains: dict = field(default_factory=dict)   # recent accepted tokens per step (GAINS)
    lookup_outcome: str = "new"    # how the last lookup proposal did (LOOKUP_OUTCOMES)
    shadow: ShadowProposal | None = None
    free_tokens: tuple[float, float] | None = None  # recent tokens per step made where lookup did not
                                                    # carry, and all tokens per step (None: new request)
    sampled: bool = False          # its rows are sampled (more than an argmax): each costs per_sampled_row more


@dataclass(frozen=True)
class Choice:
    """One request's drafting for this step: which sources, lookup's branches cut to how many
    tokens, and how many nodes the head keeps."""

    mode: StepMode
    lookup_depth: int = 0
    head_nodes: int = 0


@dataclass(frozen=True)
class StepContext:
    """What the chooser knows of the step it sizes trees for."""

    batch_size: int            # decoding sequences this step
    head: bool = True          # a head exists
    head_seqs: int = 1         # sequences expected to share the head's passes (last step's count)


class Option(NamedTuple):
    """A way to draft one request this step: its expected cost (seconds for the remaining tokens,
    per token when unbounded) and one such step's seconds and tokens."""

    choice: Choice
    cost: float
    seconds: float
    tokens: float


def trie_nodes(branches: list[list[int]], depth: int) -> int:
    """Nodes the branches make as a trie when each is cut to `depth` tokens."""
    return len({tuple(br[:d]) for br in branches for d in range(1, min(depth, len(br)) + 1)})


class HybridSplit:
    PROBE_EVERY = 16           # a skipped head still drafts on the 16th skipped step, then the 32nd after
    MAX_PROBE_EVERY = 64       # that, ... up to every 64th while skipping keeps being right
    PROBE_SHARE = 0.02         # a probe's expected loss: at most this share of the time sat out and of the remaining time
    # a 1-node head tree's accepted tokens per step over its usual tree's, before the worker has
    # measured its own (`observe_accepted`'s first_node): the fixed head with 1 and 2 nodes on
    # Spec-Bench made 0.43 and 0.65 tokens a step
    FIRST_NODE_SHARE = 0.67
    FIRST_NODE_RATE = 0.02      # how fast the measured share moves: about the last 50 multi-node head steps

    def __init__(self, cost: StepCost | None = None, depth: int = 5, top_k: int = 8, prior_ema: float = 0.05):
        self.prior_ema = prior_ema
        self.cost = cost or StepCost()                         # seconds of a step's rows on this device
        self.depth, self.top_k = depth, top_k                  # the head's tree shape (its drafting rows)
        self.prior = dict.fromkeys(GAINS, 1.0)                 # accepted per step, all requests
        # by previous outcome: P(lookup accepts >= j + 1 tokens) at index j (its sum: the mean)
        self.lookup_reach = {o: [1.0] for o in LOOKUP_OUTCOMES}
        self.catch_up = StepMeans(0.2)                         # ("catch_up",) -> (tokens, seconds)
        self.free_tokens = (0.5, 1.0)      # tokens per step made on steps lookup did not carry, all tokens per step
        # the head's multi-node steps alone: what their first node alone would have made, what they made
        self.first_node = (self.FIRST_NODE_SHARE, 1.0)

    def new_gains(self) -> dict[str, float]:
        """A new request's expected accepted tokens: what this worker has seen so far."""
        return dict(self.prior)

    # ---- the choice ----------------------------------------------------------------------------
    def choose(self, st: HybridState, branches, step: StepContext | int, remaining: int | None = None,
               stretch: int = 0, budget: int = 16, share: float = 1.0) -> Choice:
        """This step's drafting for one request. `remaining`: tokens it may still generate (None:
        unbounded); `stretch`: pending tokens the head must catch up on beyond one step's worth;
        `budget`: the most draft nodes its tree may have; `share`: how much of its part of the
        step's fixed cost its tokens save (1: all; less when the batch waits for a slower one)."""
        step = step if isinstance(step, StepContext) else StepContext(step)
        M = StepMode
        heads = (M.MERGED, M.HEAD) if step.head else ()
        candidates = (*heads, M.LOOKUP, M.PLAIN) if branches else (*heads[1:], M.PLAIN)
        if stretch and (branches or st.free_tokens is None):
            # a head that sat out rejoins where lookup has nothing, not beside it, and not at a new
            # request's first step: whether lookup will carry the request is not known yet
            candidates = (M.LOOKUP, M.PLAIN) if branches else (M.PLAIN,)
        if remaining is not None:      # the head's catch-up is repaid only on steps lookup leaves to it
            remaining = max(1, round(remaining * self.free_share(st)))
        catch_up_s = self.catch_up_seconds(stretch)
        options = {m: self._best(st, m, branches, step, remaining, catch_up_s, budget, share) for m in candidates}
        best = min(options.values(), key=lambda o: o.cost)
        if best.choice.mode in _HEAD_MODES:        # the head drafts on its merits: probing starts over
            st.skipped_steps, st.sat_out_s, st.probe_every = 0, 0.0, self.PROBE_EVERY
            return best.choice
        st.skipped_steps += 1
        st.sat_out_s += best.seconds
        if st.skipped_steps < (st.probe_every or self.PROBE_EVERY) or M.HEAD not in candidates:
            return best.choice
        probe = min((options[m] for m in candidates if m in _HEAD_MODES), key=lambda o: o.cost)   # the cheaper probe
        loss = probe.seconds - probe.tokens * best.seconds / best.tokens + catch_up_s
        if loss > self.PROBE_SHARE * min(st.sat_out_s, best.cost if remaining is not None else st.sat_out_s):
            return best.choice
        st.skipped_steps, st.sat_out_s = 0, 0.0
        st.probe_every = min(2 * (st.probe_every or self.PROBE_EVERY), self.MAX_PROBE_EVERY)
        return probe.choice

    def _best(self, st: HybridState, mode: StepMode, branches, step: StepContext, remaining: int | None,
              catch_up_s: float, budget: int, share: float) -> Option:
        """The cheapest way to draft in `mode` (lookup's depth), and its expected seconds for the
        request's remaining tokens (per token when unbounded)."""
        best = None
        for k, nodes, head_n in self._plans(st, mode, branches, budget):
            seconds, tokens = self._step(st, mode, k, nodes, head_n, step, share)
            if best is None or seconds / tokens < best[1] / best[2]:
                best = (Choice(mode, k, head_n), seconds, tokens)
        choice, seconds, tokens = best
        catch_up = catch_up_s if choice.head_nodes else 0.0
        cost = seconds / tokens if remaining is None else remaining * seconds / tokens + catch_up
        return Option(choice, cost, seconds, tokens)

    def _plans(self, st: HybridState, mode: StepMode, branches, budget: int) -> list[tuple[int, int, int]]:
        """(lookup depth, tree nodes, head nodes) of each way to draft in `mode`: lookup's branches cut
        to each depth (beside the head's share of the budget when merged), or the head alone with its
        usual small tree or its first guess only (one row and one pass: where rows are dear, a head
        that hits half the time pays with one node and not with two)."""
        if mode == StepMode.HEAD:
            return [(0, n, n) for n in sorted({1, self.alone_nodes(budget)})]
        if mode == StepMode.PLAIN:
            return [(0, 0, 0)]
        head_n = self.head_nodes(st, budget) if mode == StepMode.MERGED else 0
        plans = []
        for k in range(1, max(map(len, branches)) + 1):
            nodes = trie_nodes(branches, k)
            if k > 1 and head_n + nodes > budget:
                break
            plans.append((k, head_n + nodes, head_n))
        return plans

    def _step(self, st: HybridState, mode: StepMode, lookup_depth: int, nodes: int, head_n: int,
              step: StepContext, share: float = 1.0) -> tuple[float, float]:
        """Expected seconds and tokens of one step drafted so: the request's share of the step's
        fixed cost, its own cost as a sequence (and as a tree, if it drafts), its rows, and its
        share of the head's passes; the tokens it should make."""
        g = st.gains or self.prior
        tokens = 1.0 + (self.expected_lookup(st.lookup_outcome, lookup_depth) if lookup_depth else 0.0)
        tokens += {StepMode.MERGED: g["extra"], StepMode.HEAD: g["head"] * self.head_size_share(head_n)}.get(mode, 0.0)
        c = self.cost
        per_row = c.coefficient("per_row") + (c.coefficient("per_sampled_row") if st.sampled else 0.0)
        seconds = c.coefficient("fixed") * share / step.batch_size + c.coefficient("per_seq") + per_row * (1 + nodes)
        if nodes:
            seconds += c.coefficient("per_tree")
        if head_n:
            levels = min(self.depth, head_n)
            seconds += c.coefficient("per_head_row") * (1 + (levels - 1) * min(self.top_k, head_n))
            seconds += c.coefficient("per_head_pass") * levels / max(1, step.head_seqs)
        return seconds, tokens

    def free_share(self, st: HybridState | None = None) -> float:
        """The share of tokens made on steps lookup did not carry: the request's recent share, or the
        worker's for a new request (or st None)."""
        free, total = self.free_tokens if st is None or st.free_tokens is None else st.free_tokens
        return free / total

    # ---- measurements --------------------------------------------------------------------------
    def catch_up_seconds(self, tokens: int) -> float:
        if not tokens or not self.catch_up.samples[("catch_up",)]:
            return 0.0
        n, s = self.catch_up.means[("catch_up",)]
        return tokens * s / n

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """A catch-up over a stretch: `tokens` pending pairs (all sequences) through the head in `seconds`."""
        self.catch_up.observe(("catch_up",), tokens, seconds)

    def head_size_share(self, head_nodes: int) -> float:
        """What a head-alone tree of `head_nodes` makes of the head's gain (`gains["head"]` is that
        of its usual tree of 2 or more nodes): a 1-node tree, its first guess alone, the share this
        worker measured (FIRST_NODE_SHARE until it has)."""
        if head_nodes != 1:
            return 1.0
        first, made = self.first_node
        return min(1.0, max(0.05, first / made)) if made > 0 else self.FIRST_NODE_SHARE

    @staticmethod
    def alone_nodes(budget: int) -> int:
        """Nodes of a head tree drafted where lookup has nothing: an eighth of the budget. The head
        fills the gaps between lookup's matches, where its acceptance is lowest, and a small tree
        costs the least to draft and verify (on a CPU 1-3 nodes pay where 9 do not, and a 1-node
        tree that misses costs the least)."""
        return max(1, budget // 8)

    @staticmethod
    def head_nodes(st: HybridState, budget: int) -> int:
        """Nodes the head keeps when lookup branches share the tree (the rest go to lookup; each
        keeps at least one when the budget has two)."""
        share = (st.ema_lookup + 0.1) / (st.ema_head + st.ema_lookup + 0.2)
        return max(1, budget - max(1, round(budget * share)))

    def observe_accepted(self, st: HybridState, mode: StepMode | str, head_only: int, tokens: int,
                         head_nodes: int = 2, first_node: bool | None = None) -> None:
        """One verified step: `head_only` accepted draft tokens on nodes only the head proposed (the
        head's gain in this mode; alone, scaled to its usual tree's from a tree of `head_nodes`),
        `tokens` made in all (the share lookup did not carry); updates the request's estimates and
        the worker's. `first_node`: for the head alone with 2 or more nodes, whether its first guess
        (node 1) was accepted, which is what a 1-node tree would have made (the target's token after
        the root does not depend on the tree): the worker's measure of `head_size_share(1)`."""
        mode = StepMode(mode)
        if mode == StepMode.HEAD and head_nodes > 1 and first_node is not None:
            r = self.FIRST_NODE_RATE
            self.first_node = tuple((1 - r) * x + r * y for x, y in zip(self.first_node, (float(first_node), head_only)))
        free = tokens if mode in (StepMode.PLAIN, StepMode.HEAD) else 0
        a = self.prior_ema
        self.free_tokens = tuple((1 - a) * x + a * y for x, y in zip(self.free_tokens, (free, tokens)))
        before = self.free_tokens if st.free_tokens is None else st.free_tokens
        st.free_tokens = tuple(0.8 * x + 0.2 * y for x, y in zip(before, (free, tokens)))
        if not st.gains:
            st.gains = self.new_gains()
        key = {StepMode.MERGED: "extra", StepMode.HEAD: "head"}.get(mode)
        if key == "head":
            head_only /= self.head_size_share(head_nodes)
        if key:
            st.gains[key] = 0.7 * st.gains[key] + 0.3 * head_only
            self.prior[key] = (1 - self.prior_ema) * self.prior[key] + self.prior_ema * head_only

    def observe_lookup(self, st: HybridState, accepted: int, complete: bool) -> None:
        """How a verified lookup proposal did: `accepted` of its tokens, `complete` when a whole
        branch was. A kept proposal the tokens were still following settles with it: it would have
        given what it matched so far plus what lookup has now accepted (at most its longest branch).
        A proposal verified cut short learns from its shadow instead, which the tokens settle."""
        if st.shadow is not None and st.shadow.cut:
            st.shadow.cut = False
            st.lookup_outcome = "partial" if accepted else "miss"
            return
        if st.shadow is not None:
            sh = st.shadow
            if sh.matched:
                self._learn(sh.outcome_before, min(max(map(len, sh.branches)), sh.matched + accepted))
            st.shadow = None
        self._learn(st.lookup_outcome, accepted)
        st.lookup_outcome = lookup_outcome(accepted, complete)

    def expected_lookup(self, outcome: str, nodes: int | None = None) -> float:
        """Lookup's expected accepted tokens after a proposal that ended with `outcome`, its branches
        cut to `nodes` deep (None: as proposed)."""
        return sum(self.lookup_reach[outcome][:nodes])

    def _learn(self, before: str, accepted: int) -> None:
        """Lookup's accepted tokens after a proposal that ended with outcome `before` (all requests)."""
        reach, a = self.lookup_reach[before], self.prior_ema
        reach.extend([0.0] * (accepted - len(reach)))
        for j in range(len(reach)):
            reach[j] = (1 - a) * reach[j] + a * (accepted > j)

    def shadow(self, st: HybridState, position: int, branches: list[list[int]], budget: int) -> None:
        """Keep an unverified proposal (continuing the first `position` tokens) to score it later,
        with the outcome it followed and the tokens matched so far."""
        if st.shadow is None:
            st.shadow = ShadowProposal(position, [br[:budget] for br in branches], st.lookup_outcome)

    def shadow_cut(self, st: HybridState, position: int, branches: list[list[int]], budget: int) -> None:
        """Lookup is verified cut short: its whole proposal is kept and scored against the tokens
        that follow, so its reach past the cut is still learned (a cut verified alone would only
        ever teach the depths it kept, and the chooser would never see a reason to go deeper)."""
        if st.shadow is not None and st.shadow.matched:
            self._learn(st.shadow.outcome_before, st.shadow.matched)
        st.shadow = ShadowProposal(position, [br[:budget] for br in branches], st.lookup_outcome, cut=True)

    def score_shadow(self, st: HybridState, token_ids: list[int]) -> None:
        """Score the kept proposal once the tokens that followed it settle every branch. While they
        still follow one, copying has resumed: the request counts as mid-copy ("partial") at once,
        and the proposal settles when it breaks, completes, or lookup is verified again."""
        if st.shadow is None:
            return
        sh = st.shadow
        generated = token_ids[sh.position:]
        best, complete = 0, False
        for br in sh.branches:
            n = 0
            while n < min(len(br), len(generated)) and br[n] == generated[n]:
                n += 1
            if n == len(generated) and n < len(br):            # still matching: not settled yet
                if n:
                    sh.matched = n
                    st.lookup_outcome = "partial"
                return
            if n > best or (n == best and n == len(br)):
                best, complete = n, n == len(br)
        st.shadow = None
        self._learn(sh.outcome_before, best)
        st.lookup_outcome = lookup_outcome(best, complete)

    def observe(self, work: StepWork, seconds: float) -> None:
        """Seconds of one pure-decode step and the rows it ran."""
        self.cost.observe(work, seconds)
