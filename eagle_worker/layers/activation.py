"""Gated MLP activations on a packed [gate | up] tensor (output of `MergedColumnParallelLinear`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """Llama / Mistral / Qwen: silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """Gemma: gelu_pytorch_tanh(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def get_act_and_mul(name: str) -> nn.Module:
    """Map an HF `hidden_act` / `hidden_activation` string to the fused module."""
    if name in ("silu", "swish"):
        return SiluAndMul()
    if name in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast"):
        return GeluTanhAndMul()
    raise ValueError(f"unsupported MLP activation {name!r}")
