"""The block-level rules of prefix caching, on the BlockManager alone: reference counts, which free
block is reused first (never-cached before cached, cached least recently freed first, a prefix's
tail before its head), what a match may take (never the last token; with a head only blocks that
carry its KV, the last only when the token after it is the one the head paired it with)."""
from __future__ import annotations

import os
import subprocess
import sys

from eagle_worker.block_manager import BlockManager
from eagle_worker.prefix_hash import block_hashes
from eagle_worker.sampling_params import SamplingParams
from eagle_worker.sequence import Sequence

BS = 4


def seq(tokens, rid="r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(), 0, 0)


def computed(bm: BlockManager, tokens, rid="r", head_done=None) -> Sequence:
    """A sequence whose tokens all have KV (prefilled), registered."""
    s = seq(tokens, rid)
    bm.take_cached(s, need_head=False)
    n = len(tokens) - s.num_computed_tokens
    bm.append_slots(s, n)
    bm.commit(s, n)
    bm.register(s, head_done)
    return s


def test_shared_blocks_are_reference_counted_and_cached_after_free():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a = computed(bm, range(10))                      # 2 full blocks + 2 tokens
    assert bm.num_cached_blocks == 2
    b = seq(list(range(8)) + [99, 98, 97])
    assert bm.take_cached(b, need_head=False) == 8 and b.block_table == a.block_table[:2]
    assert [bm.ref_counts[x] for x in a.block_table] == [2, 2, 1]
    bm.free(a)
    assert [bm.ref_counts[x] for x in b.block_table] == [1, 1]
    bm.free(b)
    assert not any(bm.ref_counts) and bm.num_free_blocks == 16 and bm.num_cached_blocks == 2


def test_never_the_last_token_and_never_a_partial_block():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    computed(bm, range(8))
    assert bm.take_cached(seq(range(8)), need_head=False) == 4        # 8 tokens cached: the 8th is recomputed
    assert bm.take_cached(seq(range(9)), need_head=False) == 8
    assert bm.take_cached(seq(range(3)), need_head=False) == 0


def test_free_blocks_are_reused_plain_first_then_least_recently_cached_tail_first():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    a = computed(bm, range(8), "a")                  # blocks 0, 1
    b = computed(bm, range(100, 108), "b")           # blocks 2, 3
    a_tail = a.block_table[1]
    bm.free(a)
    bm.free(b)
    c = seq(range(200, 208), "c")
    bm.append_slots(c, 8)                            # the two never-cached blocks first
    assert sorted(c.block_table) == [4, 5] and bm.prefix_cache.stats["prefix_cache_evictions"] == 0
    d = seq(range(300, 304), "d")
    bm.append_slots(d, 4)                            # then a's tail block (freed first, tail before head)
    assert d.block_table == [a_tail]
    assert bm.prefix_cache.stats["prefix_cache_evictions"] == 1
    assert bm.take_cached(seq(range(9)), need_head=False) == 4       # a's head block is still cached
    assert bm.take_cached(seq(list(range(100, 108)) + [5]), need_head=False) == 8


def test_with_a_head_only_blocks_carrying_its_kv_and_the_right_next_token():
    bm = BlockManager(32, BS, enable_prefix_caching=True)
    toks = list(range(12))
    computed(bm, toks, "no-head-kv", head_done=None)
    assert bm.take_cached(seq(toks + [50]), need_head=True) == 0      # target KV only
    assert bm.take_cached(seq(toks + [50]), need_head=False) == 12
    bm2 = BlockManager(32, BS, enable_prefix_caching=True)
    computed(bm2, toks + [7], "head", head_done=12)                   # head KV for positions 0..11, next token 7
    assert bm2.take_cached(seq(toks + [7, 1]), need_head=True) == 12
    assert bm2.take_cached(seq(toks + [8, 1]), need_head=True) == 8   # the third block's last head entry paired 7
    assert bm2.take_cached(seq(toks[:8] + [0, 0, 0, 0, 1]), need_head=True) == 4


def test_a_cached_block_replaced_by_one_with_head_kv_is_free_again_not_evictable():
    """A request whose head sat out cached its blocks without head KV; an equal request with the
    head's KV replaces them in the cache. The replaced blocks, held by nobody, hold nothing findable:
    they are handed out before any cached block, and reusing them evicts nothing."""
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    toks = list(range(10, 19))                        # 2 full blocks and 1 token
    a, b = seq(toks, "a"), seq(toks, "b")             # prefilled side by side: neither found the other's
    for s in (a, b):
        bm.append_slots(s, len(toks))
        bm.commit(s, len(toks))
    bm.register(a, None)
    old = a.block_table[:2]
    bm.free(a)                                        # a's 2 cached blocks: evictable
    bm.register(b, 9)                                 # replaces them: b's blocks carry the head's KV
    assert sorted(bm.prefix_cache.blocks) == sorted(b.block_table[:2])
    assert not set(old) & set(bm.evictable) and set(old) <= set(bm.free_blocks)
    bm.free(b)
    assert set(bm.evictable) == set(bm.prefix_cache.blocks) and bm.num_free_blocks == 8
    c = seq(range(200, 224), "c")
    bm.append_slots(c, 24)                            # 6 blocks: every one that caches nothing, no eviction
    assert set(old) <= set(c.block_table) and bm.prefix_cache.stats["prefix_cache_evictions"] == 0


def test_hashes_are_chained_and_stable():
    assert block_hashes(list(range(8)), 4)[1] != block_hashes([9, 9, 9, 9] + list(range(4, 8)), 4)[1]
    assert block_hashes(list(range(8)), 4) == block_hashes(list(range(9)), 4)
    code = "from eagle_worker.prefix_hash import block_hashes; print(block_hashes(list(range(8)), 4))"
    other_process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                   env={**os.environ, "PYTHONHASHSEED": "123"})
    assert other_process.stdout.strip() == str(block_hashes(list(range(8)), 4))   # a router and a replica agree
