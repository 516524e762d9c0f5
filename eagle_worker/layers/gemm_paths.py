"""Which float32 CPU GEMM runs a linear layer at a given row count: measured on this machine.

The fastest of oneDNN, MKL (`F.linear`) and MKL with the weight on the left (`weight @ x.T`)
depends on the CPU, the weight's shape and the rows: on a 2-core AMD EPYC MKL took slow paths at
every row count, while on a 2-core Intel Xeon with AMX MKL runs most of a decoder layer's GEMMs at
1-2 rows about 1.3-1.8x faster than oneDNN (plain decoding at batch 1: about 15% more tokens a
second). So each float32 weight shape a model holds is timed once at load at 1, 2 and 4 rows
(3 rows use 4's choice), on weights that do not fit in cache (as a model's layers stream them), and
`linear` follows the table; paths no better than the margin keep the default rule. From 5 rows the
rule holds: timed up to 32 rows, the table changed batch 8's paths and measured 0.95-0.99x of the
rule there (the paths are within 10% of each other at those rows, below what timing at load resolves).
The choice is fixed for the process, so the same batch always runs the same kernels. Weights
of more than `MAX_OUT` rows (a vocabulary-sized LM head, whose greedy rows go through the argmax
screens) are not timed. Timing a 270M model's shapes takes about 1.5 s, so the table is kept on disk
(`$EAGLE_CACHE_DIR/.gemm_paths/`, keyed by the CPU, its core count, torch's version and thread
count) for the next process on the machine; an unreadable or missing file means timing again.
Processes that load together take turns to time (a lock beside the file), so the later ones read
the first one's table.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle_worker import default_models
from eagle_worker.parallel import broadcast_from_rank0, tp_rank, tp_size

PATHS = ("onednn", "mkl", "weight_left")
BUCKETS = (1, 2, 4)        # rows are timed at the bucket at or above them; more rows: the rule
MAX_OUT = 65536
COLD_BYTES = 128 << 20              # more than a server CPU's last-level cache
MARGIN = 0.85       # another path replaces the default rule's only when it takes at most 85% of its time

_onednn = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None) \
    if torch.backends.mkldnn.is_available() else None
_table: dict[tuple[int, int, int], str] = {}


def bucket(rows: int) -> int | None:
    return next((b for b in BUCKETS if rows <= b), None)


def default_path(rows: int) -> str:
    """The rule before any timing: oneDNN, except MKL with the weight on the left at exactly 2 rows
    (what the EPYC measured best); MKL alone where torch has no oneDNN."""
    if _onednn is None:
        return "mkl"
    return "weight_left" if rows == 2 else "onednn"


def path_for(weight: torch.Tensor, rows: int) -> str:
    if rows > BUCKETS[-1]:              # most steps' rows: no lookup
        return default_path(rows)
    return _table.get((weight.shape[0], weight.shape[1], bucket(rows))) or default_path(rows)


@contextlib.contextmanager
def untimed() -> Iterator[None]:
    """Every GEMM on the default rule inside the block (`bench decode` measures what timing gains)."""
    timed = dict(_table)
    _table.clear()
    try:
        yield
    finally:
        _table.update(timed)


def run(path: str, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 [rows, in] @ weight.T (+ bias) on one path."""
    if path == "onednn" and _onednn is not None:
        return _onednn(x2.contiguous(), weight, bias, "none", [], "")
    if path == "weight_left":
        y = torch.mm(weight, x2.t()).t().contiguous()
        return y + bias if bias is not None else y
    return F.linear(x2, weight, bias)


