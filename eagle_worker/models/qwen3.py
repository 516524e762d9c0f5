"""Qwen3 dense decoder: the Llama layout plus an RMSNorm over each q and k head before rope."""
from __future__ import annotations

import torch

from eagle_worker.layers.norm import RMSNorm
from eagle_worker.models.llama import CausalLM, LlamaAttention, LlamaDecoderLayer, LlamaModel, head_dim_of


class Qwen3Attention(LlamaAttention):
    def __init__(self, config, layer_idx, rotary, qkv_bias, o_bias):
        super().__init__(config, layer_idx, rotary, qkv_bias, o_bias)
        self.q_norm = RMSNorm(head_dim_of(config), config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim_of(config), config.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T, hd = q.shape[0], self.head_dim
        return self.q_norm(q.view(T, -1, hd)).view(T, -1), self.k_norm(k.view(T, -1, hd)).view(T, -1)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(CausalLM):
    def __init__(self, config):
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        self.model = Qwen3Model(config, qkv_bias=bias, o_bias=bias)
        self._finish_init(config)
