"""Published EAGLE head formats, read as they are: a checkpoint folder's tensors and config.json
mapped onto one set of names and a `HeadConfig`, refusing layouts our heads cannot run.

Formats (key names after stripping an optional "model." prefix):
  EAGLE-1/2  fc.weight [H, 2H], fc.bias [H] (config `bias`, default true; the checkpoint decides),
             layers.0.self_attn.{q,k,v,o}_proj.weight (+ q/k/v .bias: Qwen2, config `qkv_bias`),
             layers.0.mlp.{gate,up,down}_proj.weight, layers.0.post_attention_layernorm.weight,
             embed_tokens.weight (optional: a frozen copy of the target's).
  EAGLE-3    fc.weight [H, 3H], midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
             midlayer.self_attn.{q,k,v}_proj.weight [*, 2H], midlayer.self_attn.o_proj.weight,
             midlayer.mlp.*, norm.weight, lm_head.weight [Vd, H], d2t [Vd] int64, t2d [V] bool.
             Accepted variants: "layers.0." for "midlayer." (vLLM), "draft_id_to_target_id" for d2t,
             architectures "LlamaForCausalLMEagle3"/"Eagle3LlamaForCausalLM".
Rope: the head's own config (rope_theta 10000 when absent — EAGLE-3's published Llama-3.1 head
has none); positions up to the target's context length.

Layouts read (all mapped onto the names above before anything is checked):
  * EAGLE official (SafeAILab/EAGLE, yuhuili/* heads): the formats above, config.json flat.
  * vLLM: "layers.0." for "midlayer.", "draft_id_to_target_id", an optional "model." prefix,
    top-level `eagle_aux_hidden_state_layer_ids` (input-of-layer ids).
  * SGLang: nested `eagle_config.eagle_aux_hidden_state_layer_ids` (layer-output ids, +1).
  * speculators (Red Hat / Neural Magic, e.g. RedHatAI/*-speculator.eagle3; what vLLM reads when
    config.json has `speculators_model_type`): the Llama settings nested in
    `transformer_layer_config` are flattened into the config our head reads, as vLLM does.
    "eagle3" (Eagle3Speculator / Eagle3DraftModel): tensors fc, layers.0.*, norm, lm_head, d2t,
    t2d, embed_tokens as above; `eagle_aux_hidden_state_layer_ids` in vLLM's convention;
    `norm_before_residual` true when absent (vLLM's reading); the training-only copies
    verifier_norm / verifier_lm_head are dropped. "eagle" (EagleSpeculator, EAGLE-1/2/HASS):
    fusion_fc.{weight,bias} -> fc (bias per `fusion_bias`), transformer.* -> layers.0.*.
    Refused, naming what is unsupported: other speculators_model_type values, `layernorms: true`
    HASS heads (embedding_layernorm / pre_lm_head_layernorm / the layer's input_layernorm),
    `norm_before_fc` (input_norm), target_hidden_size != hidden_size, q_norm/k_norm layers
    (Qwen3-style), and an EAGLE-1 lm_head that differs from the target's.
Refused in every layout: multi-layer heads (num_hidden_layers > 1 or layers.1.* tensors), yarn rope.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from eagle_worker.layers.rotary import rope_config
from eagle_worker.loader import CheckpointError, bin_tensors, checkpoint_files, safetensors_tensors
from eagle_worker.speculative.heads import HeadConfig, TargetVocab

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class _NS:
    """config.json as attributes, for `rope_config` (keeps unknown fields, no HF defaults)."""

    def __init__(self, d: dict):
        self.__dict__.update(d)


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """model.safetensors / pytorch_model.bin (sharded or not), read as the target's checkpoints are
    (eagle_worker/loader.py: `.bin` only with weights_only=True; a corrupt or truncated file is an
    error naming it)."""
    try:
        kind, files = checkpoint_files(folder)
        if kind == "gguf":
            raise CheckpointError("no model.safetensors or pytorch_model.bin")
        read = safetensors_tensors if kind == "safetensors" else bin_tensors
        return {name: tensor for f in files for name, tensor in read(f)}
    except CheckpointError as e:
        raise ValueError(f"draft head {folder}: {e}") from None


def normalise_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in sd.items():
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name.startswith("model."):
            name = name[len("model."):]
        if name == "draft_id_to_target_id":
            name = "d2t"
        out[name] = t
    return out


_HASS_NORMS = ("embedding_layernorm.weight", "pre_lm_head_layernorm.weight", "layers.0.input_layernorm.weight")


def from_speculators(raw: dict, sd: dict[str, torch.Tensor], path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A speculators-format head (config with `speculators_model_type`) as the flat config and
    tensor names of the EAGLE-official layout, or ValueError naming what our heads cannot run."""
    stype = raw.get("speculators_model_type")
    where = f"draft head {path} (speculators {stype!r})"
    if stype not in ("eagle", "eagle3"):
        raise ValueError(f"draft head {path}: speculators_model_type {stype!r} is not supported (eagle, eagle3)")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{where}: config.json has no transformer_layer_config dict")
    arch = raw.get("transformer_layer_architecture", "LlamaDecoderLayer")
    if stype == "eagle" and arch != "LlamaDecoderLayer":
        raise ValueError(f"{where}: transformer_layer_architecture {arch!r} is not supported (LlamaDecoderLayer)")
    sd = {k: v for k, v in sd.items() if not k.startswith(("verifier_", "verifier."))}   # training-only copies
    if stype == "eagle":
        renamed = {}
        for k, v in sd.items():
            if k.startswith("fusion_fc."):
                k = "fc." + k[len("fusion_fc."):]
            elif k.startswith("transformer."):
                k = "layers.0." + k[len("transformer."):]
            renamed[k] = v
        sd = renamed
        norms = [n for n in _HASS_NORMS if n in sd]
        if raw.get("layernorms") or norms:
            raise ValueError(f"{where}: `layernorms: true` (HASS extra norms embedding_layernorm, "
                             f"pre_lm_head_layernorm and the layer's input_layernorm; found {norms}) is not "
                             "supported: our EAGLE-1 head has no such norms")
    refuse_multilayer(layer, sd, where)
    if raw.get("norm_before_fc") or "input_norm.weight" in sd:
        raise ValueError(f"{where}: norm_before_fc (an RMSNorm 'input_norm' over the fused target "
                         "hidden states before fc) is not supported")
    qk_norms = [k for k in sd if ".q_norm." in k or ".k_norm." in k]
    if qk_norms:
        raise ValueError(f"{where}: per-head q_norm/k_norm ({layer.get('model_type')!r} decoder layer) "
                         f"is not supported: {qk_norms[:2]}")
    tgt_h = raw.get("target_hidden_size")
    if tgt_h is not None and int(tgt_h) != int(layer.get("hidden_size", tgt_h)):
        raise ValueError(f"{where}: target_hidden_size {tgt_h} != the head's hidden_size "
                         f"{layer.get('hidden_size')} is not supported (the head works in the target's width)")
    flat = {k: v for k, v in layer.items() if k not in ("architectures", "auto_map", "eagle_config")}
    flat["num_hidden_layers"] = 1
    if stype == "eagle3":
        flat["architectures"] = ["Eagle3LlamaForCausalLM"]
        flat["draft_vocab_size"] = raw.get("draft_vocab_size") or layer.get("vocab_size")
        flat["norm_before_residual"] = bool(raw.get("norm_before_residual", True))   # vLLM's default
        if raw.get("eagle_aux_hidden_state_layer_ids"):   # vLLM's (input-of-layer) convention
            flat["eagle_aux_hidden_state_layer_ids"] = list(raw["eagle_aux_hidden_state_layer_ids"])
        if "norm_output" in raw:
            flat["norm_output"] = raw["norm_output"]      # refused by the loader when true
    else:
        flat["architectures"] = ["LlamaForCausalLM"]
        flat["bias"] = bool(raw.get("fusion_bias", False)) or "fc.bias" in sd
    return flat, sd


