"""Paged attention over a flat KV cache, with per-sequence masks (causal, tree, sliding window).

One forward pass carries an `AttentionContext`: where each new token's K/V goes (`slot_mapping`)
and, per group of sequences, which cache slots each sequence attends to and with what mask.
Prefill chunks, plain decodes and draft-tree verification are all the same thing here: a
sequence has committed context in the cache plus `q_len` new tokens whose mutual visibility is
given by a [q_len, q_len] mask (lower-triangular for normal tokens, ancestor mask for trees).
A drafting level is one more case: its queries see the context plus every draft node so far
through a [q_len, m] mask over those m trailing keys.
Sequences are grouped so that a long prefill does not pad every decode to its length.
When every sequence of a group starts with the same cache slots (a prefix-cache hit: a system
prompt, a job's preamble), those keys are read once for the whole group (cascade attention).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class SeqAttention:
    """What one sequence attends to in this forward pass (host-side description)."""

    q_start: int                       # offset of its first new token in the flat batch
    q_positions: torch.Tensor | list[int]   # rope positions of the new tokens
    kv_slots: torch.Tensor | list[int]      # cache slots of context then new tokens, in order
    kv_positions: torch.Tensor | list[int]  # positions of those keys
    new_token_mask: torch.Tensor | None = None  # [q_len, m] bool over the last m keys; None: causal over q_len

    @property
    def q_len(self) -> int:
        return len(self.q_positions)


@dataclass
class AttentionGroup:
    """Sequences padded together into one batched SDPA call."""

    token_index: torch.Tensor   # [B, Q] flat token index of each query (0 where padded)
    query_valid: torch.Tensor   # [B, Q] bool
    kv_slots: torch.Tensor      # [B, K] cache slots (0 where padded)
    base_mask: torch.Tensor     # [B, 1, Q, K] bool
    q_pos: torch.Tensor         # [B, Q]
    k_pos: torch.Tensor         # [B, K]
    out_index: torch.Tensor     # [N] flat token index of each valid query, row-major
    valid_index: torch.Tensor   # [N] position of each valid query in the flattened [B*Q] grid
    shared_slots: torch.Tensor | None = None   # [L] the context every sequence starts with; kv_slots is the rest
    shared_pos: torch.Tensor | None = None     # [L]
    _window_masks: dict = field(default_factory=dict)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        if sliding_window is None:
            return self.base_mask
        m = self._window_masks.get(sliding_window)
        if m is None:
            near = (self.q_pos[:, :, None] - self.k_pos[:, None, :]) < sliding_window
            m = self.base_mask & near[:, None]  # a query always sees itself, so rows stay finite
            self._window_masks[sliding_window] = m
        return m

    def shared_mask(self, sliding_window: int | None) -> torch.Tensor | None:
        """[B, 1, Q, L] over the shared keys; None: all of them are visible (they are context)."""
        if sliding_window is None:
            return None
        key = ("shared", sliding_window)
        if key not in self._window_masks:
            near = (self.q_pos[:, :, None] - self.shared_pos[None, None, :]) < sliding_window
            self._window_masks[key] = near[:, None]
        return self._window_masks[key]


@dataclass
class AttentionContext:
    slot_mapping: torch.Tensor          # [T] cache slot of each new token
    groups: list[AttentionGroup]
    use_cache: bool = True              # False: keys are the new tokens themselves (no KV cache)


def _build_group(seqs: list[SeqAttention], device: torch.device) -> AttentionGroup:
    B = len(seqs)
    Q = max(s.q_len for s in seqs)
    K = max(len(s.kv_slots) for s in seqs)
    token_index = torch.zeros(B, Q, dtype=torch.long)
    query_valid = torch.zeros(B, Q, dtype=torch.bool)
    kv_slots = torch.zeros(B, K, dtype=torch.long)
    mask = torch.zeros(B, 1, Q, K, dtype=torch.bool)
    q_pos = torch.zeros(B, Q, dtype=torch.long)
    k_pos = torch.zeros(B, K, dtype=torch.long)
    shortest_ctx = K
    for b, s in enumerate(seqs):
        q, k = s.q_len, len(s.kv_slots)
        ctx = k - (s.new_token_mask.shape[1] if s.new_token_mask is not None else q)
        shortest_ctx = min(shortest_ctx, ctx)
        token_index[b, :q] = torch.arange(s.q_start, s.q_start + q)
        query_valid[b, :q] = True
        kv_slots[b, :k] = torch.as_tensor(s.kv_slots)
        q_pos[b, :q] = torch.as_tensor(s.q_positions)
        k_pos[b, :k] = torch.as_tensor(s.kv_positions)
        mask[b, 0, :q, :ctx] = True
        new = s.new_token_mask if s.new_token_mask is not None else torch.ones(q, q, dtype=torch.bool).tril()
        mask[b, 0, :q, ctx:k] = new
        mask[b, 0, q:, 0] = True  # padded queries attend somewhere so softmax stays finite
    out_index = token_index[query_valid]
    valid_index = query_valid.flatten().nonzero().flatten()   # host-side, so no device sync per layer
    to = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    shared = _shared_prefix_len(kv_slots, Q, shortest_ctx)
    shared_slots = shared_pos = None
    if shared:
        shared_slots, shared_pos = to(kv_slots[0, :shared]), to(k_pos[0, :shared])
        kv_slots, mask, k_pos = kv_slots[:, shared:], mask[..., shared:], k_pos[:, shared:]
    return AttentionGroup(to(token_index), to(query_valid), to(kv_slots), to(mask), to(q_pos), to(k_pos),
                          to(out_index), to(valid_index), shared_slots, shared_pos)


MIN_SHARED_KEYS = 64    # below this, reading the keys per sequence costs about as much as the split
MAX_SHARED_QUERIES = 64    # decodes, trees, short chunks: the split materialises its [queries, keys] scores
FOLD_MAX_QUERIES = 8       # up to this many queries per sequence, a KV head's query heads are folded into one (_folded)


def _shared_prefix_len(kv_slots: torch.Tensor, max_queries: int, ctx: int) -> int:
    """How many leading slots of `kv_slots` [B, K] every sequence shares within the first `ctx`
    (the shortest context: each sequence's new tokens have slots of their own); 0 when it is not
    worth a split. Long prefill chunks keep SDPA, which does not hold all their scores at once."""
    if kv_slots.shape[0] < 2 or max_queries > MAX_SHARED_QUERIES or ctx < MIN_SHARED_KEYS:
        return 0
    differs = (kv_slots[1:, :ctx] != kv_slots[:1, :ctx]).any(0).nonzero()
    shared = int(differs[0]) if len(differs) else ctx
    return shared if shared >= MIN_SHARED_KEYS else 0


def build_context(seqs: list[SeqAttention], slot_mapping: torch.Tensor | list[int], device: torch.device,
                  use_cache: bool = True, max_pad_ratio: float = 2.0) -> AttentionContext:
    """Group sequences by query length so padding stays bounded, then build each group's masks.
    Plain decodes (one query) keep a group of their own: padded into a tree's group, every one of
    them would pay the tree's query length (and the masked path) for the whole batch."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].q_len)
    groups: list[list[SeqAttention]] = []
    for i in order:
        s = seqs[i]
        if groups and (s.q_len == 1) == (groups[-1][0].q_len == 1) and s.q_len <= max(8, groups[-1][0].q_len * max_pad_ratio):
            groups[-1].append(s)
        else:
            groups.append([s])
    return AttentionContext(
        slot_mapping=torch.as_tensor(slot_mapping, dtype=torch.long).to(device, non_blocking=True),
        groups=[_build_group(g, device) for g in groups],
        use_cache=use_cache,
    )


def causal_context(seq_lens: list[int], device: torch.device) -> AttentionContext:
    """Context for a cache-free forward of whole sequences packed back to back (parity, features)."""
    seqs, start = [], 0
    for n in seq_lens:
        idx = list(range(start, start + n))
        seqs.append(SeqAttention(q_start=start, q_positions=list(range(n)), kv_slots=idx, kv_positions=list(range(n))))
        start += n
    return build_context(seqs, list(range(start)), device, use_cache=False)


_CONTEXT: AttentionContext | None = None


@contextmanager
def attention_context(ctx: AttentionContext):
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ctx
    try:
        yield ctx
    finally:
        _CONTEXT = prev


def get_context() -> AttentionContext:
    if _CONTEXT is None:
        raise RuntimeError("attention called outside attention_context()")
    return _CONTEXT


class Attention(nn.Module):
    """Scaled dot-product attention for one layer's local heads, reading/writing the paged cache.

    `k_cache`/`v_cache` are [num_slots, num_kv_heads, head_dim] views assigned by the model
    runner when it allocates the cache; a slot is `block_id * block_size + offset`.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if ctx.use_cache:
            self.store_kv(k, v, ctx.slot_mapping)
            k_src, v_src = self.k_cache, self.v_cache
        else:
            k_src, v_src = k, v
        out = q.new_empty(T, self.num_heads, self.head_dim)
        for g in ctx.groups:
            B, Q = g.token_index.shape
            K = g.kv_slots.shape[1]
            # index_select on flat indices: cheaper than advanced indexing for these gathers
            qg = q.index_select(0, g.token_index.flatten())
            slots = g.kv_slots.flatten()
            kg = k_src.index_select(0, slots).view(B, K, self.num_kv_heads, self.head_dim).transpose(1, 2)
            vg = v_src.index_select(0, slots).view(B, K, self.num_kv_heads, self.head_dim).transpose(1, 2)
            mask = g.mask(self.sliding_window)
            if g.shared_slots is not None:
                o = self._cascade(qg, kg, vg, mask, g, k_src, v_src)
            elif Q <= FOLD_MAX_QUERIES:
                o = self._folded(qg, kg, vg, mask, Q)
            else:
                qg = qg.view(B, Q, self.num_heads, self.head_dim).transpose(1, 2)
                o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=self.scale,
                                                   enable_gqa=self.num_kv_heads != self.num_heads)
                o = o.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)
            out.index_copy_(0, g.out_index, o.index_select(0, g.valid_index))
        return out.view(T, self.num_heads * self.head_dim)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write K/V rows [T, kv_heads * head_dim] (or already split) into their cache slots."""
        T = k.shape[0]
        self.k_cache.index_copy_(0, slot_mapping, k.view(T, self.num_kv_heads, self.head_dim))
        self.v_cache.index_copy_(0, slot_mapping, v.view(T, self.num_kv_heads, self.head_dim))

    def _folded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, Q: int) -> torch.Tensor:
        """Decodes and small trees: the Q queries of every query head sharing a KV head become that
        head's G*Q queries ([B, kv_heads, G*Q, D]), so SDPA reads each sequence's keys once per KV
        head, in the cache's own dtype. On CPU, B=32, K=560, 4 heads on 1 KV head, one query: 2.3 ms
        in bf16 against 4.3 ms for enable_gqa in float32 (plus upcasting the keys) and 19 ms for
        enable_gqa in bf16; 4-query trees at B=8-32 about 30% faster than enable_gqa. From 16
        queries on (prefill chunks, big trees) enable_gqa is as fast or faster."""
        B, kvh, K = k.shape[0], self.num_kv_heads, k.shape[2]
        group, D = self.num_heads // kvh, self.head_dim
        q = q.view(B, Q, kvh, group, D).permute(0, 2, 3, 1, 4).reshape(B, kvh, group * Q, D)
        mask = mask[:, :, None].expand(B, 1, group, Q, K).reshape(B, 1, group * Q, K)   # every query of a head
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return o.view(B, kvh, group, Q, D).permute(0, 3, 1, 2, 4).reshape(B * Q, self.num_heads, D)

    def _cascade(self, q, k, v, mask, g: AttentionGroup, k_src, v_src) -> torch.Tensor:
        """Attention over [shared keys | each sequence's own keys]: the shared ones are gathered
        once and scored for every query of the group in one GEMM per KV head, the rest per
        sequence; one softmax over both. float32 throughout (the group's shared keys are one copy)."""
        B, kvh, S = k.shape[0], self.num_kv_heads, k.shape[2]
        group, D = self.num_heads // kvh, self.head_dim
        Q = q.shape[0] // B
        L = len(g.shared_slots)
        qf = q.float().view(B, Q, kvh, group, D).permute(2, 0, 3, 1, 4)               # [kvh, B, G, Q, D]
        kp = k_src.index_select(0, g.shared_slots).float().permute(1, 2, 0)          # [kvh, D, L]
        vp = v_src.index_select(0, g.shared_slots).float().transpose(0, 1)           # [kvh, L, D]
        shared = torch.bmm(qf.reshape(kvh, -1, D), kp).view(kvh, B, group, Q, L).transpose(0, 1)
        own = qf.transpose(0, 1).reshape(B, kvh, group * Q, D) @ k.float().transpose(-1, -2)
        scores = torch.cat([shared, own.view(B, kvh, group, Q, S)], -1).mul_(self.scale)  # [B, kvh, G, Q, L+S]
        scores[..., L:].masked_fill_(~mask[:, :, None], float("-inf"))
        shared_mask = g.shared_mask(self.sliding_window)
        if shared_mask is not None:
            scores[..., :L].masked_fill_(~shared_mask[:, :, None], float("-inf"))
        probs = scores.softmax(-1)
        o = torch.bmm(probs[..., :L].transpose(0, 1).reshape(kvh, -1, L), vp).view(kvh, B, group, Q, D).transpose(0, 1)
        o = o + (probs[..., L:].reshape(B, kvh, group * Q, S) @ v.float()).view(B, kvh, group, Q, D)
        return o.permute(0, 3, 1, 2, 4).reshape(B * Q, self.num_heads, D).to(q.dtype)
