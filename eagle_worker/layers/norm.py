"""RMSNorm for Llama-style (`w * x`) and Gemma-style (`(1 + w) * x`) checkpoints.

The normalisation always runs in float32. Llama casts back to the input dtype before scaling
by the weight; Gemma scales in float32 and casts at the end. Matching each family's order is
what keeps bf16 outputs bit-close to the reference implementation.
"""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        init = torch.zeros if offset else torch.ones
        self.weight = nn.Parameter(init(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.float())).to(dtype)
        return self.weight * xf.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, offset={self.offset}"
