"""Tensor-parallel state of this process: rank, world size and the collectives layers need.

A replica with `tp_size=1` never touches `torch.distributed`; the cluster package calls
`init_tensor_parallel` (exported as part of the engine contract, eagle_worker/engine_api.py) on
every rank of a TP group before building the model.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1
_COMM: dict[str, list] | None = None      # collective name -> [calls, seconds] while counting is on


def enable_comm_stats(on: bool = True) -> None:
    """Count calls and wall seconds of this process's collectives (benchmarks: bench/spec_tp.py).
    Off by default, and then a collective enters a no-op context. On CUDA the counted span
    synchronizes the device before and after each collective (NCCL returns before it is done), so
    counting perturbs a GPU run a little; on CPU (gloo, blocking) it only reads a clock."""
    global _COMM
    _COMM = {} if on else None


def comm_stats(reset: bool = False) -> dict[str, dict]:
    """{collective: {"calls": n, "seconds": s}} since counting began or the last reset; {} when off.
    Names: all_reduce, all_gather_last_dim, all_gather_rows, broadcast_from_rank0 (the command a
    rank-0 ModelRunner sends per forward; on ranks 1..n-1 its seconds include waiting for rank 0)."""
    if _COMM is None:
        return {}
    out = {name: {"calls": c, "seconds": s} for name, (c, s) in _COMM.items()}
    if reset:
        _COMM.clear()
    return out


def _counted(name: str, x: torch.Tensor | None = None):
    """The collective's span, counted while counting is on (else a no-op context)."""
    return contextlib.nullcontext() if _COMM is None else _timed(name, x)


@contextlib.contextmanager
def _timed(name: str, x: torch.Tensor | None):
    cuda = x is not None and x.is_cuda
    if cuda:
        torch.cuda.synchronize(x.device)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if cuda:
            torch.cuda.synchronize(x.device)
        entry = _COMM.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += time.perf_counter() - t0


def init_tensor_parallel(rank: int, world_size: int) -> None:
    global _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = rank, world_size


def tp_rank() -> int:
    return _TP_RANK


def tp_size() -> int:
    return _TP_SIZE


@contextlib.contextmanager
def single_rank():
    """Build modules that live on this rank alone (the draft head under TP): layers made inside
    hold full, unsharded weights and never communicate."""
    global _TP_RANK, _TP_SIZE
    saved = _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = 0, 1
    try:
        yield
    finally:
        _TP_RANK, _TP_SIZE = saved


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE > 1:
        with _counted("all_reduce", x):
            dist.all_reduce(x)
    return x


def _all_gather(name: str, x: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    with _counted(name, x):
        dist.all_gather(parts, x.contiguous())
    return parts


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dimension (vocab-parallel logits)."""
    if _TP_SIZE == 1:
        return x
    return torch.cat(_all_gather("all_gather_last_dim", x), dim=-1)


def all_gather_rows(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the first dimension (vocab-sharded tables)."""
    if _TP_SIZE == 1:
        return x
    return torch.cat(_all_gather("all_gather_rows", x), dim=0)


def broadcast_from_rank0(obj=None):
    """Send a picklable object from rank 0 to every rank of the group; returns it on every rank."""
    box = [obj]
    with _counted("broadcast_from_rank0"):     # the object travels through CPU pickles here (gloo)
        dist.broadcast_object_list(box, src=0)
    return box[0]
