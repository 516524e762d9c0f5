"""EAGLE draft heads: one decoder layer that drafts in the target's feature space.

Two published families, loaded as they are (see `head_format.py` for the checkpoint formats):

* EAGLE-1/2 (`Eagle1Head`): h = fc(cat(embed(token), feature)) — embedding FIRST, as in
  SafeAILab/EAGLE `cnets1.py` — then a Llama decoder layer without input_layernorm (the feature is
  already normalised). The output is the predicted next feature; logits go through the TARGET's
  LM head. The feature at the first step is the target's final-norm output (the LM-head input).
* EAGLE-3 (`Eagle3Head`): the first step fuses the target's hidden states at the INPUTS of layers
  (2, L//2, L-3) (0-based; "before layer idx" = the residual stream entering it) with fc
  [H, 3H]. This is what EAGLE-3's `modeling_llama_kv.py` captures and what vLLM's and SGLang's
  defaults capture. Custom ids: vLLM's top-level `eagle_aux_hidden_state_layer_ids` are also
  "input of layer i"; SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids` name layer
  OUTPUTS, so SGLang adds 1 — the loader converts both to our input-of-layer convention. (EAGLE's
  own code deduplicates coinciding ids for tiny targets; we keep the list as is.) The midlayer's
  q/k/v read cat(input_layernorm(embed(token)), hidden_norm(h)) [2H]; logits come from its own
  norm + lm_head over a reduced draft vocabulary, target id = draft id + d2t[draft id]. Later
  steps feed back the head's own pre-norm output (H wide, no fc).

Alignment (both): the head input pairs the feature of position t with the token at t+1 and runs
at position t, exactly as the official code shifts input_ids by one; its output predicts the
token at t+2. The embedding is the target's raw table (the published heads and vLLM/SGLang look
tokens up in the shared nn.Embedding, without e.g. Gemma's sqrt(H) scale).

Attention goes through `eagle_worker.attention.Attention`, so the engine gives the head a paged
KV cache (one layer) with the same block tables as the target: `attention_layers()`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from eagle_worker.attention import Attention
from eagle_worker.layers.activation import SiluAndMul
from eagle_worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from eagle_worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear, linear
from eagle_worker.layers.norm import RMSNorm
from eagle_worker.layers.rotary import get_rope


@dataclass
class HeadConfig:
    """Everything needed to build a head; `raw` is the checkpoint's config.json (kept for saving)."""

    kind: str                      # "eagle" (EAGLE-1/2) or "eagle3"
    hidden_size: int               # = the target's hidden size
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position: int
    vocab_size: int                # the target's vocabulary
    draft_vocab_size: int          # EAGLE-3 lm_head rows; = vocab_size for EAGLE-1
    aux_layers: tuple[int, ...] = ()   # EAGLE-3: target layers whose INPUT is fused; () = final-norm output
    fc_bias: bool = False
    qkv_bias: bool = False
    own_embedding: bool = False        # the checkpoint carries an embed_tokens that differs from the target's
    lm_head_from_target: bool = False  # EAGLE-3 without lm_head.weight: use the target's LM head
    norm_before_residual: bool = False  # EAGLE-3 variant (vLLM config field)
    raw: dict = field(default_factory=dict)


