"""Content hashes of full KV blocks: the key of automatic prefix caching, and of prefix-aware routing.

Block i's hash covers its own tokens and, through the previous block's hash, every token before
them (vLLM's and nano-vllm's chained block hash), so equal hashes mean equal prefixes. blake2b,
not Python's `hash`, so a router and a replica in different processes agree. Imports nothing heavy:
the router uses it too.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Sequence


def block_hash(tokens: Sequence[int], parent: int | None) -> int:
    """The hash of one full block of `tokens` after the block hashed `parent` (None: the first)."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent if parent is not None else 0).to_bytes(8, "little", signed=False))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None) -> list[int]:
    """Hashes of the full blocks of `token_ids` (a trailing partial block has none)."""
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    out: list[int] = []
    parent = None
    for i in range(n):
        parent = block_hash(token_ids[i * block_size:(i + 1) * block_size], parent)
        out.append(parent)
    return out
