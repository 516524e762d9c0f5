"""RMSNorm for Llama-style (`w * x`) and Gemma-style (`(1 + w) * x`) checkpoints.

The normalisation always runs in float32. Llama casts back to the input dtype before scaling
by the weight; Gemma scales in float32 and casts at the end. Matching each family's order is
what keeps bf16 outputs bit-close to the reference implementation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        init = torch.zeros if offset else torch.ones
        self.weight = nn.Parameter(init(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused call instead of six Python-level ops: on CPU decode the per-op overhead adds up, and a
        # step runs several of these per layer
        shape = (x.shape[-1],)
        if self.offset:
            return F.rms_norm(x.float(), shape, self.weight.float() + self.offset, self.eps).to(x.dtype)
        if x.dtype == self.weight.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, offset={self.offset}"