class HeadAttention(nn.Module):
    def __init__(self, cfg: HeadConfig, in_size: int):
        super().__init__()
        hd = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(in_size, hd, cfg.num_heads, cfg.num_kv_heads, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * hd, cfg.hidden_size, bias=False)
        self.rotary_emb = get_rope(hd, cfg.rope_theta, cfg.rope_scaling, cfg.max_position)
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, hd, scale=hd ** -0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))

    def write_kv(self, positions: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The K/V `forward` would write for these rows, without attending: a row's K/V depends on
        its own input alone."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, k = self.rotary_emb(positions, q, k)
        self.attn.store_kv(k, v, slot_mapping)


class HeadMLP(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Eagle1Layer(nn.Module):
    """Llama decoder layer minus input_layernorm (EAGLE-1/2)."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.self_attn = HeadAttention(cfg, cfg.hidden_size)
        self.mlp = HeadMLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(positions, h)
        return h + self.mlp(self.post_attention_layernorm(h))

    def write_kv(self, positions: torch.Tensor, h: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self.self_attn.write_kv(positions, h, slot_mapping)


class Eagle3Layer(nn.Module):
    """EAGLE-3 midlayer: attention over [normed embedding | normed hidden], residual = hidden."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = HeadAttention(cfg, 2 * cfg.hidden_size)
        self.mlp = HeadMLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, emb: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        hn = self.hidden_norm(h)
        residual = hn if self.norm_before_residual else h
        x = torch.cat([self.input_layernorm(emb), hn], dim=-1)
        h = residual + self.self_attn(positions, x)
        return h + self.mlp(self.post_attention_layernorm(h))

    def write_kv(self, positions: torch.Tensor, emb: torch.Tensor, h: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)
        self.self_attn.write_kv(positions, x, slot_mapping)


def _raw_embedding(target: nn.Module):
    """The target's token table as the heads were trained with it: the raw lookup."""
    inner = getattr(target, "model", None)
    emb = getattr(inner, "embed_tokens", None) if inner is not None else None
    return emb if emb is not None else target.embed


class TargetVocab:
    """What a head borrows from its target: the raw token table and the LM head over the target's
    vocabulary. On one rank these are the target's own modules. Under tensor parallelism the
    target's are vocab-sharded (every call a collective all ranks must join) while the head runs
    on rank 0 alone, so it gets full copies (`ModelRunner.gather_vocab`), gathered once."""

    def __init__(self, target: nn.Module, table: torch.Tensor | None = None, lm_head: torch.Tensor | None = None):
        self.target, self.table, self.lm_head = target, table, lm_head

    @property
    def embedding_weight(self) -> torch.Tensor:
        return self.table if self.table is not None else _raw_embedding(self.target).weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head if self.lm_head is not None else self.target.lm_head.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            return _raw_embedding(self.target)(input_ids)
        return F.embedding(input_ids, self.table)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.to(self.lm_head_weight.dtype)     # a head may run in another dtype than the target
        if self.lm_head is None:
            return self.target.compute_logits(hidden)
        logits = linear(hidden, self.lm_head)
        cap = getattr(self.target, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits


class DraftHead(nn.Module):
    """Common interface: `forward(features[T, F], input_ids[T], positions[T]) -> hidden[T, H]`,
    `write_kv(features, input_ids, positions, slot_mapping)` (only the KV `forward` writes, for rows
    whose hidden is not wanted), `logits(hidden) -> [T, draft vocab]`, `to_target_ids(draft ids)`,
    `attention_layers()`.
    The target is referenced, not owned: its parameters are not part of the head's state dict."""

    kind = ""

    def __init__(self, cfg: HeadConfig, target: nn.Module, vocab: TargetVocab | None = None):
        super().__init__()
        self.config = cfg
        object.__setattr__(self, "_target", target)   # not a submodule
        object.__setattr__(self, "vocab", vocab or TargetVocab(target))
        if cfg.own_embedding:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)

    @property
    def target(self) -> nn.Module:
        """The frozen target model the head drafts for (kept out of the head's own parameters)."""
        return self._target

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """Target layers whose input the first step needs (pass to target.forward); () = none."""
        return self.config.aux_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def target_features(self, target_out) -> torch.Tensor:
        """The first-step features from `target.forward(..., aux_layers=head.aux_layers)`."""
        if not self.aux_layers:
            return target_out if isinstance(target_out, torch.Tensor) else target_out[0]
        return torch.cat(list(target_out[1]), dim=-1)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.config.own_embedding:
            return self.embed_tokens(input_ids)
        return self.vocab.embed(input_ids)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def attention_layers(self) -> list[Attention]:
        raise NotImplementedError


class Eagle1Head(DraftHead):
    kind = "eagle"

    def __init__(self, cfg: HeadConfig, target: nn.Module, vocab: TargetVocab | None = None):
        super().__init__(cfg, target, vocab)
        self.fc = ReplicatedLinear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self.layers = nn.ModuleList([Eagle1Layer(cfg)])

    @property
    def feature_size(self) -> int:
        return self.config.hidden_size

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.layers[0](positions, self._input(features, input_ids))

    def write_kv(self, features: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        self.layers[0].write_kv(positions, self._input(features, input_ids), slot_mapping)

    def _input(self, features: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        dtype = self.fc.weight.dtype                     # the target's features may be in another dtype
        return self.fc(torch.cat([self.embed(input_ids).to(dtype), features.to(dtype)], dim=-1))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.vocab.logits(hidden)

    def attention_layers(self) -> list[Attention]:
        return [self.layers[0].self_attn.attn]


class Eagle3Head(DraftHead):
    kind = "eagle3"

    def __init__(self, cfg: HeadConfig, target: nn.Module, vocab: TargetVocab | None = None):
        super().__init__(cfg, target, vocab)
        n_aux = max(1, len(cfg.aux_layers))
        self.fc = ReplicatedLinear(n_aux * cfg.hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.lm_head_from_target:
            self.lm_head = ParallelLMHead(cfg.draft_vocab_size, cfg.hidden_size)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))

    @property
    def feature_size(self) -> int:
        return self.fc.weight.shape[1]

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`features` is either the fused target hidden states [T, n_aux*H] (first step) or the
        head's own previous output [T, H] (later steps)."""
        return self.midlayer(positions, *self._inputs(features, input_ids))

    def write_kv(self, features: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        self.midlayer.write_kv(positions, *self._inputs(features, input_ids), slot_mapping)

    def _inputs(self, features: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.fc.weight.dtype                     # the target's features may be in another dtype
        h = self.fc(features.to(dtype)) if features.shape[-1] != self.config.hidden_size else features.to(dtype)
        return self.embed(input_ids).to(h.dtype), h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        h = self.norm(hidden)
        if self.config.lm_head_from_target:
            return self.vocab.logits(h)
        return self.lm_head(h)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def attention_layers(self) -> list[Attention]:
        return [self.midlayer.self_attn.attn]


def build_head(cfg: HeadConfig, target: nn.Module, vocab: TargetVocab | None = None) -> DraftHead:
    return {"eagle": Eagle1Head, "eagle3": Eagle3Head}[cfg.kind](cfg, target, vocab)
