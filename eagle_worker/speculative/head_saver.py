"""Save our heads in the published layout (config.json + model.safetensors) that vLLM, SGLang and
`load_draft_head` read."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle_worker.speculative.heads import DraftHead


def _unpacked_state(head: DraftHead) -> dict[str, torch.Tensor]:
    cfg = head.config
    hd = cfg.head_dim
    sizes = [cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd]
    out = {}
    for name, t in head.state_dict().items():
        t = t.detach().cpu().contiguous()
        if ".qkv_proj." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split(sizes, dim=0)):
                out[name.replace("qkv_proj", part)] = piece.contiguous()
        elif ".gate_up_proj." in name:
            g, u = t.chunk(2, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = g.contiguous()
            out[name.replace("gate_up_proj", "up_proj")] = u.contiguous()
        else:
            out[name] = t
    return out


def save_draft_head(head: DraftHead, out_dir: str | Path, format: str | None = None) -> Path:
    """Write config.json + model.safetensors in the published layout of `format` ("eagle" for
    EAGLE-1/2, "eagle3"; default: the head's own kind). The fc bias follows the published
    convention: present -> no `bias` key (EAGLE's default true), absent -> `"bias": false`."""
    fmt = format or head.kind
    if fmt not in ("eagle", "eagle3"):
        raise ValueError(f"unknown draft head format {fmt!r} (eagle, eagle3)")
    if fmt != head.kind:
        raise ValueError(f"a {head.kind} head cannot be saved as {fmt}: the architectures differ")
    from safetensors.torch import save_file

    cfg = head.config
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(_unpacked_state(head), str(out / "model.safetensors"))
    dtype = next(head.parameters()).dtype
    c = {k: v for k, v in cfg.raw.items() if k not in ("bias", "qkv_bias", "rope_parameters")}
    c.update({
        "model_type": "llama", "hidden_act": "silu", "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position, "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."),
    })
    if fmt == "eagle":
        c["architectures"] = ["LlamaForCausalLM"]
        if not cfg.fc_bias:
            c["bias"] = False
        if cfg.qkv_bias:
            c["qkv_bias"] = True
    else:
        c["architectures"] = ["LlamaForCausalLMEagle3"]
        c["draft_vocab_size"] = cfg.draft_vocab_size
        if cfg.fc_bias:
            c["bias"] = True
        if cfg.qkv_bias:
            c["attention_bias"] = True
        c.pop("eagle_aux_hidden_state_layer_ids", None)
        c.pop("eagle_config", None)
        L = int(head.target.num_layers)
        if tuple(cfg.aux_layers) != (2, L // 2, L - 3):   # both engines' spellings
            c["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layers)
            c["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.aux_layers]}
    (out / "config.json").write_text(json.dumps(c, indent=2) + "\n")
    return out
