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

Drafting is in draft_step.py, verification in verify_step.py; this file holds the step, the
per-request state and the bookkeeping.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from eagle_worker.block_manager import BlockManager
from eagle_worker.decode_worker import NewTokens, forward_item, record_prompt_logprobs
from eagle_worker.model_runner import ModelRunner, zeroed
from eagle_worker.parallel import tp_size
from eagle_worker.sampler import argmax_suffices
from eagle_worker.scheduler import ScheduledSeq
from eagle_worker.sequence import Sequence
from eagle_worker.speculative.config import SpecConfig
from eagle_worker.speculative.draft_step import PLAIN_TREE, DraftStep
from eagle_worker.speculative.draft_tree import DraftTree, StepMode
from eagle_worker.speculative.drafter import Drafter, DraftState
from eagle_worker.speculative.head_loader import head_dtype, load_draft_head
from eagle_worker.speculative.heads import DraftHead, TargetVocab
from eagle_worker.speculative.hybrid import HybridSplit, HybridState
from eagle_worker.speculative.lookup import NgramIndex
from eagle_worker.speculative.policy import SpecPolicy
from eagle_worker.speculative.step_cost import StepWork
from eagle_worker.speculative.tree import MC_SIM_7B_63, chain, static_tree
from eagle_worker.speculative.verify_step import VerifyStep


@dataclass
class RequestState:
    """What the worker keeps about one request between steps."""

    draft: DraftState                          # the head's pending inputs
    index: NgramIndex | None = None            # prompt lookup's n-grams of the request
    hybrid: HybridState = field(default_factory=HybridState)


class EagleWorker(DraftStep, VerifyStep):
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
