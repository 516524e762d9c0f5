"""The EAGLE worker's drafting half (mixed into `EagleWorker`): per step, which decoding sequences
draft and within how many nodes, what each source drafts (lookup branches, the head's share), and
the head's batched trees merged with lookup's branches."""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from eagle_worker.scheduler import ScheduledSeq
from eagle_worker.sequence import Sequence
from eagle_worker.speculative.draft_tree import DraftTree, StepMode
from eagle_worker.speculative.drafter import DraftSeq, DraftState
from eagle_worker.speculative.hybrid import StepContext
from eagle_worker.speculative.lookup import merge_branches, prune_to_best

PLAIN_TREE = DraftTree.root_only(0)   # what a step that drafted nothing verified: its root alone


@dataclass
class Candidate:
    """A decoding sequence that drafts this step."""

    seq: Sequence
    pending: DraftState                        # the head's pending inputs
    budget: int                                # draft nodes its lookahead slots allow
    lookahead: int                             # slots reserved past its root
    branches: list[list[int]] = field(default_factory=list)   # lookup's proposal
    head_nodes: int = 0                        # nodes the head drafts and keeps (0: it sits out)


class DraftStep:
    """`EagleWorker`'s drafting methods; they use its spec, states, policy, hybrid and drafter."""

    def _draft(self, decodes: list[ScheduledSeq], budget: int) -> dict[str, DraftTree]:
        """A tree of at most `budget` nodes (fewer where the sequence's lookahead slots are short)
        for each decoding sequence."""
        cands = self._candidates(decodes, budget)
        if not cands:
            return {}
        if self.spec.lookup:
            for c in cands:
                index = self.states[c.seq.request_id].index
                index.extend(c.seq.token_ids)
                c.branches = index.propose(self.spec.lookup_max_tokens, self.spec.lookup_max_branches)
        self._choose_sources(cands, budget)
        head_trees = self._draft_head([c for c in cands if c.head_nodes], budget)
        trees = {}
        for c in cands:
            head = head_trees.get(c.seq.request_id)
            if head is None and not c.branches:
                trees[c.seq.request_id] = PLAIN_TREE        # it drafts nothing: a plain decode
                continue
            head = head or DraftTree.root_only(c.seq.token_ids[-1])
            trees[c.seq.request_id] = merge_branches(head, c.branches, c.budget - head.num_draft_nodes)
        return trees

    def _candidates(self, decodes: list[ScheduledSeq], budget: int) -> list[Candidate]:
        """Each decode's budget within its reserved slots; counts trees memory made smaller."""
        cands = []
        for it in decodes:
            seq = it.seq
            c = seq.num_computed_tokens
            fits = self._fit(budget, it.num_lookahead)
            if fits < self._fit(budget, self.runner.max_model_len - c - 1):     # short of KV, not of context
                self.totals["trees_shrunk_for_memory"] += 1
                seq.metrics.num_trees_shrunk_for_memory += 1
            if fits:
                cands.append(Candidate(seq, self.states[seq.request_id].draft, fits, it.num_lookahead))
        return cands

    def _draft_seq(self, c: Candidate) -> DraftSeq:
        """The head's view of a candidate it drafts for (its slot table built only then)."""
        seq, committed = c.seq, c.seq.num_computed_tokens
        slots = self.block_manager.slots(seq, 0, committed + 1 + c.lookahead)
        return DraftSeq(committed, slots, seq.token_ids[-1], c.pending)

    def _choose_sources(self, cands: list[Candidate], budget: int) -> None:
        """What each candidate drafts. A head alone drafts the step's budget. With lookup and
        `adaptive`, the hybrid decides per request: the sources, lookup's depth and the head's
        nodes (beside lookup its share of the budget, alone a small tree), priced at this batch
        size; without `adaptive` every source drafts its share of the full tree."""
        if not self.spec.lookup:
            for c in cands:
                c.head_nodes = c.budget if self.head is not None else 0
            return
        if not self.spec.adaptive:
            for c in cands:
                hs = self.states[c.seq.request_id].hybrid
                if self.head is not None:
                    c.head_nodes = self.hybrid.head_nodes(hs, c.budget) if c.branches else c.budget
            return
        step = StepContext(len(cands), head=self.head is not None, head_seqs=self.head_seqs)
        for c, share in zip(cands, self._fixed_shares(cands)):
            seq, hs = c.seq, self.states[c.seq.request_id].hybrid
            self.hybrid.score_shadow(hs, seq.token_ids)
            choice = self.hybrid.choose(hs, c.branches, step, remaining=seq.params.max_tokens - seq.num_output_tokens,
                                        stretch=max(0, len(c.pending.tokens) - (budget + 1)), budget=c.budget,
                                        share=share)
            if c.branches and choice.mode in (StepMode.PLAIN, StepMode.HEAD):   # lookup sits out: score its proposal later
                self.hybrid.shadow(hs, len(seq.token_ids), c.branches, c.budget)
                c.branches = []
            elif c.branches and choice.lookup_depth < max(map(len, c.branches)):
                self.hybrid.shadow_cut(hs, len(seq.token_ids), c.branches, c.budget)
                c.branches = [br[:choice.lookup_depth] for br in c.branches]
            c.head_nodes = choice.head_nodes
        self.head_seqs = max(1, sum(1 for c in cands if c.head_nodes))

    def _fixed_shares(self, cands: list[Candidate]) -> list[float]:
        """How much of its part of the step's fixed cost each request's extra tokens save. While
        requests wait, a sequence that finishes sooner frees its slot for one: all of it. With none
        waiting, the batch pays the fixed cost until its slowest sequence is done, so a sequence
        ahead saves in proportion to its expected remaining steps against the slowest's (sequences
        that started together draft alike; one that pulled ahead leaves its rows to the others)."""
        if self.queue_depth() or len(cands) == 1:
            return [1.0] * len(cands)
        steps = []
        for c in cands:
            hs = self.states[c.seq.request_id].hybrid
            per_step = (hs.free_tokens or self.hybrid.free_tokens)[1]
            steps.append((c.seq.params.max_tokens - c.seq.num_output_tokens) / max(per_step, 1.0))
        slowest = max(steps)
        return [s / slowest if slowest > 0 else 1.0 for s in steps]

    def _draft_head(self, cands: list[Candidate], budget: int) -> dict[str, DraftTree]:
        """The head's trees, one batched draft per tree budget (one unless memory shrank some),
        each pruned to the nodes its candidate keeps."""
        groups: dict[int, list[Candidate]] = defaultdict(list)
        for c in cands:
            groups[c.budget].append(c)
        trees = {}
        for seq_budget, group in groups.items():
            head_budget = max(c.head_nodes for c in group)
            top_k = min(self.spec.top_k, seq_budget, head_budget)
            levels = min(self.spec.depth, seq_budget, head_budget)
            drafted = self._head_trees([self._draft_seq(c) for c in group], head_budget, top_k, levels, stretch_after=budget + 1)
            for c, (parents, tokens, depth, logprobs) in zip(group, drafted):
                if len(tokens) - 1 > c.head_nodes:
                    if logprobs is None:
                        parents, tokens, depth = parents[:c.head_nodes + 1], tokens[:c.head_nodes + 1], depth[:c.head_nodes + 1]
                    else:
                        parents, tokens, depth = prune_to_best(parents, tokens, depth, logprobs, c.head_nodes)
                n = len(tokens)
                trees[c.seq.request_id] = DraftTree(parents, tokens, depth, [i > 0 for i in range(n)], [False] * n)
        return trees

    def _head_trees(self, batch: list[DraftSeq], budget: int, top_k: int, levels: int,
                    stretch_after: int) -> list[tuple]:
        """(parents, tokens, depth, log-probs or None) of each sequence's head tree."""
        pending = sum(len(d.state.tokens) for d in batch)
        stretch = max(len(d.state.tokens) for d in batch) > stretch_after     # more than one step's worth
        t = time.perf_counter()
        root_hidden, root_lp = self.drafter.catch_up(batch)
        forwarded = levels - 1 if self.shape is None else min(budget, self.shape.num_nodes - 1)
        self.head_work[0] += len(batch) * (1 + forwarded * (top_k if self.shape is None else 1))
        self.head_work[1] += levels
        if stretch:
            seconds = time.perf_counter() - t
            self.stretch_s += seconds
            self.hybrid.observe_catch_up(pending, seconds)
        if self.shape is None:
            tree = self.drafter.grow_dynamic(batch, root_hidden, root_lp, budget, top_k, levels)
        else:
            sub = self.shape
            if budget < sub.num_nodes - 1:   # a prefix of a parents-first tree is a tree
                sub = type(sub)(sub.parents[:budget + 1], sub.depth[:budget + 1], sub.rank[:budget + 1])
            tree = self.drafter.grow_static(batch, root_lp, root_hidden, sub)
        trees = []
        for b in range(len(batch)):
            n = int(tree.num_nodes[b])
            lp = tree.logprobs[b, :n].tolist() if self.shape is None else None
            trees.append((tree.parents[b, :n].tolist(), tree.tokens[b, :n].tolist(), tree.depth[b, :n].tolist(), lp))
        return trees
