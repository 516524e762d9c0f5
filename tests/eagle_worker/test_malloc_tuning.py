"""Large CPU temporaries reuse the heap's memory instead of faulting in fresh pages on every step.
Each case runs in a fresh interpreter: a long test session's heap is fragmented in its own way."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cluster.cpu_threads import ENGINE_MALLOC_ENV

GATHER_BYTES = 40_000 * 256 * 4          # 41 MB: past glibc's largest default mmap threshold (32 MB)
FRESH_PAGES = GATHER_BYTES // 4096       # the page faults of one allocation that gets a fresh mapping

PROBE = """
import json, resource, threading, torch
from eagle_worker.malloc_tuning import keep_large_allocations
tuned = keep_large_allocations()
def steps(n=10):
    src, idx = torch.randn(50_000, 256), torch.randint(0, 50_000, (40_000,))
    for i in range(3 + n):               # a decode step's shape of work: gather, compute on it, drop both
        if i == 3:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = src.index_select(0, idx)
        y = x * 2
        del x, y
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
box = {}
t = threading.Thread(target=lambda: box.setdefault("thread", steps()))
t.start(); t.join()
print(json.dumps({"tuned": tuned, "main": steps(), "thread": box["thread"]}))
"""


def _probe(**env) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow      # two engine processes
def test_the_engine_process_reuses_large_blocks_and_an_untuned_one_does_not():
    control = _probe(GLIBC_TUNABLES="glibc.malloc.check=0")       # the operator's setting: left alone
    assert not control["tuned"]
    assert control["main"] >= 15 * FRESH_PAGES                      # 20 allocations, nearly all fresh mappings
    tuned = _probe()                                                # `LLM`'s process: mallopt at engine start
    # tuned, most are reused (measured: 0-7 of the 20 still fault, by the heap's fragmentation)
    assert tuned["tuned"] and tuned["main"] < 10 * FRESH_PAGES
    replica = _probe(**ENGINE_MALLOC_ENV)                           # a Ray engine process: the tunables at start
    assert not replica["tuned"]                                     # (already set: mallopt keeps out)
    assert replica["main"] < 10 * FRESH_PAGES and replica["thread"] < 10 * FRESH_PAGES   # its engine thread too
