"""Tensor-parallel state of this process: rank, world size and the collectives layers need.

A replica with `tp_size=1` never touches `torch.distributed`; the cluster package calls
`init_tensor_parallel` (exported as part of the engine contract, eagle_worker/engine_api.py) on
every rank of a TP group before building the model.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1


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
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dimension (vocab-parallel logits)."""
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def all_gather_rows(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the first dimension (vocab-sharded tables)."""
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=0)


def broadcast_from_rank0(obj=None):
    """Send a picklable object from rank 0 to every rank of the group; returns it on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
