"""Automatic prefix caching: full KV blocks found again by the hash of their tokens and prefix.

vLLM's and nano-vllm's scheme: once a block's tokens all have committed KV it is *registered*
under its chained hash (prefix_hash.py); a new request (or one recomputing after preemption)
takes the longest run of registered blocks matching its tokens instead of computing them. Blocks
are reference-counted by the BlockManager; a registered block nobody uses stays cached and
evictable (LRU) until memory is needed.

EAGLE: the head's KV lives in the target's slot numbering, so a block carries the head's KV for
its positions too — once the head has written it. The head's entry at position p pairs the target
feature of p with the token at p+1, so a block's last entry depends on the token *after* the block:
a request using the head takes a block only when its head KV is written, and the last block it
takes only when the token after it is the one the head paired it with (else it recomputes that
block, as vLLM always does for EAGLE). A match never covers a request's last token: its logits are
needed, and a request only ever writes into blocks of its own.

A head that sat out a request's last steps owes the KV of those tokens; the request writes it when
it ends (the engine's `_retire`), else a conversation's next turn would recompute its history's
answer. A match that stops at a block cached without the head's KV is counted
(`prefix_cache_blocks_without_head_kv`): what a request still running or one that failed left.
"""
from __future__ import annotations

from dataclasses import dataclass

from eagle_worker.prefix_hash import block_hash


@dataclass
class CachedBlock:
    hash: int
    head_next: int | None = None     # token after the block the head's KV was written with (None: not yet)


class PrefixCache:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.by_hash: dict[int, int] = {}            # hash -> block id
        self.blocks: dict[int, CachedBlock] = {}     # block id -> what it holds
        self.inflight: dict[int, object] = {}        # hash -> the running sequence computing that block now
        self.stats = {"prefix_cache_queried_tokens": 0, "prefix_cache_hit_tokens": 0, "prefix_cache_queried_requests": 0,
                      "prefix_cache_hit_requests": 0, "prefix_cache_evictions": 0,
                      "prefix_cache_blocks_without_head_kv": 0}

    # ---- hashes of a sequence's blocks ---------------------------------------------------------
    def hashes(self, seq, num_blocks: int) -> list[int]:
        """The chained hashes of `seq`'s first `num_blocks` full blocks (memoized on the sequence)."""
        hs, bs, tokens = seq.block_hashes, self.block_size, seq.token_ids
        while len(hs) < num_blocks:
            i = len(hs)
            hs.append(block_hash(tokens[i * bs:(i + 1) * bs], hs[-1] if hs else None))
        return hs[:num_blocks]

    # ---- lookup ------------------------------------------------------------------------------
    def match(self, seq, need_head: bool) -> list[int]:
        """Registered blocks holding `seq`'s longest cached prefix (never its last token)."""
        bs = self.block_size
        blocks = []
        for h in self.hashes(seq, (len(seq.token_ids) - 1) // bs):
            b = self.by_hash.get(h)
            if b is None:
                break
            if need_head and self.blocks[b].head_next is None:
                self.stats["prefix_cache_blocks_without_head_kv"] += 1
                break
            blocks.append(b)
        if need_head and blocks and self.blocks[blocks[-1]].head_next != seq.token_ids[len(blocks) * bs]:
            blocks.pop()
        return blocks

    def next_block_inflight(self, seq, num_matched: int) -> object | None:
        """The running sequence now computing the block after `seq`'s match, if one is."""
        n = (len(seq.token_ids) - 1) // self.block_size
        if num_matched >= n:
            return None
        owner = self.inflight.get(self.hashes(seq, num_matched + 1)[-1])
        return owner if owner is not seq else None

    def mark_inflight(self, seq, first_block: int) -> None:
        """`seq` computes its blocks from `first_block` on: others sharing them may wait for it."""
        n = (len(seq.token_ids) - 1) // self.block_size
        for h in self.hashes(seq, n)[first_block:]:
            if h not in self.by_hash:
                self.inflight.setdefault(h, seq)

    def clear_inflight(self, seq) -> None:
        for h in seq.block_hashes:
            if self.inflight.get(h) is seq:
                del self.inflight[h]

    # ---- registration and eviction ----------------------------------------------------------------
    def register(self, seq, head_done: int | None) -> list[int]:
        """Register `seq`'s blocks whose tokens all have committed KV; with a head (`head_done`:
        positions whose head KV is written), record which blocks carry the head's KV as well. Returns
        the cached blocks this dropped (replaced by one that carries the head's KV too)."""
        bs = self.block_size
        dropped = []
        full = min(seq.num_computed_tokens, len(seq.token_ids)) // bs
        hashes = self.hashes(seq, full)
        for i, h in enumerate(hashes):
            b = seq.block_table[i]
            head_next = None
            if head_done is not None and head_done >= (i + 1) * bs and len(seq.token_ids) > (i + 1) * bs:
                head_next = seq.token_ids[(i + 1) * bs]
            if self.inflight.get(h) is seq:
                del self.inflight[h]
            held = self.by_hash.get(h)
            if held == b:
                if head_next is not None and self.blocks[b].head_next is None:
                    self.blocks[b].head_next = head_next
                continue
            if held is not None:
                if head_next is None or self.blocks[held].head_next is not None:
                    continue                     # an equal block is cached already
                del self.blocks[held]            # ours carries the head's KV too: it replaces that one
                dropped.append(held)
            if b in self.blocks:                 # (a block can hold only one hash)
                continue
            self.by_hash[h] = b
            self.blocks[b] = CachedBlock(h, head_next)
        return dropped

    def is_cached(self, block: int) -> bool:
        return block in self.blocks

    def evict(self, block: int) -> None:
        """`block` is about to be reused for other tokens: forget what it held."""
        cb = self.blocks.pop(block, None)
        if cb is not None:
            if self.by_hash.get(cb.hash) == block:
                del self.by_hash[cb.hash]
            self.stats["prefix_cache_evictions"] += 1

    def count_query(self, num_tokens: int, num_hit: int) -> None:
        self.stats["prefix_cache_queried_requests"] += 1
        self.stats["prefix_cache_queried_tokens"] += num_tokens
        self.stats["prefix_cache_hit_tokens"] += num_hit
        self.stats["prefix_cache_hit_requests"] += num_hit > 0
