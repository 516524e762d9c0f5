"""Tensor-parallel linear layers that load their own shard from a full HF tensor.

Each parameter carries `weight_loader(param, loaded_weight, shard_id=None)`: the loader hands it
the whole checkpoint tensor and the layer copies only this rank's slice, so checkpoints never
need re-sharding. Every matmul goes through `linear` (below).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eagle_worker.layers import gemm_paths
from eagle_worker.parallel import all_reduce, tp_rank, tp_size


def check_shape(loaded: torch.Tensor, expected: tuple[int, ...] | torch.Size) -> None:
    """Fail loudly instead of letting `copy_` broadcast a wrongly shaped tensor."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"shape mismatch: checkpoint has {tuple(loaded.shape)}, model expects {tuple(expected)}")


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
    """Replicated parameters (norms, biases of row-parallel layers): copy as is."""
    check_shape(loaded_weight, param.shape)
    param.data.copy_(loaded_weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias). On CPU in float32 (inference) through the GEMM this machine runs
    fastest for the weight's shape and the row count (`gemm_paths`: oneDNN, MKL, or MKL with the
    weight on the left, timed at load). Elsewhere (bf16, CUDA, training): `F.linear`."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (rows and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and not torch.is_grad_enabled()):
        y = gemm_paths.run(gemm_paths.path_for(weight, rows), x.reshape(rows, x.shape[-1]), weight, bias)
        return y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by tensor-parallel size {d}")
    return n // d


class LinearBase(nn.Module):
    """Holds `weight [out_local, in_local]` and optional `bias [out_local]`, each with a loader."""

    def __init__(self, in_local: int, out_local: int, bias: bool):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.weight = nn.Parameter(torch.empty(out_local, in_local), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    """Same full weight on every rank (small projections such as EAGLE's fc)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        default_weight_loader(param, loaded_weight)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication in forward."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        self.input_size, self.output_size = input_size, output_size
        super().__init__(input_size, _divide(output_size, tp_size(), "output_size"), bias)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        check_shape(loaded_weight, (self.output_size, *param.shape[1:]))
        n = param.shape[0]
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * n, n))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input packed in one matmul (gate_up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if shard_id is None:  # packed in the checkpoint: each projection is split across the ranks on its own
            check_shape(loaded_weight, (self.output_size, *param.shape[1:]))
            for i, part in enumerate(loaded_weight.split(self.output_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        full = self.output_sizes[shard_id]
        check_shape(loaded_weight, (full, *param.shape[1:]))
        size = full // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.data.narrow(0, offset, size).copy_(loaded_weight.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections packed per rank as [q_local | k_local | v_local].

    Query heads are split evenly. When there are fewer KV heads than ranks (Gemma 3 270M has one
    KV head) each rank holds one KV head, replicated: rank r gets head r * num_kv_heads // tp.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = False):
        tp = tp_size()
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp, "num_attention_heads")
        if total_num_kv_heads >= tp:
            self.num_kv_heads = _divide(total_num_kv_heads, tp, "num_key_value_heads")
            self.kv_head_start = tp_rank() * self.num_kv_heads
        else:
            _divide(tp, total_num_kv_heads, "tp_size over num_key_value_heads")
            self.num_kv_heads = 1
            self.kv_head_start = tp_rank() * total_num_kv_heads // tp
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        out_local = self.q_size + 2 * self.kv_size
        # Build as a plain LinearBase with the local size (the global size is not tp-divisible
        # when KV heads are replicated).
        self.input_size = hidden_size
        self.output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size
        LinearBase.__init__(self, hidden_size, out_local, bias)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if shard_id is None:
            raise ValueError("QKVParallelLinear needs shard_id 'q', 'k' or 'v'")
        hs = self.head_size
        if shard_id == "q":
            check_shape(loaded_weight, (self.total_num_heads * hs, *param.shape[1:]))
            src = loaded_weight.narrow(0, self.tp_rank * self.q_size, self.q_size)
            dst = param.data.narrow(0, 0, self.q_size)
        elif shard_id in ("k", "v"):
            check_shape(loaded_weight, (self.total_num_kv_heads * hs, *param.shape[1:]))
            src = loaded_weight.narrow(0, self.kv_head_start * hs, self.kv_size)
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            dst = param.data.narrow(0, offset, self.kv_size)
        else:
            raise ValueError(f"unknown qkv shard_id {shard_id!r}")
        dst.copy_(src)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums are all-reduced. Bias is added once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        self.input_size, self.output_size = input_size, output_size
        super().__init__(_divide(input_size, tp_size(), "input_size"), output_size, bias)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if param.dim() == 1:  # bias is replicated
            return default_weight_loader(param, loaded_weight)
        check_shape(loaded_weight, (param.shape[0], self.input_size))
        n = param.shape[1]
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        return all_reduce(y) if self.tp_size > 1 else y
