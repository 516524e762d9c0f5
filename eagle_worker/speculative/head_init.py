"""A fresh, randomly initialised draft head for a target: the start of training, and the
'random head' that correctness tests speculate with (it accepts little, which must still be right)."""
from __future__ import annotations

import torch
from torch import nn

from eagle_worker.speculative.head_format import head_config
from eagle_worker.speculative.head_loader import build_head_like_target
from eagle_worker.speculative.heads import DraftHead


def head_raw_config(kind: str, target: nn.Module, target_hf_config, draft_vocab_size: int | None = None) -> dict:
    """config.json fields of a one-layer Llama head shaped after the target's attention."""
    cfg = target_hf_config.get_text_config() if hasattr(target_hf_config, "get_text_config") else target_hf_config
    nh = cfg.num_attention_heads
    raw = {
        "architectures": ["LlamaForCausalLMEagle3" if kind == "eagle3" else "LlamaForCausalLM"],
        "model_type": "llama", "hidden_act": "silu", "num_hidden_layers": 1,
        "hidden_size": target.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": nh, "num_key_value_heads": getattr(cfg, "num_key_value_heads", nh) or nh,
        "head_dim": getattr(cfg, "head_dim", None) or target.hidden_size // nh,
        "rms_norm_eps": getattr(cfg, "rms_norm_eps", 1e-6), "rope_theta": 10000.0,
        "max_position_embeddings": getattr(cfg, "max_position_embeddings", 2048), "vocab_size": target.vocab_size,
        "bias": kind == "eagle",
    }
    if kind == "eagle3":
        raw["draft_vocab_size"] = draft_vocab_size or target.vocab_size
    return raw


def new_head(kind: str, target: nn.Module, target_hf_config, draft_vocab_ids: torch.Tensor | None = None,
             seed: int = 0, std: float = 0.02) -> DraftHead:
    """Build and initialise a head; for EAGLE-3, `draft_vocab_ids` (ascending target ids) sets d2t/t2d."""
    if kind not in ("eagle", "eagle3"):
        raise ValueError(f"unknown head kind {kind!r} (eagle, eagle3)")
    dv = len(draft_vocab_ids) if draft_vocab_ids is not None else None
    raw = head_raw_config(kind, target, target_hf_config, dv)
    sd = {"lm_head.weight": torch.empty(0)} if kind == "eagle3" else {}   # own lm_head over the draft vocab
    head = build_head_like_target(head_config(raw, sd, target, target_hf_config), target)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
        if kind == "eagle3" and draft_vocab_ids is not None:
            ids = torch.as_tensor(draft_vocab_ids, dtype=torch.long, device=head.d2t.device)
            head.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
            head.t2d.zero_()
            head.t2d[ids] = True
        elif kind == "eagle3":
            head.d2t.zero_()
    return head.eval()
