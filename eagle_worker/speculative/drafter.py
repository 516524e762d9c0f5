"""The draft loop: catch the head up on the target's new features, then grow one tree per sequence.

Head input pairs (feature of position p, token at p+1) run at position p and predict the feature
of p+1. After every target step each sequence has *pending* pairs: the features the target just
computed for its committed tokens, paired with the tokens that follow them (the last one being the
newest sampled token, the tree's root). `catch_up` writes those pairs into the head's KV cache in
one batched head forward and returns the head's view after the root; `grow_*` then expands the
tree level by level, each level one batched head forward over every sequence's frontier.

The head's KV cache uses the target's slot numbering: committed positions share the target's slots,
and draft nodes borrow the sequence's uncommitted slots (offset 1 + ...). Draft entries are never
read after this step; catch-up rewrites every committed position before it is read again.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eagle_worker.attention import SeqAttention, attention_context, build_context
from eagle_worker.speculative.heads import DraftHead
from eagle_worker.speculative.tree import (
    TreeBatch,
    TreeShape,
    dynamic_tree_finish,
    dynamic_tree_start,
    dynamic_tree_step,
    static_tree_level_tokens,
)


@dataclass
class DraftState:
    """Pairs (feature, next token) of committed positions [start, start + len(tokens)) not yet in the head's KV."""

    start: int = 0
    features: list[torch.Tensor] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def add(self, features: torch.Tensor, next_tokens: list[int]) -> None:
        self.features.append(features)
        self.tokens.extend(next_tokens)

    def reset(self, start: int = 0) -> None:
        self.start, self.features, self.tokens = start, [], []


@dataclass
class DraftSeq:
    """One sequence's view for this draft: its committed length and its slot table past it."""

    committed: int            # c: tokens with target KV; the root sits at position c
    slots: torch.Tensor       # cache slots of positions 0 .. c + reserved - 1
    root_token: int
    state: DraftState


