"""The EAGLE worker's verification half (mixed into `EagleWorker`): each tree as a forward item,
then after the forward the plain rows sampled and committed, every tree accepted in one batched
walk, the accepted path's KV and features kept."""
from __future__ import annotations

import torch

from eagle_worker.decode_worker import NewTokens
from eagle_worker.model_runner import ForwardItem, ForwardResult
from eagle_worker.outputs import TokenLogprob
from eagle_worker.sampler import screenable, token_logprobs
from eagle_worker.scheduler import ScheduledSeq
from eagle_worker.sequence import Sequence
from eagle_worker.speculative.acceptance import Acceptance, accept_batch
from eagle_worker.speculative.draft_tree import DraftTree
from eagle_worker.speculative.tree import TreeBatch, ancestor_mask


class VerifyStep:
    """`EagleWorker`'s verification methods; they use its runner, block manager, states and drafter."""

    def _tree_item(self, seq: Sequence, tree: DraftTree) -> ForwardItem:
        c, n = seq.num_computed_tokens, len(tree.tokens)
        slots = self.block_manager.slots(seq, 0, c + n)
        mask = ancestor_mask(torch.tensor([tree.parents]))[0]
        return ForwardItem(token_ids=tree.tokens, positions=c + torch.tensor(tree.depth), new_slots=slots[c:],
                           ctx_slots=slots[:c], logit_rows=list(range(n)), new_token_mask=mask,
                           full_logits=not screenable(seq.params))

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
        self.block_manager.keep_subset(seq, acc.path, self.runner.copy_kv)
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
