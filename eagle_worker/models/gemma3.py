"""Gemma 3 text decoder over paged attention.

Differences from Llama that matter for parity: (1 + w) RMSNorms in float32 (including per-head
q/k norms and the pre/post feed-forward norms), the embedding scaled by sqrt(hidden) rounded to
the model dtype, GELU-tanh MLP, `query_pre_attn_scalar` attention scale, interleaved sliding
window / full layers (`layer_types`) each with its own rope base and scaling, and optional final
logit softcapping. `Gemma3ForConditionalGeneration` serves only the text part of the checkpoint.
"""
from __future__ import annotations

import torch
from torch import nn

from eagle_worker.layers.embedding import VocabParallelEmbedding
from eagle_worker.layers.norm import RMSNorm
from eagle_worker.layers.rotary import get_rope, rope_config
from eagle_worker.models.llama import CausalLM, LlamaAttention, LlamaMLP, head_dim_of, max_position_of


def layer_types_of(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types is None:  # transformers 4.x configs: every `sliding_window_pattern`-th layer is global
        pattern = getattr(config, "sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(config.num_hidden_layers)]
    return list(types)


class Gemma3Attention(LlamaAttention):
    def __init__(self, config, layer_idx: int, rotary: nn.Module):
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, layer_idx, rotary, qkv_bias=bias, o_bias=bias)
        if getattr(config, "attn_logit_softcapping", None):
            raise ValueError("Gemma 3 attention logit softcapping is not supported")
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=1.0)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=1.0)

    def attention_scale(self, config) -> float:
        return config.query_pre_attn_scalar ** -0.5

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T, hd = q.shape[0], self.head_dim
        return self.q_norm(q.view(T, -1, hd)).view(T, -1), self.k_norm(k.view(T, -1, hd)).view(T, -1)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: nn.Module):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer_idx, rotary)
        self.mlp = LlamaMLP(H, config.intermediate_size, getattr(config, "hidden_activation", "gelu_pytorch_tanh"))
        self.input_layernorm = RMSNorm(H, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(H, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(H, eps, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(H, eps, offset=1.0)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(h)))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("bidirectional Gemma 3 (embedding models) is not supported")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5, dtype=torch.float32),
                             persistent=False)
        types = layer_types_of(config)
        ropes = {}
        for t in sorted(set(types)):
            theta, scaling = rope_config(config, t)
            ropes[t] = get_rope(head_dim_of(config), theta, scaling, max_position_of(config))
        if getattr(config, "layer_types", None) is None:
            config.layer_types = types  # so sliding_window_of() sees the same per-layer pattern
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i, ropes[t]) for i, t in enumerate(types))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=1.0)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        return h * self.embed_scale.to(h.dtype)


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, config):
        super().__init__()
        self.model = Gemma3Model(config)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self._finish_init(config)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Text-only serving of a multimodal Gemma 3 checkpoint; vision weights are skipped."""

    _SKIP = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
    _RENAME = (("model.language_model.", "model."), ("language_model.model.", "model."),
               ("language_model.lm_head.", "lm_head."))

    def __init__(self, config):
        text = getattr(config, "text_config", None) or config
        if getattr(text, "tie_word_embeddings", None) is None:
            text.tie_word_embeddings = getattr(config, "tie_word_embeddings", True)
        super().__init__(text)

    def remap_checkpoint_name(self, name: str) -> str | None:
        if name.startswith(self._SKIP):
            return None
        for old, new in self._RENAME:
            if name.startswith(old):
                return new + name[len(old):]
        return name
