"""Keep large CPU tensors' memory in the heap for reuse instead of returning it to the kernel.

glibc serves an allocation above its mmap threshold (dynamic, at most 32 MB) with a fresh mapping
and unmaps it on free, so the next one of that size faults in zeroed pages all over again. A CPU
decode step at batch 64 gathers its sequences' keys and values once per layer, about 39 MB each (64
sequences x 600 keys x 256 x 4 bytes on Gemma 3 270M), and a large prefill chunk's MLP makes
temporaries of that size: measured here, 100 such gathers took 5.0-5.7 s with glibc's defaults and
0.9 s with the mmap threshold at 64 MB and the trim threshold at 256 MB (13-18x fewer page faults),
on the main thread and on an engine thread alike.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 64 << 20      # the largest a non-main arena's heap (64 MB) can still serve
TRIM_THRESHOLD = 256 << 20     # free memory kept at a heap's top before it is handed back
# the same for a process the fleet starts (read at its start), and every thread on the main heap: an
# engine thread's own arena grows in 64 MB heaps that are unmapped whenever they empty
GLIBC_TUNABLES = (f"glibc.malloc.arena_max=1:glibc.malloc.mmap_threshold={MMAP_THRESHOLD}:"
                  f"glibc.malloc.trim_threshold={TRIM_THRESHOLD}")


@functools.cache
def keep_large_allocations() -> bool:
    """Raise glibc's thresholds for this process, once; False where it does not apply (not glibc)
    or where the operator tuned malloc through the environment (kept as set)."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ \
            or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
