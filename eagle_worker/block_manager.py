"""Paged KV memory: fixed-size blocks, one block table per sequence, full blocks shared by prefix.

Slot of position p of a sequence = block_table[p // block_size] * block_size + p % block_size.
Blocks are reference-counted: with prefix caching (prefix_cache.py) a full block may sit in
several tables, and a freed block that holds a registered prefix stays cached, evictable in LRU
order; blocks that hold nothing reusable are handed out first. A sequence writes only past its
committed tokens, so only into blocks of its own.
Speculative decoding appends a draft tree's tokens *uncommitted* after the committed ones and
then keeps only the accepted subset: `keep_subset` copies the kept tokens' KV so they end up
contiguous, then frees the blocks no longer needed.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable

import torch

from eagle_worker.prefix_cache import PrefixCache
from eagle_worker.sequence import Sequence


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))     # free, holding nothing reusable
        self.evictable: OrderedDict[int, None] = OrderedDict()        # free, holding a cached prefix (LRU first)
        self.prefix_cache = PrefixCache(block_size) if enable_prefix_caching else None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.prefix_cache.blocks) if self.prefix_cache else 0

    def _allocate(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            self.prefix_cache.evict(block)
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.prefix_cache is not None and self.prefix_cache.is_cached(block):
                self.evictable[block] = None
            else:
                self.free_blocks.append(block)

    def take_cached(self, seq: Sequence, need_head: bool) -> int:
        """Give a sequence with no KV yet its longest cached prefix; returns the tokens it covers."""
        if self.prefix_cache is None or seq.block_table:
            return 0
        blocks = self.prefix_cache.match(seq, need_head)
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self.evictable[b]
            self.ref_counts[b] += 1
        seq.block_table = list(blocks)
        seq.num_computed_tokens = len(blocks) * self.block_size
        return seq.num_computed_tokens

    def register(self, seq: Sequence, head_done: int | None = None) -> None:
        """Make `seq`'s full committed blocks findable by later requests (prefix_cache.py)."""
        if self.prefix_cache is not None and seq.block_table:
            for b in self.prefix_cache.register(seq, head_done):
                if self.ref_counts[b] == 0:       # a dropped block nobody holds: free, not evictable
                    del self.evictable[b]
                    self.free_blocks.append(b)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def can_append(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(seq, num_new_tokens) + reserve <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> torch.Tensor:
        """Slots for positions [num_computed, num_computed + n), allocating blocks as needed.

        The tokens stay uncommitted until `commit` (or `keep_subset`) advances num_computed_tokens.
        """
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.num_free_blocks:
            raise OutOfBlocks(f"need {need} blocks, {self.num_free_blocks} free")
        for _ in range(need):
            seq.block_table.append(self._allocate())
        start = seq.num_computed_tokens
        return self.slots(seq, start, start + num_new_tokens)

    def slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(seq.block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def commit(self, seq: Sequence, num_tokens: int) -> None:
        """Advance past `num_tokens` computed tokens; lookahead slots past them are released."""
        seq.num_computed_tokens += num_tokens
        self.trim(seq)

    def keep_subset(self, seq: Sequence, keep: list[int],
                    copy_kv: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """Keep uncommitted tokens at offsets `keep` (ascending), drop the rest.

        `copy_kv(src_slots, dst_slots)` moves the kept tokens' KV to positions num_computed ..
        num_computed+len(keep)-1 while their blocks are still this sequence's; then the tokens are
        committed and the blocks past the new end freed.
        """
        base = seq.num_computed_tokens
        if any(b <= a for a, b in zip(keep, keep[1:])):
            raise ValueError(f"keep offsets must be strictly ascending, got {keep}")
        end = base + (keep[-1] + 1 if keep else 0)
        if self.blocks_for(end) > len(seq.block_table):
            raise ValueError(f"offset {keep[-1]} was never appended")
        src = self.slots(seq, base, end)[torch.tensor(keep, dtype=torch.long)] if keep else torch.empty(0, dtype=torch.long)
        dst = self.slots(seq, base, base + len(keep))
        moved = src != dst
        copy_kv(src[moved], dst[moved])
        seq.num_computed_tokens = base + len(keep)
        self.trim(seq)

    def trim(self, seq: Sequence) -> None:
        """Free blocks beyond those the committed tokens occupy."""
        keep_blocks = self.blocks_for(seq.num_computed_tokens)
        while len(seq.block_table) > keep_blocks:
            self._release(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; its tail blocks go first, so a shared head of a prefix outlives them."""
        for block in reversed(seq.block_table):
            self._release(block)
        if self.prefix_cache is not None:
            self.prefix_cache.clear_inflight(seq)
        seq.block_table = []
        seq.num_computed_tokens = 0
