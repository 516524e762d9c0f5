"""IdSet: the row ids a job has seen, at 16 bytes per id whatever the id's length.

Why not a Python set of strings: resume needs the ids of every committed row, and a job may have
tens of millions of rows; a set of str costs ~100 bytes per id and grows the driver with the
dataset. Here an id is a 120-bit BLAKE2b digest (collisions are out of reach: ~1e-22 for
1e7 ids), kept in a sorted numpy array; recent additions sit in a small Python set merged in batches.
"""
from __future__ import annotations

import hashlib

import numpy as np

_DTYPE = np.dtype("S16")
_MERGE_AT = 65_536


def id_digest(row_id) -> bytes:
    """Ids are strings or integers; one job never mixes the two (jobs/input_reader.py refuses it)."""
    if not isinstance(row_id, str):
        row_id = str(row_id)
    # 120 hash bits + a non-zero last byte: numpy strips trailing NULs from "S" items on the way out
    return hashlib.blake2b(row_id.encode("utf-8", "surrogatepass"), digest_size=15).digest() + b"\x01"


class IdSet:
    def __init__(self) -> None:
        self._sorted = np.empty(0, dtype=_DTYPE)
        self._recent: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._sorted) + len(self._recent)

    def __contains__(self, row_id: str) -> bool:
        return self.contains_digest(id_digest(row_id))

    def contains_digest(self, d: bytes) -> bool:
        if d in self._recent:
            return True
        i = int(np.searchsorted(self._sorted, d))
        return i < len(self._sorted) and self._sorted[i] == d

    def add(self, row_id: str) -> bool:
        """Add; False when the id was already there."""
        d = id_digest(row_id)
        if self.contains_digest(d):
            return False
        self._recent.add(d)
        if len(self._recent) >= _MERGE_AT:
            self._merge()
        return True

    def update(self, row_ids) -> int:
        """Add many; returns how many were already present (duplicates)."""
        dups = 0
        for rid in row_ids:
            dups += not self.add(rid)
        return dups

    def _merge(self) -> None:
        new = np.fromiter(self._recent, dtype=_DTYPE, count=len(self._recent))
        self._sorted = np.union1d(self._sorted, new)
        self._recent.clear()

    @property
    def nbytes(self) -> int:
        return self._sorted.nbytes + 100 * len(self._recent)