def _wall_seconds(fn: Callable[[], object], repeats: int = 2) -> float:
    """The faster of `repeats` timed calls: the kernel's speed, not the noise."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _cold_copies(out_f: int, in_f: int) -> list[torch.Tensor]:
    """Enough copies of a weight that a pass over them reads memory, not cache, as a model's layers
    do one after another: timed on one hot weight, MKL looked up to 2x faster at 4-8 rows than it is."""
    n = max(1, min(256, COLD_BYTES // (4 * out_f * in_f)))     # one weight past the cache is cold alone
    return [torch.full((out_f, in_f), 0.01) for _ in range(n)]     # written: real pages, not the zero page


def tune(weights: Iterable[torch.Tensor], timer: Callable[[Callable[[], object]], float] = _wall_seconds,
         cache: Path | None = None) -> dict:
    """Time every path for each new float32 CPU weight shape at each bucket and record the fastest
    (the default rule's unless another beats it by the margin); shapes in `cache` (default: this
    machine's file) are read, not timed. Returns the table's entries for these weights' shapes."""
    if _onednn is None:
        return {}
    every = {tuple(w.shape) for w in weights
             if w.dim() == 2 and w.dtype == torch.float32 and w.device.type == "cpu" and 0 < w.shape[0] <= MAX_OUT
             and w.shape[1] > 0}
    shapes = {s for s in every if (*s, BUCKETS[0]) not in _table}
    if shapes:
        cache = cache or cache_file()
        with _timing_turn(cache):
            _tune_new(shapes, timer, cache)
    return {(o, i, b): _table[(o, i, b)] for o, i in every for b in BUCKETS}


@contextlib.contextmanager
def _timing_turn(cache: Path) -> Iterator[None]:
    """Processes loading together on one machine (replicas, TP ranks of several groups) time one
    after another: the next one reads the table the first wrote instead of timing in its noise.
    Without a writable cache folder each times alone, unlocked."""
    with contextlib.ExitStack() as stack:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            stack.enter_context(default_models.file_lock(cache.with_name(cache.name + ".lock")))
        except OSError:
            pass
        yield


def _tune_new(shapes: set, timer, cache: Path) -> None:
    stored = _read(cache)
    added: dict[tuple[int, int, int], str] = {}
    timed = False
    with torch.inference_mode():
        for out_f, in_f in sorted(shapes):
            known = {b: stored.get(f"{out_f},{in_f},{b}") for b in BUCKETS}
            if all(v in PATHS for v in known.values()):
                added.update({(out_f, in_f, b): v for b, v in known.items()})
                continue
            timed = True
            weights = _cold_copies(out_f, in_f)
            for b in BUCKETS:
                x = torch.randn(b, in_f)
                for p in PATHS:                 # each path's first call builds its kernel: not timed
                    run(p, x, weights[0], None)
                seconds = {p: timer(lambda p=p: [run(p, x, w, None) for w in weights]) for p in PATHS}
                best = min(seconds, key=seconds.get)
                rule = default_path(b)
                added[(out_f, in_f, b)] = best if seconds[best] <= MARGIN * seconds[rule] else rule
    _table.update(added)
    if timed:
        _write(cache, stored | {f"{o},{i},{b}": v for (o, i, b), v in added.items()})


def tune_module(module: torch.nn.Module, group: bool = False) -> dict:
    """`tune` over a module's parameters (a target's decoder linears, a head's projections). With
    `group` (a tensor-parallel target, called on every rank), rank 0's table holds on every rank:
    a replicated weight (a KV head several ranks share) then gets the same bits everywhere."""
    if not (group and tp_size() > 1):
        return tune(module.parameters())
    entries = broadcast_from_rank0(tune(module.parameters()) if tp_rank() == 0 else None)
    _table.update(entries)
    return entries


def cache_file() -> Path:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    stamp = "\n".join([cpu, str(os.cpu_count()), torch.__version__, str(torch.get_num_threads())])
    return default_models.cache_root() / ".gemm_paths" / f"{hashlib.sha256(stamp.encode()).hexdigest()[:24]}.json"


def _read(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(file: Path, table: dict) -> None:
    """Atomically (processes starting together each write whole files); a failed write only means
    timing again next time."""
    tmp = None
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=0, sort_keys=True)
        os.replace(tmp, file)
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
