"""Llama-family decoder (Llama 2/3/3.1, Mistral, Vicuna, Qwen2/2.5) over paged attention.

One implementation covers the family because the checkpoints differ only in config knobs:
rope scaling, sliding window (Mistral), and q/k/v biases (Qwen2 always has them, Llama only
with `attention_bias`). `CausalLM` holds the model contract shared by every family file.
"""
from __future__ import annotations

import torch
from torch import nn

from eagle_worker.attention import Attention
from eagle_worker.layers.activation import get_act_and_mul
from eagle_worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from eagle_worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from eagle_worker.layers.norm import RMSNorm
from eagle_worker.layers.rotary import get_rope, rope_config


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


LAYER_TYPES = ("sliding_attention", "full_attention")


def sliding_window_of(config, layer_idx: int) -> int | None:
    """Window of one layer: per `layer_types` when present (Qwen2/3, Gemma 3), else global for Mistral
    only (transformers' Llama ignores a `sliding_window` key and attends to everything)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        if layer_types[layer_idx] not in LAYER_TYPES:
            raise ValueError(f"layer_types[{layer_idx}] = {layer_types[layer_idx]!r} is not supported "
                             f"(supported: {', '.join(LAYER_TYPES)})")
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window if getattr(config, "model_type", None) == "mistral" else None


def max_position_of(config) -> int:
    return getattr(config, "max_position_embeddings", None) or 8192


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: nn.Module, qkv_bias: bool, o_bias: bool):
        super().__init__()
        hd = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, hd, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, config.hidden_size, bias=o_bias)
        self.rotary_emb = rotary
        self.head_dim = hd
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, hd,
                              scale=self.attention_scale(config), sliding_window=sliding_window_of(config, layer_idx))

    def attention_scale(self, config) -> float:
        return self.head_dim ** -0.5

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook for per-head q/k norms (Qwen3, Gemma 3); identity for Llama."""
        return q, k

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, k = self.norm_qk(q, k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = get_act_and_mul(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, config, layer_idx: int, rotary: nn.Module, qkv_bias: bool, o_bias: bool):
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_idx, rotary, qkv_bias, o_bias)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, getattr(config, "hidden_act", "silu"),
                            bias=getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(positions, self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    layer_cls = LlamaDecoderLayer

    def __init__(self, config, qkv_bias: bool, o_bias: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        theta, scaling = rope_config(config)
        rotary = get_rope(head_dim_of(config), theta, scaling, max_position_of(config))
        self.layers = nn.ModuleList(self.layer_cls(config, i, rotary, qkv_bias, o_bias)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class CausalLM(nn.Module):
    """The model contract the engine and EAGLE code rely on (see each method)."""

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    final_logit_softcapping: float | None = None

    def _finish_init(self, config) -> None:
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Input embedding exactly as layer 0 sees it."""
        return self.model.embed(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, aux_layers: tuple[int, ...] = ()):
        """Final-norm hidden states of a packed batch; with `aux_layers`, also the residual stream
        entering each listed layer (index `num_layers` gives the final output, as HF does)."""
        h = self.embed(input_ids)
        wanted = set(aux_layers)
        bad = [i for i in wanted if not 0 <= i <= self.num_layers]
        if bad:
            raise ValueError(f"aux_layers {bad} out of range [0, {self.num_layers}]")
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in wanted:
                captured[i] = h
            h = layer(positions, h)
        h = self.model.norm(h)
        if not aux_layers:
            return h
        captured[self.num_layers] = h
        return h, [captured[i] for i in aux_layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._softcap(self.lm_head(hidden))

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """compute_logits(hidden).argmax(-1), without full logits where the LM head can avoid them."""
        return self.lm_head.greedy(hidden, self._softcap if self.final_logit_softcapping else None)

    def screen_bounds(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Screened logits and their error bounds where the LM head screens (not under softcapping,
        which the bounds do not follow); None where only `compute_logits` answers."""
        return None if self.final_logit_softcapping else self.lm_head.screen_bounds(hidden)

    def logits_at(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """compute_logits(hidden)[:, ids], for a model whose head screens (one rank, no softcapping)."""
        return self.lm_head.logits_at(hidden, ids)

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]


class LlamaForCausalLM(CausalLM):
    """Llama / Mistral / Vicuna / Qwen2. Qwen2 has q/k/v bias but no o_proj bias."""

    def __init__(self, config):
        super().__init__()
        is_qwen2 = getattr(config, "model_type", "") == "qwen2" or any(
            a.startswith("Qwen2") for a in (getattr(config, "architectures", None) or []))
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = True if is_qwen2 else attention_bias
        o_bias = False if is_qwen2 else attention_bias
        self.model = LlamaModel(config, qkv_bias, o_bias)
        self._finish_init(config)
