"""Rotary position embeddings (neox / HF-Llama `rotate_half` layout) with cached cos/sin.

`get_rope(head_dim, rope_theta, rope_scaling, max_position)` is the contract other modules
use. `rope_config(hf_config, layer_type)` reads theta and scaling from either transformers 5.x
`config.rope_parameters` (flat, or nested per layer type as in Gemma 3) or the older
`rope_theta` / `rope_scaling` / `rope_local_base_freq` attributes.
"""
from __future__ import annotations

import math

import torch
from torch import nn

_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope_type(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type") or scaling.get("type") or "default"


def _inv_freq(head_dim: int, theta: float, scaling: dict | None, max_position: int) -> torch.Tensor:
    """Inverse frequencies in float32, computed exactly as transformers does for each rope type."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = _rope_type(scaling)
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling.get("original_max_position_embeddings") or max_position
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Applies rope to packed q/k: `forward(positions[T], q[T, nh*hd], k[T, nkv*hd]) -> (q, k)`."""

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict | None, max_position: int):
        super().__init__()
        self.head_dim = head_dim
        if rope_scaling and rope_scaling.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial rotary embeddings are not supported")
        inv = _inv_freq(head_dim, float(rope_theta), rope_scaling, max_position)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv[None, :]
        # Half-width tables: the two halves of a head share the same angle.
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)
        self._last: tuple = (None, None, None, None)   # (positions, dtype, cos, sin) of the last call

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        x = x.view(T, -1, self.head_dim)
        x1, x2 = x.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.view(T, -1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # every layer of a forward passes the same positions tensor: gather cos/sin once
        if positions is not self._last[0] or q.dtype != self._last[1]:
            cos = self.cos_cache[positions].to(q.dtype).unsqueeze(1)  # [T, 1, hd/2]
            sin = self.sin_cache[positions].to(q.dtype).unsqueeze(1)
            self._last = (positions, q.dtype, cos, sin)
        cos, sin = self._last[2], self._last[3]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


def get_rope(head_dim: int, rope_theta: float, rope_scaling: dict | None, max_position: int) -> nn.Module:
    return RotaryEmbedding(head_dim, rope_theta, rope_scaling, max_position)


def rope_config(hf_config, layer_type: str | None = None) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) for a layer type ("full_attention"/"sliding_attention")."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        nested = {k: v for k, v in params.items() if isinstance(v, dict)}
        if nested:
            params = nested.get(layer_type or "full_attention") or nested.get("full_attention") or {}
        theta = params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0
        scaling = dict(params) if _rope_type(params) != "default" else None
        return float(theta), scaling
    # transformers 4.x style attributes
    if layer_type == "sliding_attention" and getattr(hf_config, "rope_local_base_freq", None):
        return float(hf_config.rope_local_base_freq), None
    theta = getattr(hf_config, "rope_theta", None) or 10000.0
    scaling = getattr(hf_config, "rope_scaling", None)
    return float(theta), (dict(scaling) if _rope_type(scaling) != "default" else None)
