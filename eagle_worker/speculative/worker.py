"""EAGLE worker: draft trees with the head, verify them with the target in the same batched
forward as every other sequence's prefill chunk or plain decode, accept losslessly, keep the KV
of the accepted path only.

Per step: (1) each decoding sequence gets its tree budget: with prompt lookup the hybrid sizes
each sequence's tree from its sources' expected yield and the device's cost of a row at this batch
size (hybrid.py), a head alone gets the budget the policy measured best for this batch size
(policy.py); (2) each sequence drafts within the lookahead KV slots the scheduler reserved for it
(fewer slots, a smaller tree) and the head drafts all trees together; (3) one target forward over prefill chunks, plain
decodes and tree tokens (tree-shaped attention masks); (4) greedy or sampling acceptance per tree,
the accepted path's KV is compacted in place and the rest dropped; (5) the target's features of
every newly committed token become the head's pending input.

With `lookup=True`, prompt-lookup branches (continuations of earlier occurrences of the context's
suffix) are merged into each tree under the same node budget, split per request by each source's
recent acceptance; without a head the tree is the lookup trie alone (pure prompt lookup).
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from eagle_worker.block_manager import BlockManager
from eagle_worker.decode_worker import NewTokens, forward_item, record_prompt_logprobs
from eagle_worker.model_runner import ForwardItem, ForwardResult, ModelRunner, zeroed
from eagle_worker.outputs import TokenLogprob
from eagle_worker.parallel import tp_size
from eagle_worker.sampler import argmax_suffices, screenable, token_logprobs
from eagle_worker.scheduler import ScheduledSeq
from eagle_worker.sequence import Sequence
from eagle_worker.speculative.acceptance import Acceptance, accept_batch
from eagle_worker.speculative.config import SpecConfig
from eagle_worker.speculative.draft_tree import DraftTree, StepMode
from eagle_worker.speculative.drafter import Drafter, DraftSeq, DraftState
from eagle_worker.speculative.head_loader import head_dtype, load_draft_head
from eagle_worker.speculative.heads import DraftHead, TargetVocab
from eagle_worker.speculative.hybrid import HybridSplit, HybridState, StepContext
from eagle_worker.speculative.lookup import NgramIndex, merge_branches, prune_to_best
from eagle_worker.speculative.policy import SpecPolicy
from eagle_worker.speculative.step_cost import StepWork
from eagle_worker.speculative.tree import MC_SIM_7B_63, TreeBatch, ancestor_mask, chain, static_tree

PLAIN_TREE = DraftTree.root_only(0)   # what a step that drafted nothing verified: its root alone


@dataclass
class RequestState:
    """What the worker keeps about one request between steps."""

    draft: DraftState                          # the head's pending inputs
    index: NgramIndex | None = None            # prompt lookup's n-grams of the request
    hybrid: HybridState = field(default_factory=HybridState)


@dataclass
class Candidate:
    """A decoding sequence that drafts this step."""

    seq: Sequence
    pending: DraftState                        # the head's pending inputs
    budget: int                                # draft nodes its lookahead slots allow
    lookahead: int                             # slots reserved past its root
    branches: list[list[int]] = field(default_factory=list)   # lookup's proposal
    head_nodes: int = 0                        # nodes the head drafts and keeps (0: it sits out)


class EagleWorker:
    def __init__(self, runner: ModelRunner, block_manager: BlockManager, spec: SpecConfig,
                 head: DraftHead | None = None):
        self.runner = runner
        self.block_manager = block_manager
        self.spec = spec
        if head is None and spec.draft:
            # the head runs on rank 0 alone; under TP it borrows full copies of the sharded vocab tables
            vocab = TargetVocab(runner.model, *runner.gather_vocab()) if tp_size() > 1 else None
            head = load_draft_head(spec.draft, runner.model, runner.hf_config, vocab,
                                   head_dtype(spec.head_dtype, runner.dtype, runner.device))
        self.head = head
        if self.head is not None and spec.method and spec.method != self.head.kind:
            raise ValueError(f"SpecConfig.method={spec.method!r} but the head at {spec.draft} is {self.head.kind!r}")
        for layer in self.head.attention_layers() if self.head else []:   # one layer of KV, target's slot numbering
            shape = (runner.kv_cache.shape[2], layer.num_kv_heads, layer.head_dim)
            dtype = next(self.head.parameters()).dtype
            layer.k_cache = zeroed(shape, dtype, runner.device)
            layer.v_cache = zeroed(shape, dtype, runner.device)
        self.drafter = Drafter(self.head, runner.device) if self.head else None
        if spec.tree == "chain":
            self.shape = chain(spec.depth)
        elif spec.tree == "static":
            self.shape = static_tree(spec.static_choices or MC_SIM_7B_63)
        else:
            self.shape = None
        full = spec.num_draft_tokens
        if self.shape is not None and self.head is not None and not spec.lookup:
            full = min(full, self.shape.num_nodes - 1)
        self.policy = SpecPolicy(full, spec.adaptive)
        self.num_lookahead_slots = self._slots_needed(full) - 1   # the scheduler reserves these per decode
        self.hybrid = HybridSplit(depth=spec.depth, top_k=spec.top_k)
        self.stretch_s = 0.0               # this step's seconds catching the head up on a stretch
        self.head_work = [0, 0]            # this step's head rows with logits and head passes
        self.head_seqs = 1                 # sequences the head drafted for last step
        self.queue_depth = lambda: 0       # requests waiting for a batch slot (the engine sets it)
        self.states: dict[str, RequestState] = {}
        depth = max(spec.depth if self.shape is None else self.shape.max_depth, spec.lookup_max_tokens if spec.lookup else 0)
        self.totals = {"draft_s": 0.0, "verify_s": 0.0, "spec_steps": 0, "plain_steps": 0, "trees_shrunk_for_memory": 0,
                       "decode_seq_steps": 0, "draft_nodes": 0,
                       "drafted_at_depth": [0] * depth, "accepted_at_depth": [0] * depth}

    def release(self, seq: Sequence) -> None:
        self.states.pop(seq.request_id, None)

    def head_kv_done(self, seq: Sequence) -> int | None:
        """Positions of `seq` whose head KV is written (None without a head): what cached blocks carry."""
        rs = self.states.get(seq.request_id)
        return rs.draft.start if rs is not None and self.head is not None else None

    def flush_head_kv(self, seqs: list[Sequence]) -> None:
        """Finishing requests write the head KV they still owe their committed positions (pending
        while the head sat out), so the blocks they leave in the prefix cache carry it: one head
        pass for all of them."""
        if self.head is None:
            return
        work = []
        for seq in seqs:
            rs = self.states.get(seq.request_id)
            st = rs.draft if rs is not None else None
            if st is not None and st.tokens and st.start + len(st.tokens) == seq.num_computed_tokens:
                work.append((self.block_manager.slots(seq, 0, seq.num_computed_tokens), st, 0))
        if work:
            self.drafter.write_ahead(work)

    def _slots_needed(self, budget: int) -> int:
        """KV slots (root included) a tree of `budget` draft nodes uses while drafting: a dynamic head
        tree writes every node it forwards (top_k per level), more than the nodes it keeps."""
        slots = budget + 1
        if self.head is not None and self.shape is None and budget:
            slots = max(slots, 1 + (min(self.spec.depth, budget) - 1) * min(self.spec.top_k, budget))
        return slots

    def _fit(self, budget: int, lookahead: int) -> int:
        """The largest budget up to `budget` whose tree fits in `lookahead` slots past the root."""
        while budget and self._slots_needed(budget) > lookahead + 1:
            budget -= 1
        return budget

    # ---- one step ---------------------------------------------------------------------------
    def execute(self, batch: list[ScheduledSeq]) -> NewTokens:
        t0 = time.perf_counter()
        self.stretch_s, self.head_work = 0.0, [0, 0]
        decodes = [it for it in batch if it.num_tokens == 1 and it.completes and self._ready(it.seq)]
        # with lookup the hybrid sizes each sequence's tree (the budget is its cap); a head alone
        # draws one budget per step from the policy
        budget = (self.policy.full if self.spec.lookup else self.policy.choose(len(decodes))) if decodes else 0
        trees = self._draft(decodes, budget) if budget else {}
        # a sequence that drafts nothing this step decodes plainly: batched sampling, no KV compaction
        went_plain = {rid for rid, t in trees.items() if not t.num_draft_nodes}
        trees = {rid: t for rid, t in trees.items() if t.num_draft_nodes}
        self.totals["decode_seq_steps"] += len(decodes)
        self.totals["draft_nodes"] += sum(t.num_draft_nodes for t in trees.values())
        t1 = time.perf_counter()
        items = [self._tree_item(it.seq, trees[it.seq.request_id]) if it.seq.request_id in trees
                 else forward_item(self.block_manager, it) for it in batch]
        result = self.runner.forward(items, aux_layers=self.head.aux_layers if self.head else (),
                                     argmax_only=argmax_suffices([it.seq.params for it in batch if it.completes]))
        record_prompt_logprobs(batch, result)
        features = self.head.target_features((result.hidden, result.aux_hidden)) if self.head else None
        prefill = [(it, it.completes) for it in batch if it.num_tokens > 1 or not it.completes]   # before commits
        new_tokens = self._verify(batch, items, trees, result, features)
        for it in decodes:
            if it.seq.request_id in went_plain:    # counted as its sources' plain step
                self._count_sources(it.seq, self.states[it.seq.request_id].hybrid, [], PLAIN_TREE)
        if self.head is not None:
            self._write_prompt_head_kv(prefill)
        t2 = time.perf_counter()
        self._account(batch, items, decodes, sum(it.num_tokens for it, _ in prefill), budget if trees else 0, len(trees),
                      new_tokens, t0, t1, t2)
        return new_tokens

    def _ready(self, seq: Sequence) -> bool:
        rs = self.states.get(seq.request_id)
        if rs is None or self.head is None:
            return rs is not None
        st = rs.draft
        return len(st.tokens) > 0 and st.start + len(st.tokens) == seq.num_computed_tokens

    # ---- drafting ---------------------------------------------------------------------------
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

    def _tree_item(self, seq: Sequence, tree: DraftTree) -> ForwardItem:
        c, n = seq.num_computed_tokens, len(tree.tokens)
        slots = self.block_manager.slots(seq, 0, c + n)
        mask = ancestor_mask(torch.tensor([tree.parents]))[0]
        return ForwardItem(token_ids=tree.tokens, positions=c + torch.tensor(tree.depth), new_slots=slots[c:],
                           ctx_slots=slots[:c], logit_rows=list(range(n)), new_token_mask=mask,
                           full_logits=not screenable(seq.params))

    # ---- verification -----------------------------------------------------------------------
    def _verify(self, batch: list[ScheduledSeq], items: list[ForwardItem], trees: dict[str, DraftTree],
                result: ForwardResult, features: torch.Tensor | None) -> NewTokens:
        """Sample the plain rows, commit them, then accept each tree: every sequence's new tokens."""
        first_row = [sum(len(x.logit_rows) for x in items[:i]) for i in range(len(items))]
        plain = [i for i, it in enumerate(batch) if it.seq.request_id not in trees]
        sampled = self._sample_plain([(batch[i], first_row[i]) for i in plain if batch[i].completes], result)
        new_tokens: NewTokens = {}
        for i in plain:
            token = self._commit_plain(batch[i], sampled.get(batch[i].seq.request_id), result.row_offsets[i], features)
            if token is not None:
                new_tokens[batch[i].seq.request_id] = [token]
        work = [(it.seq, trees[it.seq.request_id], first_row[i], result.row_offsets[i])
                for i, it in enumerate(batch) if it.seq.request_id in trees]
        for (seq, tree, row, offset), acc in zip(work, self._accept_trees(work, result)):
            new_tokens[seq.request_id] = self._commit_tree(seq, tree, acc, row, offset, result, features)
        return new_tokens

    def _sample_plain(self, wanted: list[tuple[ScheduledSeq, int]], result: ForwardResult) -> dict[str, tuple]:
        """(token, logprob) for each sequence whose chunk ended this step, from its logit row."""
        if not wanted:
            return {}
        idx = [row for _, row in wanted]
        if result.rows is None:
            return {it.seq.request_id: (t, None) for (it, _), t in zip(wanted, result.argmax[idx].tolist())}
        drawn = result.rows.sample(idx, [it.seq.sample_row() for it, _ in wanted])
        return {it.seq.request_id: d for (it, _), d in zip(wanted, drawn)}

    def _commit_plain(self, it: ScheduledSeq, sampled: tuple | None, offset: int,
                      features: torch.Tensor | None) -> tuple | None:
        """Commit a prefill chunk or plain decode; its features (paired with the tokens that follow
        them) become the head's pending input. Returns the sampled token, if the chunk ended."""
        seq, n, completes = it.seq, it.num_tokens, it.completes
        start = seq.num_computed_tokens
        rs = self._request_state(seq, start)
        if it.admitted:                 # (re)admitted: the KV before `start` came from the prefix cache
            rs.draft.reset(start)
        self.block_manager.commit(seq, n)
        following = seq.token_ids[start + 1:start + n]
        if completes:
            following.append(sampled[0])
            if n == 1:
                seq.metrics.num_target_forwards += 1
                seq.metrics.num_decode_tokens += 1
        else:
            following.append(seq.token_ids[start + n])
        if features is not None:
            rs.draft.add(features[offset:offset + n], following)
        return sampled if completes else None

    def _accept_trees(self, work: list[tuple], result: ForwardResult) -> list[Acceptance]:
        """Every tree of the step in one batched walk: by the forward's argmax when the step is all
        plain greedy, otherwise by each visited node's token from `draw_tokens`, the very draw
        plain decoding makes at that output position (so the text does not depend on the tree)."""
        if not work:
            return []
        batch = TreeBatch.stack([t.parents for _, t, _, _ in work], [t.tokens for _, t, _, _ in work])
        if result.rows is None:
            return accept_batch(batch, result.argmax, row_offsets=torch.tensor([row for _, _, row, _ in work]))

        def target_tokens(b: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
            rows, ctx = [], []
            for bb, n in zip(b.tolist(), node.tolist()):
                seq, tree, row, _ = work[bb]
                rows.append(row + n)
                ctx.append(seq.sample_row(tree.path_tokens(n)))
            return torch.tensor(result.rows.tokens(rows, ctx))

        return accept_batch(batch, target_tokens)

    def _commit_tree(self, seq: Sequence, tree: DraftTree, acc: Acceptance, row: int, offset: int,
                     result: ForwardResult, features: torch.Tensor | None) -> list[tuple[int, TokenLogprob | None]]:
        """Keep the accepted path's KV and features, drop the rest; the raw target logprobs of
        each kept position when asked."""
        src, dst = self.block_manager.keep_subset(seq, acc.path)
        self.runner.copy_kv(src, dst)
        rs = self.states[seq.request_id]
        if features is not None:
            rs.draft.add(features[offset + torch.tensor(acc.path)], acc.tokens)
        self._count_sources(seq, rs.hybrid, acc.path[1:], tree)
        lps: list[TokenLogprob | None] = [None] * len(acc.tokens)
        if seq.params.logprobs is not None:
            lps = token_logprobs(result.rows.logits([row + i for i in acc.path]), acc.tokens,
                                 [seq.params.logprobs] * len(acc.tokens))
        seq.metrics.num_target_forwards += 1
        seq.metrics.num_decode_tokens += len(acc.tokens)
        self._count_depths(seq, tree.depth, acc.num_accepted)
        return list(zip(acc.tokens, lps))

    def _write_prompt_head_kv(self, chunks: list[tuple[ScheduledSeq, bool]]) -> None:
        """Prefill chunks write the head's KV for their prompt positions now, not at the first draft,
        so the blocks they fill are cached with it (prefix_cache.py); the root's pair waits for the draft."""
        work = []
        for it, completed in chunks:
            st = self.states[it.seq.request_id].draft
            if len(st.tokens) > int(completed):
                work.append((it.seq, st, int(completed)))
        if work:
            self.drafter.write_ahead([(self.block_manager.slots(seq, 0, st.start + len(st.tokens)), st, keep)
                                      for seq, st, keep in work])

    def _request_state(self, seq: Sequence, start: int) -> RequestState:
        rs = self.states.get(seq.request_id)
        if rs is None:
            index = NgramIndex(*self.spec.lookup_ngram) if self.spec.lookup else None
            rs = self.states[seq.request_id] = RequestState(DraftState(start=start), index)
            rs.hybrid.sampled = not argmax_suffices([seq.params])
        return rs

    # ---- bookkeeping ------------------------------------------------------------------------
    def _count_sources(self, seq: Sequence, hs: HybridState, accepted: list[int], tree: DraftTree) -> None:
        """Per-source acceptance: the request's metrics and the moving averages that split the budget."""
        h = sum(1 for i in accepted if tree.from_head[i])
        lk = sum(1 for i in accepted if tree.from_lookup[i])
        m = seq.metrics
        m.accepted_from_head += h
        m.accepted_from_lookup += lk
        mode = tree.mode
        if mode in (StepMode.HEAD, StepMode.MERGED):     # only steps the head drafted say how well it does
            hs.ema_head = 0.7 * hs.ema_head + 0.3 * h
        hs.ema_lookup = 0.7 * hs.ema_lookup + 0.3 * lk
        if self.spec.lookup:
            m.steps_by_source[mode.value] = m.steps_by_source.get(mode.value, 0) + 1
            head_only = sum(1 for i in accepted if tree.from_head[i] and not tree.from_lookup[i])
            self.hybrid.observe_accepted(hs, mode, head_only, len(accepted) + 1, head_nodes=sum(tree.from_head[1:]),
                                         first_node=1 in accepted)    # node 1: the head's first guess
            if mode in (StepMode.LOOKUP, StepMode.MERGED):   # a whole branch accepted: the path ends on a lookup leaf
                self.hybrid.observe_lookup(hs, lk, bool(lk) and tree.lookup_leaf(accepted[-1]))

    def _count_depths(self, seq: Sequence, depth: list[int], accepted: int) -> None:
        max_d = max(depth)
        per = seq.metrics.accepted_per_depth
        per.extend([0] * (len(self.totals["drafted_at_depth"]) - len(per)))
        for d in range(1, max_d + 1):
            self.totals["drafted_at_depth"][d - 1] += 1
            if d <= accepted:
                self.totals["accepted_at_depth"][d - 1] += 1
                per[d - 1] += 1

    def _account(self, batch, items, decodes, prefill_tokens, budget, trees, new_tokens, t0, t1, t2) -> None:
        """`prefill_tokens`: prompt tokens of the step's prefill chunks, counted before the step committed
        them (after it, every chunk, a decode too, looks unfinished)."""
        self.totals["draft_s"] += t1 - t0
        self.totals["verify_s"] += t2 - t1
        self.totals["spec_steps" if budget else "plain_steps"] += 1
        # pure decode steps measure cleanly; catching the head up on a stretch it sat out (a prompt,
        # steps without a tree) is paid once per stretch, so it is not charged to this step's budget
        step_s = t2 - t0 - self.stretch_s
        if decodes and len(decodes) == len(batch):
            produced = sum(len(new_tokens.get(it.seq.request_id, ())) for it in decodes)
            self.policy.observe(len(decodes), budget, produced, step_s)
        if self.spec.lookup:            # the hybrid prices rows from every step's rows and seconds
            rows = sum(len(x.logit_rows) for x in items)
            sampled = sum(len(x.logit_rows) for it, x in zip(batch, items) if not argmax_suffices([it.seq.params]))
            self.hybrid.observe(StepWork(len(batch), rows, *self.head_work, prefill_tokens=prefill_tokens,
                                         sampled_rows=sampled, trees=trees), step_s)

    def stats(self) -> dict:
        t = self.totals
        rates = [a / d if d else 0.0 for a, d in zip(t["accepted_at_depth"], t["drafted_at_depth"])]
        return {"spec_draft_s": t["draft_s"], "spec_verify_s": t["verify_s"], "spec_steps": t["spec_steps"],
                "plain_steps": t["plain_steps"], "spec_trees_shrunk_for_memory": t["trees_shrunk_for_memory"],
                "acceptance_rate_per_depth": rates,
                "policy": self.policy.snapshot() if not self.spec.lookup else self.hybrid.cost.snapshot()}
