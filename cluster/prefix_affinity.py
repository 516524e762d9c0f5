"""Prefix-aware routing: which replica most likely holds a request's prompt prefix in its KV cache.

Each replica's engine caches the KV of full prompt blocks by a chained hash of their tokens
(eagle_worker/prefix_hash.py, automatic prefix caching). The router cannot see those caches; it
remembers instead, per replica, the block hashes of the prompts it sent there (`PrefixMemory`: an
approximation, bounded and LRU like the cache it mirrors, never larger than the replica's KV cache).
A request's match on a replica = how many of its leading blocks that replica was sent before.

The rule (`prefer_prefix`, used by `LoadAwareRouter.choose_replicas` after its least-load ranking):
- among the replicas whose load is at most the least-loaded one's plus `load_slack`, the one with
  the longest match wins, if that match covers at least `match_threshold` of the prompt's full
  blocks (and at least one block); equal matches go to the less loaded;
- otherwise (no match worth it, or every holder too busy) the least-load order stands, equal loads
  going to the replica that remembers fewer blocks, so new prefixes spread over the replicas.
SGLang's cache-aware router and Ray Serve LLM's PrefixCacheAffinityRouter do the same: prefix
affinity while the load is balanced, the least-loaded replica when it is not, the replica with the
least cached for a miss. Here the balance test is per candidate (a busy holder just loses its
preference) and in the router's own load units (fraction of capacity plus KV usage), so it scales
with `max_ongoing_requests`. Once a prefix's holder is busier than the slack allows, the request goes
to another replica, which then holds the prefix too: a hot prefix ends up on several replicas and
its requests are balanced among them.

Text prompts (callers that send text instead of token ids) are hashed by characters, in blocks of
`TEXT_CHARS_PER_BLOCK` x block_size characters: a coarser match, but the same rule.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Callable, Hashable, Sequence

from eagle_worker.engine_api import block_hashes

TEXT_CHARS_PER_BLOCK = 4   # characters per token, roughly, for prompts that arrive as text


def prompt_hashes(prompt: Any, block_size: int, max_blocks: int) -> list[int]:
    """Chained hashes of the prompt's first `max_blocks` full blocks ([] for anything else)."""
    if isinstance(prompt, str):
        return block_hashes([ord(c) for c in prompt[:block_size * TEXT_CHARS_PER_BLOCK * max_blocks]],
                            block_size * TEXT_CHARS_PER_BLOCK, max_blocks)
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt[:1]):
        return block_hashes(prompt, block_size, max_blocks)
    return []


class PrefixMemory:
    """Per replica, the block hashes of prompts routed there, least recently routed evicted first."""

    def __init__(self, capacity_blocks: int):
        self.capacity = max(1, int(capacity_blocks))
        self._by_replica: dict[Hashable, OrderedDict[int, None]] = {}

    def match(self, replica: Hashable, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` this replica was sent (chained hashes: a hit implies its prefix)."""
        seen = self._by_replica.get(replica)
        if not seen:
            return 0
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def record(self, replica: Hashable, hashes: Sequence[int], capacity: int | None = None) -> None:
        """`hashes` were sent to `replica`; it keeps at most min(capacity, self.capacity) blocks.
        The first block is touched last, so a prefix outlives the blocks that continue it (as in
        the engine's cache, where a continuation is useless without its prefix)."""
        if not hashes:
            return
        seen = self._by_replica.setdefault(replica, OrderedDict())
        for h in reversed(hashes):
            seen[h] = None
            seen.move_to_end(h)
        limit = min(self.capacity, capacity) if capacity else self.capacity
        while len(seen) > max(1, limit):
            seen.popitem(last=False)

    def size(self, replica: Hashable) -> int:
        return len(self._by_replica.get(replica) or ())

    def forget(self, replica: Hashable) -> None:
        self._by_replica.pop(replica, None)

    def keep_only(self, replicas: set) -> None:
        for key in [k for k in self._by_replica if k not in replicas]:
            self._by_replica.pop(key, None)

    def replicas(self) -> list:
        return list(self._by_replica)


def prefer_prefix(ranked: list, hashes: Sequence[int], memory: PrefixMemory, load: Callable[[Any], float],
                  key: Callable[[Any], Hashable], load_slack: float, match_threshold: float) -> tuple[list, Any]:
    """`ranked` (least loaded first) with the replica that should serve this prefix moved first
    (the module docstring's rule), the rest in their order; and that replica, or None where the
    load order stands (the router then gives that replica to this request, not an older one)."""
    if not ranked:
        return ranked, None
    loads = {id(r): load(r) for r in ranked}
    least = min(loads.values())
    # equal loads: the replica remembering fewer blocks first (spreads new prefixes); stable otherwise
    ranked = sorted(ranked, key=lambda r: (loads[id(r)], memory.size(key(r))))
    if not hashes:
        return ranked, None
    need = max(1, math.ceil(match_threshold * len(hashes) - 1e-9))
    best, best_n = None, 0
    for r in ranked:
        if loads[id(r)] > least + load_slack:
            continue
        n = memory.match(key(r), hashes)
        if n > best_n:
            best, best_n = r, n
    if best is None or best_n < need:
        return ranked, None
    return [best] + [r for r in ranked if r is not best], best