def drop_target_lm_head(sd: dict[str, torch.Tensor], target: nn.Module, vocab: TargetVocab | None,
                         path: Path) -> dict[str, torch.Tensor]:
    """An EAGLE-1 head logits through the target's LM head; a stored copy of it is dropped, a
    different one refused."""
    w = sd.get("lm_head.weight")
    if w is None:
        return sd
    if not _same_table(w, (vocab or TargetVocab(target)).lm_head_weight):
        raise ValueError(f"draft head {path}: an EAGLE-1 head with its own lm_head (different from the "
                         "target's) is not supported")
    return {k: v for k, v in sd.items() if k != "lm_head.weight"}


def refuse_multilayer(raw: dict, sd: dict[str, torch.Tensor], where: str) -> None:
    n_layers = int(raw.get("num_hidden_layers") or 1)
    deeper = sorted({k.split(".")[1] for k in sd if k.startswith("layers.") and k.split(".")[1] != "0"})
    if n_layers > 1 or deeper:
        raise ValueError(f"{where}: multi-layer heads are not supported (num_hidden_layers={n_layers}"
                         + (f", tensors for layers {deeper}" if deeper else "") + "); one decoder layer only")


def refuse_yarn(raw: dict, path: Path) -> None:
    _, scaling = rope_config(_NS(raw))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if kind == "yarn":
        raise ValueError(f"draft head {path}: yarn rope scaling is not supported for draft heads")


