"""EAGLE worker: draft trees with the head, verify them with the target in the same batched
forward as every other sequence's prefill chunk or plain decode, accept losslessly, keep the KV
of the accepted path only.

Per step: (1) the policy picks a tree budget for this batch size; (2) decoding sequences that get
a tree reserve uncommitted KV slots and the head drafts all trees together; (3) one target forward
over prefill chunks, plain decodes and tree tokens (tree-shaped attention masks); (4) greedy or
sampling acceptance per tree, the accepted path's KV is compacted in place and the rest dropped;
(5) the target's features of every newly committed token become the head's pending input.

With `lookup=True`, prompt-lookup branches (continuations of earlier occurrences of the context's
suffix) are merged into each tree under the same node budget, split per request by each source's
recent acceptance; without a head the tree is the lookup trie alone (pure prompt lookup).
"""
from __future__ import annotations

import time

import torch

from eagle_worker.block_manager import BlockManager
from eagle_worker.model_runner import ForwardItem, ModelRunner
from eagle_worker.sampler import argmax_suffices, sample, target_probs
from eagle_worker.scheduler import ScheduledSeq
from eagle_worker.sequence import Sequence
from eagle_worker.speculative.acceptance import accept_greedy, accept_sampling
from eagle_worker.speculative.config import SpecConfig
from eagle_worker.speculative.drafter import Drafter, DraftSeq, DraftState
from eagle_worker.speculative.head_loader import load_draft_head
from eagle_worker.speculative.heads import DraftHead
from eagle_worker.speculative.hybrid import MODES, HybridSplit, step_mode
from eagle_worker.speculative.lookup import NgramIndex, merge_branches, prune_to_best
from eagle_worker.speculative.policy import SpecPolicy
from eagle_worker.speculative.tree import MC_SIM_7B_63, ancestor_mask, chain, static_tree
from eagle_worker.decode_worker import forward_item


