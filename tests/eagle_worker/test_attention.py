"""Paged attention against a plain float32 softmax over the same cached keys and values: bf16 decode
groups and chunks, and decodes whose query heads share several KV heads, with a sliding window."""
from __future__ import annotations

import pytest
import torch

from eagle_worker.attention import MAX_SHARED_QUERIES, MIN_SHARED_KEYS, Attention, SeqAttention, attention_context, build_context

H, HKV, D = 4, 1, 16


def _reference(q, k, v, scale, window=None, new_mask=None):
    """q [Q, H, D], k/v [K, HKV, D], causal over the last Q keys (or `new_mask` over them) and within
    `window`; float32."""
    h, hkv = q.shape[1], k.shape[1]
    q, k, v = q.float(), k.float().repeat_interleave(h // hkv, 1), v.float().repeat_interleave(h // hkv, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    Q, K = q.shape[0], k.shape[0]
    seen = torch.ones(Q, K, dtype=torch.bool).tril(K - Q)
    if new_mask is not None:
        seen[:, K - Q:] = new_mask
    if window is not None:
        seen &= ~torch.ones(Q, K, dtype=torch.bool).tril(K - Q - window)
    s = s.masked_fill(~seen, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(Q, h * q.shape[-1])


def test_bf16_attention_matches_float32_for_decodes_and_chunks():
    g = torch.Generator().manual_seed(0)
    attn = Attention(H, HKV, D, scale=D ** -0.5)
    attn.k_cache = torch.randn(64, HKV, D, generator=g).bfloat16()
    attn.v_cache = torch.randn(64, HKV, D, generator=g).bfloat16()
    for q_lens in ([1, 1], [3, 3]):                       # a decode group, then a group of 3-token chunks
        ctx_lens = [5, 9]
        seqs, new_slots, start = [], [], 0
        for b, (q_len, c) in enumerate(zip(q_lens, ctx_lens)):
            slots = list(range(32 * b, 32 * b + c + q_len))
            seqs.append(SeqAttention(q_start=start, q_positions=list(range(c, c + q_len)), kv_slots=slots,
                                     kv_positions=list(range(c + q_len))))
            new_slots += slots[c:]
            start += q_len
        q = torch.randn(start, H * D, generator=g).bfloat16()
        k = torch.randn(start, HKV * D, generator=g).bfloat16()
        v = torch.randn(start, HKV * D, generator=g).bfloat16()
        with torch.no_grad(), attention_context(build_context(seqs, new_slots, torch.device("cpu"))):
            out = attn(q, k, v)
        assert out.dtype == torch.bfloat16
        for s in seqs:
            rows = slice(s.q_start, s.q_start + s.q_len)
            expect = _reference(q[rows].view(-1, H, D), attn.k_cache[s.kv_slots], attn.v_cache[s.kv_slots], D ** -0.5)
            assert (out[rows].float() - expect).abs().max() < 2e-2, (q_lens, s.q_start)


def test_plain_decodes_keep_their_own_group_beside_a_tree():
    """A batch of decodes with one 5-token tree: the decodes are not padded to the tree's 5 queries
    (nor put on the masked path), and every sequence still gets its own attention."""
    g = torch.Generator().manual_seed(1)
    attn = Attention(H, HKV, D, scale=D ** -0.5)
    attn.k_cache = torch.randn(128, HKV, D, generator=g)
    attn.v_cache = torch.randn(128, HKV, D, generator=g)
    seqs, new_slots, start = [], [], 0
    for b, q_len in enumerate([1, 5, 1, 1]):
        c = 6 + b
        slots = list(range(32 * b, 32 * b + c + q_len))
        seqs.append(SeqAttention(q_start=start, q_positions=list(range(c, c + q_len)), kv_slots=slots,
                                 kv_positions=list(range(c + q_len))))
        new_slots += slots[c:]
        start += q_len
    ctx = build_context(seqs, new_slots, torch.device("cpu"))
    assert sorted(tuple(gr.token_index.shape) for gr in ctx.groups) == [(1, 5), (3, 1)]
    q, k, v = (torch.randn(start, n * D, generator=g) for n in (H, HKV, HKV))
    with torch.no_grad(), attention_context(ctx):
        out = attn(q, k, v)
    for s in seqs:
        rows = slice(s.q_start, s.q_start + s.q_len)
        expect = _reference(q[rows].view(-1, H, D), attn.k_cache[s.kv_slots], attn.v_cache[s.kv_slots], D ** -0.5)
        assert torch.allclose(out[rows], expect, atol=1e-5), s.q_start


def test_decodes_with_several_kv_heads_and_a_window_match_the_reference():
    """Decode folds each KV head's query heads into that head's queries: with 3 KV heads of 2 query
    heads each, every query head must still read its own KV head (a wrong fold mixes them)."""
    h, hkv, window = 6, 3, 4
    g = torch.Generator().manual_seed(2)
    attn = Attention(h, hkv, D, scale=D ** -0.5, sliding_window=window)
    attn.k_cache = torch.randn(96, hkv, D, generator=g)
    attn.v_cache = torch.randn(96, hkv, D, generator=g)
    seqs, new_slots = [], []
    for b, c in enumerate([2, 7, 11]):
        slots = list(range(32 * b, 32 * b + c + 1))
        seqs.append(SeqAttention(q_start=b, q_positions=[c], kv_slots=slots, kv_positions=list(range(c + 1))))
        new_slots.append(slots[-1])
    q, k, v = (torch.randn(3, n * D, generator=g) for n in (h, hkv, hkv))
    with torch.no_grad(), attention_context(build_context(seqs, new_slots, torch.device("cpu"))):
        out = attn(q, k, v)
    for s in seqs:
        rows = slice(s.q_start, s.q_start + 1)
        expect = _reference(q[rows].view(1, h, D), attn.k_cache[s.kv_slots], attn.v_cache[s.kv_slots], D ** -0.5, window)
        assert torch.allclose(out[rows], expect, atol=1e-5), s.q_start
        if len(s.kv_slots) > window:    # the window matters here: without it the answer differs
            assert not torch.allclose(out[rows], _reference(q[rows].view(1, h, D), attn.k_cache[s.kv_slots],
                                                             attn.v_cache[s.kv_slots], D ** -0.5), atol=1e-3)


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_groups_sharing_a_cached_prefix_read_it_once_and_match_the_reference(window, dtype):
    """Sequences whose context starts with the same cache slots (a prefix-cache hit) attend through
    the shared-prefix split, decodes and a group of 3-query trees alike, with and without a
    sliding window that cuts into the shared keys; a group whose common start is short, or whose
    chunks are long, does not split."""
    h, hkv, P = 6, 3, MIN_SHARED_KEYS + 6
    g = torch.Generator().manual_seed(4)
    attn = Attention(h, hkv, D, scale=D ** -0.5, sliding_window=window)
    attn.k_cache = torch.randn(1024, hkv, D, generator=g).to(dtype)
    attn.v_cache = torch.randn(1024, hkv, D, generator=g).to(dtype)
    prefix = list(range(100, 100 + P))
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)       # a root and two children
    for q_len, shared in ((1, P), (3, P), (1, 10), (MAX_SHARED_QUERIES + 1, P)):
        seqs, new_slots, start = [], [], 0
        for b, own in enumerate([3, 9, 0]):
            slots = prefix[:shared] + list(range(300 + 200 * b, 300 + 200 * b + own + (P - shared) + q_len))
            c = len(slots) - q_len
            seqs.append(SeqAttention(q_start=start, q_positions=list(range(c, c + q_len)), kv_slots=slots,
                                     kv_positions=list(range(c + q_len)), new_token_mask=tree if q_len == 3 else None))
            new_slots += slots[c:]
            start += q_len
        ctx = build_context(seqs, new_slots, torch.device("cpu"))
        assert [gr.shared_slots is not None for gr in ctx.groups] == [shared >= MIN_SHARED_KEYS and q_len <= MAX_SHARED_QUERIES]
        q, k, v = (torch.randn(start, n * D, generator=g).to(dtype) for n in (h, hkv, hkv))
        with torch.no_grad(), attention_context(ctx):
            out = attn(q, k, v)
        for s in seqs:
            rows = slice(s.q_start, s.q_start + s.q_len)
            expect = _reference(q[rows].view(-1, h, D), attn.k_cache[s.kv_slots], attn.v_cache[s.kv_slots],
                                D ** -0.5, window, tree if q_len == 3 else None)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert (out[rows].float() - expect).abs().max() < tol, (q_len, shared, s.q_start)