def detect_kind(raw: dict, sd: dict[str, torch.Tensor]) -> str:
    archs = " ".join(raw.get("architectures") or [])
    if "Eagle3" in archs or "d2t" in sd or any(k.startswith("midlayer.") or ".hidden_norm." in k for k in sd):
        return "eagle3"
    return "eagle"


def _aux_layers(raw: dict, num_target_layers: int) -> tuple[int, ...]:
    """Input-of-layer ids. vLLM's top-level field is already that; SGLang's nested
    eagle_config field names layer outputs (+1)."""
    if raw.get("eagle_aux_hidden_state_layer_ids"):   # fused in layer order, as vLLM and SGLang collect them
        return tuple(sorted(int(i) for i in raw["eagle_aux_hidden_state_layer_ids"]))
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        return tuple(sorted(int(i) + 1 for i in nested))
    L = num_target_layers
    return (2, L // 2, L - 3)


def head_config(raw: dict, sd: dict[str, torch.Tensor], target: nn.Module, target_hf_config,
                vocab: TargetVocab | None = None) -> HeadConfig:
    kind = detect_kind(raw, sd)
    H, V = int(target.hidden_size), int(target.vocab_size)
    nh = int(raw.get("num_attention_heads", 32))
    hd = int(raw.get("head_dim") or raw.get("hidden_size", H) // nh)
    theta, scaling = rope_config(_NS(raw))
    target_ctx = getattr(target_hf_config, "max_position_embeddings", None) or 0
    if hasattr(target_hf_config, "get_text_config"):
        target_ctx = max(target_ctx, getattr(target_hf_config.get_text_config(), "max_position_embeddings", 0) or 0)
    max_pos = max(int(raw.get("max_position_embeddings") or 2048), int(target_ctx), 2048)
    pre = "midlayer." if kind == "eagle3" else "layers.0."
    emb = sd.get("embed_tokens.weight")
    own_emb = emb is not None and not _same_table(emb, (vocab or TargetVocab(target)).embedding_weight)
    draft_vocab = int(raw.get("draft_vocab_size") or V) if kind == "eagle3" else V
    return HeadConfig(
        kind=kind, hidden_size=H, intermediate_size=int(raw.get("intermediate_size", 4 * H)),
        num_heads=nh, num_kv_heads=int(raw.get("num_key_value_heads") or nh), head_dim=hd,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
        max_position=max_pos, vocab_size=V, draft_vocab_size=draft_vocab,
        aux_layers=_aux_layers(raw, int(target.num_layers)) if kind == "eagle3" else (),
        # the checkpoint decides, but a config that promises biases the checkpoint lacks is refused
        fc_bias="fc.bias" in sd or raw.get("bias") is True,
        qkv_bias=f"{pre}self_attn.q_proj.bias" in sd or bool(raw.get("qkv_bias")) or bool(raw.get("attention_bias")),
        own_embedding=own_emb,
        # no lm_head over the full vocabulary (SGLang's load_lm_head_from_target / tied heads)
        lm_head_from_target=kind == "eagle3" and "lm_head.weight" not in sd and draft_vocab == V,
        norm_before_residual=bool(raw.get("norm_before_residual", False)), raw=dict(raw))


def _same_table(emb: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a head's stored table is a copy of the target's `w`: published EAGLE-1 heads store a
    frozen copy of the token table (and speculators heads of the LM head), often in another dtype,
    so the target's is shared instead of holding a second V x H table. The tolerance covers
    bf16/fp16 rounding of the same table; a head whose table really differs keeps its own."""
    if tuple(w.shape) != tuple(emb.shape):
        return False
    for start in range(0, w.shape[0], 8192):   # chunked: a 128k x 4096 table is 2 GiB in fp32
        a = w[start:start + 8192].detach().float().cpu()
        if not torch.allclose(a, emb[start:start + 8192].float(), rtol=4e-3, atol=1e-6):
            return False
    return True