class Drafter:
    STRETCH = 16     # more pending pairs than a step accepts: the head sat out; their K/V go first, alone

    def __init__(self, head: DraftHead, device: torch.device):
        self.head = head
        self.device = device

    def _run(self, seqs: list[SeqAttention], slot_mapping: torch.Tensor, features: torch.Tensor,
             tokens: torch.Tensor, positions: torch.Tensor, logit_rows: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Head forward; hidden and draft log-probs of `logit_rows` (default: every row)."""
        ctx = build_context(seqs, slot_mapping, self.device)
        with attention_context(ctx):
            hidden = self.head(features, tokens.to(self.device), positions.to(self.device))
        if logit_rows is not None:
            hidden = hidden[logit_rows]
        return hidden, torch.log_softmax(self.head.logits(hidden).float(), dim=-1)

    @torch.inference_mode()
    def catch_up(self, batch: list[DraftSeq]) -> tuple[torch.Tensor, torch.Tensor]:
        """Write every pending pair into the head's KV; return (hidden, log-probs) after each root.
        Only the roots' hidden states are wanted, so a long stretch writes the K/V of all but its
        root's pair on its own first (no attention, no MLP for those rows)."""
        for d in batch:                       # before anything is written
            st, m = d.state, len(d.state.tokens)
            if m == 0 or st.start + m != d.committed:
                raise RuntimeError(f"draft state out of sync: pending {st.start}+{m}, committed {d.committed}")
        stretches = [(d.slots, d.state, 1) for d in batch if len(d.state.tokens) > self.STRETCH]
        if stretches:
            self.write_ahead(stretches)
        attn, slot_map, feats, toks, pos, last = [], [], [], [], [], []
        start = 0
        for d in batch:
            st, c = d.state, d.committed
            m = len(st.tokens)
            positions = torch.arange(st.start, c)
            attn.append(SeqAttention(q_start=start, q_positions=positions, kv_slots=d.slots[:c], kv_positions=torch.arange(c)))
            slot_map.append(d.slots[st.start:c])
            feats.extend(st.features)
            toks.extend(st.tokens)
            pos.append(positions)
            start += m
            last.append(start - 1)
            st.reset(c)
        # only the roots need draft logits: the other pending rows just write the head's KV
        return self._run(attn, torch.cat(slot_map), torch.cat(feats), torch.tensor(toks), torch.cat(pos),
                         logit_rows=torch.tensor(last, device=self.device))

    @torch.inference_mode()
    def write_ahead(self, batch: list[tuple[torch.Tensor, DraftState, int]]) -> None:
        """Write each state's pending pairs but its last `keep` into the head's KV: K/V only (no
        attention, no MLP, no logits), the same K/V a full pass writes."""
        slot_map, feats, toks, pos = [], [], [], []
        for slots, st, keep in batch:
            m = len(st.tokens) - keep
            f = torch.cat(st.features)
            end = st.start + m
            slot_map.append(slots[st.start:end])
            feats.append(f[:m])
            toks.extend(st.tokens[:m])
            pos.append(torch.arange(st.start, end))
            st.start, st.features, st.tokens = end, [f[m:]] if keep else [], st.tokens[m:]
        self.head.write_kv(torch.cat(feats), torch.tensor(toks).to(self.device), torch.cat(pos).to(self.device),
                           torch.cat(slot_map).to(self.device))

    def _level(self, batch: list[DraftSeq], parent_hidden: torch.Tensor, tokens: torch.Tensor,
               node_offsets: torch.Tensor, seen_offsets: torch.Tensor, seen_depths: torch.Tensor,
               visible: torch.Tensor, node_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward K nodes per sequence at depth `node_depth`, one attention description per
        sequence: keys are its committed context plus the M draft nodes forwarded so far
        (uncommitted-slot offsets `seen_offsets` [M], depths `seen_depths` [M], these K last) and
        `visible` [S, K, M] says which of them each node sees (its ancestors and itself)."""
        S, K = tokens.shape
        attn, slot_map = [], []
        node_pos = seen_depths - 1
        visible = visible.cpu()
        for s, d in enumerate(batch):
            c = d.committed
            attn.append(SeqAttention(q_start=s * K, q_positions=torch.full((K,), c + node_depth - 1),
                                     kv_slots=torch.cat([d.slots[:c], d.slots[c + seen_offsets]]),
                                     kv_positions=torch.cat([torch.arange(c), c + node_pos]),
                                     new_token_mask=visible[s]))
            slot_map.append(d.slots[c + node_offsets])
        pos = torch.tensor([d.committed + node_depth - 1 for d in batch]).repeat_interleave(K)
        hidden, logprobs = self._run(attn, torch.cat(slot_map), parent_hidden.reshape(S * K, -1),
                                     tokens.reshape(-1), pos)
        return hidden.view(S, K, -1), logprobs.view(S, K, -1)

    @torch.inference_mode()
    def grow_dynamic(self, batch: list[DraftSeq], root_hidden: torch.Tensor, root_logprobs: torch.Tensor,
                     num_nodes: int, top_k: int, levels: int) -> TreeBatch:
        """EAGLE-2: expand the top-k frontier by cumulative log-prob, keep the best `num_nodes`."""
        roots = torch.tensor([d.root_token for d in batch], device=root_logprobs.device)
        state = dynamic_tree_start(roots, root_logprobs, top_k)
        prev_hidden = root_hidden[:, None]
        offsets, depths = [], []           # per level: [K] offsets and depths of forwarded nodes
        for level in range(1, levels):
            K = state.frontier_tokens.shape[1]
            level_offsets = 1 + (level - 1) * top_k + torch.arange(K)
            offsets.append(level_offsets)
            depths.append(torch.full((K,), level))
            parent_slot = state.frontier_parent_slot[..., None].expand(-1, -1, prev_hidden.shape[-1])
            parent_hidden = torch.gather(prev_hidden, 1, parent_slot)
            tokens = self.head.to_target_ids(state.frontier_tokens)
            prev_hidden, logprobs = self._level(batch, parent_hidden, tokens, level_offsets, torch.cat(offsets),
                                                torch.cat(depths), state.frontier_mask, level)
            state = dynamic_tree_step(state, logprobs)
        tree = dynamic_tree_finish(state, num_nodes)
        tree.tokens[:, 1:] = self.head.to_target_ids(tree.tokens[:, 1:])
        return tree

    @torch.inference_mode()
    def grow_static(self, batch: list[DraftSeq], root_logprobs: torch.Tensor, root_hidden: torch.Tensor,
                    shape: TreeShape) -> TreeBatch:
        """EAGLE-1 static tree (a chain is one): child of rank r takes its parent's r-th best token."""
        S, N1 = len(batch), shape.num_nodes
        tokens = torch.zeros(S, N1, dtype=torch.long, device=root_logprobs.device)
        tokens[:, 0] = torch.tensor([d.root_token for d in batch])
        node_hidden = {0: root_hidden}
        ancestors = {0: []}
        for i in range(1, N1):
            ancestors[i] = ancestors[shape.parents[i]] + [i]
        depth_t = torch.tensor(shape.depth)
        lvl_lp = root_logprobs[:, None]
        seen: list[int] = []               # nodes forwarded so far, level by level
        for d in range(1, shape.max_depth + 1):
            nodes = shape.level(d)
            ids, _ = static_tree_level_tokens(shape, d, lvl_lp)
            tokens[:, nodes] = self.head.to_target_ids(ids)
            parents_of_next = [n for n in nodes if n in shape.parents]
            if d == shape.max_depth or not parents_of_next:
                break
            parent_hidden = torch.stack([node_hidden[shape.parents[n]] for n in nodes], 1)
            seen += nodes
            visible = torch.tensor([[m in ancestors[n] for m in seen] for n in nodes]).expand(S, -1, -1)
            hidden, lvl_lp = self._level(batch, parent_hidden, tokens[:, nodes], torch.tensor(nodes),
                                         torch.tensor(seen), depth_t[seen], visible, d)
            for j, n in enumerate(nodes):
                node_hidden[n] = hidden[:, j]
        return TreeBatch.stack([shape.parents] * S, tokens.tolist(), device=root_logprobs.device)