class EagleWorker:
    def __init__(self, runner: ModelRunner, block_manager: BlockManager, spec: SpecConfig,
                 head: DraftHead | None = None):
        self.runner = runner
        self.block_manager = block_manager
        self.spec = spec
        self.head = head or (load_draft_head(spec.draft, runner.model, runner.hf_config) if spec.draft else None)
        if self.head is not None and spec.method and spec.method != self.head.kind:
            raise ValueError(f"SpecConfig.method={spec.method!r} but the head at {spec.draft} is {self.head.kind!r}")
        for layer in self.head.attention_layers() if self.head else []:   # one layer of KV, target's slot numbering
            shape = (runner.kv_cache.shape[2], layer.num_kv_heads, layer.head_dim)
            layer.k_cache = torch.zeros(shape, dtype=runner.dtype, device=runner.device)
            layer.v_cache = torch.zeros(shape, dtype=runner.dtype, device=runner.device)
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
        self.hybrid = HybridSplit()
        self.stretch_s = 0.0               # this step's seconds catching the head up on a stretch
        self.states: dict[str, DraftState] = {}
        depth = max(spec.depth if self.shape is None else self.shape.max_depth, spec.lookup_max_tokens if spec.lookup else 0)
        self.totals = {"draft_s": 0.0, "verify_s": 0.0, "spec_steps": 0, "plain_steps": 0,
                       "drafted_at_depth": [0] * depth, "accepted_at_depth": [0] * depth}

    def release(self, seq: Sequence) -> None:
        self.states.pop(seq.request_id, None)

    # ---- one step ---------------------------------------------------------------------------
    def execute(self, batch: list[ScheduledSeq]) -> dict[str, list[tuple[int, float | None]]]:
        t0 = time.perf_counter()
        self.stretch_s = 0.0
        decodes = [it for it in batch if it.num_tokens == 1 and it.completes and self._ready(it.seq)]
        budget = self.policy.choose(len(decodes)) if decodes else 0
        trees = self._draft(decodes, budget) if budget else {}
        t1 = time.perf_counter()
        items = [self._tree_item(it.seq, trees[it.seq.request_id]) if it.seq.request_id in trees
                 else forward_item(self.block_manager, it) for it in batch]
        result = self.runner.forward(items, aux_layers=self.head.aux_layers if self.head else (),
                                     argmax_only=argmax_suffices([it.seq.params for it in batch if it.completes]))
        features = self.head.target_features((result.hidden, result.aux_hidden)) if self.head else None
        new_tokens = self._accept(batch, items, trees, result, features)
        t2 = time.perf_counter()
        self._account(batch, decodes, budget if trees else 0, new_tokens, t0, t1, t2, trees)
        return new_tokens

    def _ready(self, seq: Sequence) -> bool:
        st = self.states.get(seq.request_id)
        if st is None or self.head is None:
            return st is not None
        return len(st.tokens) > 0 and st.start + len(st.tokens) == seq.num_computed_tokens

    def _draft(self, decodes: list[ScheduledSeq], budget: int) -> dict[str, tuple]:
        """Reserve slots and draft a tree of at most `budget` nodes for each decoding sequence that fits.

        Returns per request (parents, tokens, depth, from_head, from_lookup)."""
        spec = self.spec
        top_k = min(spec.top_k, budget)
        levels = min(spec.depth, budget)      # a tree of n nodes is at most n deep: small budgets draft less
        reserve = budget + 1
        if self.head is not None and self.shape is None:
            reserve = max(reserve, 1 + (levels - 1) * top_k)
        batch: list[DraftSeq] = []
        included: list[Sequence] = []
        for it in decodes:
            seq = it.seq
            c = seq.num_computed_tokens
            if c + reserve > self.runner.max_model_len or not self.block_manager.can_append(seq, reserve):
                continue
            self.block_manager.append_slots(seq, reserve)
            batch.append(DraftSeq(c, self.block_manager.slots(seq, 0, c + reserve), seq.token_ids[-1],
                                  self.states[seq.request_id]))
            included.append(seq)
        if not batch:
            return {}
        proposals = {}
        if spec.lookup:
            for d, seq in zip(batch, included):
                d.state.index.extend(seq.token_ids)
                proposals[seq.request_id] = d.state.index.propose(spec.lookup_max_tokens, spec.lookup_max_branches)
        hybrid = self.head is not None and spec.lookup
        use_head = []
        for d, seq in zip(batch, included):
            if not hybrid:
                use_head.append(self.head is not None)
                continue
            self.hybrid.score_shadow(d.state, seq.token_ids)
            branches = proposals[seq.request_id]
            mode = self.hybrid.choose(d.state, branches, len(batch),
                                      remaining=seq.params.max_tokens - seq.num_output_tokens,
                                      stretch=max(0, len(d.state.tokens) - (budget + 1)), budget=budget)
            if branches and mode in ("plain", "head"):        # lookup sits out: score its proposal later
                self.hybrid.shadow(d.state, len(seq.token_ids), branches, budget)
                proposals[seq.request_id] = []
            use_head.append(mode in ("head", "merged"))
        # the head drafts only the nodes this step keeps: beside lookup its share of the budget, alone
        # a small tree (a tree of n nodes is at most n deep and needs at most n candidates per level)
        keep = {seq.request_id: (self.hybrid.head_nodes(d.state, budget) if proposals.get(seq.request_id)
                                 else self.hybrid.alone_nodes(budget)) if hybrid else budget
                for d, seq, u in zip(batch, included, use_head) if u}
        head_budget = max(keep.values(), default=budget)
        top_k, levels = min(top_k, head_budget), min(levels, head_budget)
        drafted = iter(self._head_trees([d for d, u in zip(batch, use_head) if u], head_budget, top_k, levels,
                                        stretch_after=budget + 1) if keep else [])
        out = {}
        for b, seq in enumerate(included):
            head = use_head[b]
            parents, tokens, depth, logprobs = next(drafted) if head else ([-1], [seq.token_ids[-1]], [0], [0.0])
            if head and len(tokens) - 1 > keep[seq.request_id]:
                n = keep[seq.request_id]
                if logprobs is None:
                    parents, tokens, depth = parents[:n + 1], tokens[:n + 1], depth[:n + 1]
                else:
                    parents, tokens, depth = prune_to_best(parents, tokens, depth, logprobs, n)
            branches = proposals.get(seq.request_id) or []
            out[seq.request_id] = merge_branches(parents, tokens, depth, branches, budget - (len(tokens) - 1))
        return out

    def _head_trees(self, batch: list[DraftSeq], budget: int, top_k: int, levels: int,
                    stretch_after: int) -> list[tuple]:
        pending = sum(len(d.state.tokens) for d in batch)
        stretch = max(len(d.state.tokens) for d in batch) > stretch_after     # more than one step's worth
        t = time.perf_counter()
        root_hidden, root_lp = self.drafter.catch_up(batch)
        self.stretch_s = time.perf_counter() - t if stretch else 0.0
        if stretch:
            self.hybrid.observe_catch_up(pending, self.stretch_s)
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

    def _tree_item(self, seq: Sequence, tree: tuple) -> ForwardItem:
        parents, tokens, depth = tree[:3]
        c, n = seq.num_computed_tokens, len(tokens)
        slots = self.block_manager.slots(seq, 0, c + n)
        mask = ancestor_mask(torch.tensor([parents]))[0]
        return ForwardItem(token_ids=tokens, positions=c + torch.tensor(depth), new_slots=slots[c:],
                           ctx_slots=slots[:c], logit_rows=list(range(n)), new_token_mask=mask)

    # ---- acceptance and bookkeeping ---------------------------------------------------------
    def _accept(self, batch, items, trees, result, features) -> dict[str, list[tuple[int, float | None]]]:
        new_tokens: dict[str, list[tuple[int, float | None]]] = {}
        plain = [(it, item, off) for it, item, off in zip(batch, items, result.row_offsets)
                 if it.seq.request_id not in trees]
        sampled = {}
        rows = [sum(len(x.logit_rows) for x in items[:i]) for i in range(len(items))]
        row_of = {id(item): r for item, r in zip(items, rows)}
        want = [(it, item) for it, item, _ in plain if it.completes]
        if want and result.logits is None:
            toks = result.argmax[torch.tensor([row_of[id(item)] for _, item in want])].tolist()
            sampled = {it.seq.request_id: (toks[i], None) for i, (it, _) in enumerate(want)}
        elif want:
            logits = result.logits[torch.tensor([row_of[id(item)] for _, item in want])]
            toks, lps = sample(logits, [it.seq.params for it, _ in want], [it.seq.generator for it, _ in want])
            sampled = {it.seq.request_id: (toks[i], lps[i] if lps else None) for i, (it, _) in enumerate(want)}
        for it, item, off in plain:
            seq, n, completes = it.seq, it.num_tokens, it.completes
            start = seq.num_computed_tokens
            st = self._state(seq.request_id, start)
            if start == 0:
                st.reset()
            self.block_manager.commit(seq, n)
            nxt = seq.token_ids[start + 1:start + n]
            if completes:
                tok, lp = sampled[seq.request_id]
                new_tokens[seq.request_id] = [(tok, lp)]
                nxt = nxt + [tok]
                if n == 1:
                    seq.metrics.num_target_forwards += 1
                    seq.metrics.num_decode_tokens += 1
            else:
                nxt = nxt + [seq.token_ids[start + n]]
            if features is not None:
                st.add(features[off:off + n], nxt)
        for it, item, off in zip(batch, items, result.row_offsets):
            seq = it.seq
            if seq.request_id not in trees:
                continue
            parents, tokens, depth, from_head, from_lookup = trees[seq.request_id]
            r = row_of[id(item)]
            logits = (result.logits if result.logits is not None else result.argmax)[r:r + len(tokens)]
            p = seq.params
            if p.greedy:
                acc = accept_greedy(parents, tokens, logits)
            else:
                acc = accept_sampling(parents, tokens, lambda rows, _idx, p=p: target_probs(rows, p),
                                      seq.generator, target_logits=logits)
            src, dst = self.block_manager.keep_subset(seq, acc.path)
            self.runner.copy_kv(src, dst)
            st = self.states[seq.request_id]
            if features is not None:
                st.add(features[off + torch.tensor(acc.path)], acc.tokens)
            self._count_sources(seq, st, acc.path[1:], parents, from_head, from_lookup)
            lps = torch.log_softmax(logits[torch.tensor(acc.path)].float(), -1) if p.logprobs else None
            new_tokens[seq.request_id] = [(t, lps[i, t].item() if lps is not None else None) for i, t in enumerate(acc.tokens)]
            seq.metrics.num_target_forwards += 1
            seq.metrics.num_decode_tokens += len(acc.tokens)
            self._count_depths(seq, depth, acc.num_accepted)
        return new_tokens

    def _state(self, request_id: str, start: int) -> DraftState:
        st = self.states.get(request_id)
        if st is None:
            st = self.states[request_id] = DraftState(start=start)
            if self.spec.lookup:
                st.index = NgramIndex(*self.spec.lookup_ngram)
        return st

    def _count_sources(self, seq: Sequence, st: DraftState, accepted: list[int], parents: list[int],
                       from_head, from_lookup) -> None:
        """Per-source acceptance: the request's metrics and the moving averages that split the budget."""
        h = sum(1 for i in accepted if from_head[i])
        lk = sum(1 for i in accepted if from_lookup[i])
        m = seq.metrics
        m.accepted_from_head += h
        m.accepted_from_lookup += lk
        if any(from_head[1:]):          # only steps the head drafted say how well it does
            st.ema_head = 0.7 * st.ema_head + 0.3 * h
        st.ema_lookup = 0.7 * st.ema_lookup + 0.3 * lk
        if self.head is not None and self.spec.lookup:
            mode = step_mode(any(from_head[1:]), any(from_lookup[1:]))
            m.steps_by_source[mode] = m.steps_by_source.get(mode, 0) + 1
            head_only = sum(1 for i in accepted if from_head[i] and not from_lookup[i])
            self.hybrid.observe_accepted(st, mode, head_only, len(accepted) + 1)
            if any(from_lookup[1:]):      # a whole branch accepted: the path ends on a lookup leaf
                inner = {parents[i] for i in range(1, len(parents)) if from_lookup[i]}
                self.hybrid.observe_lookup(st, lk, bool(lk) and from_lookup[accepted[-1]] and accepted[-1] not in inner)

    def _count_depths(self, seq: Sequence, depth: list[int], accepted: int) -> None:
        max_d = max(depth)
        per = seq.metrics.accepted_per_depth
        per.extend([0] * (len(self.totals["drafted_at_depth"]) - len(per)))
        for d in range(1, max_d + 1):
            self.totals["drafted_at_depth"][d - 1] += 1
            if d <= accepted:
                self.totals["accepted_at_depth"][d - 1] += 1
                per[d - 1] += 1

    def _account(self, batch, decodes, budget, new_tokens, t0, t1, t2, trees) -> None:
        self.totals["draft_s"] += t1 - t0
        self.totals["verify_s"] += t2 - t1
        self.totals["spec_steps" if budget else "plain_steps"] += 1
        # pure decode steps measure cleanly; catching the head up on a stretch it sat out (a prompt,
        # steps without a tree) is paid once per stretch, so it is not charged to this step's budget
        step_s = t2 - t0 - self.stretch_s
        if decodes and len(decodes) == len(batch):
            produced = sum(len(new_tokens.get(it.seq.request_id, ())) for it in decodes)
            self.policy.observe(len(decodes), budget, produced, step_s)
            if self.head is not None and self.spec.lookup and trees:   # the hybrid times each mode
                modes = {step_mode(any(t[3][1:]), any(t[4][1:])) for t in trees.values()}
                self.hybrid.observe(len(decodes), max(modes, key=MODES.index), step_s)

    def stats(self) -> dict:
        t = self.totals
        rates = [a / d if d else 0.0 for a, d in zip(t["accepted_at_depth"], t["drafted_at_depth"])]
        return {"spec_draft_s": t["draft_s"], "spec_verify_s": t["verify_s"], "spec_steps": t["spec_steps"],
                "plain_steps": t["plain_steps"], "acceptance_rate_per_depth": rates, "policy": self.policy.snapshot()}
