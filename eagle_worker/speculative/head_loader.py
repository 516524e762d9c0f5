"""Load published EAGLE heads as they are, refuse heads that do not fit the target, and save our
heads in the published layout (config.json + model.safetensors) for vLLM / SGLang.

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

import json
from pathlib import Path

import torch
from torch import nn

from eagle_worker.layers.argmax_screen import fast_bf16
from eagle_worker.layers.linear import default_weight_loader
from eagle_worker.layers.rotary import rope_config
from eagle_worker.parallel import single_rank
from eagle_worker.speculative.heads import DraftHead, HeadConfig, TargetVocab, build_head

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class _NS:
    """config.json as attributes, for `rope_config` (keeps unknown fields, no HF defaults)."""

    def __init__(self, d: dict):
        self.__dict__.update(d)


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """model.safetensors / pytorch_model.bin (sharded or not). `.bin` only with weights_only=True."""
    from safetensors.torch import load_file

    for index, kind in (("model.safetensors.index.json", "st"), ("pytorch_model.bin.index.json", "bin")):
        if (folder / index).exists():
            files = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            break
    else:
        files = [p.name for p in sorted(folder.glob("*.safetensors"))]
        kind = "st"
        if not files:
            files, kind = [p.name for p in sorted(folder.glob("pytorch_model*.bin"))], "bin"
    if not files:
        raise ValueError(f"draft head {folder}: no model.safetensors or pytorch_model.bin")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if kind == "st":
            out.update(load_file(str(folder / f)))
        else:
            try:
                state = torch.load(folder / f, map_location="cpu", weights_only=True)
            except Exception as e:   # includes pickles that weights_only refuses to run
                raise ValueError(f"draft head {folder / f}: unreadable with torch.load(weights_only=True): {e}") from e
            if not isinstance(state, dict):
                raise ValueError(f"draft head {folder / f} does not hold a state dict")
            out.update(state)
    return out


def _normalise_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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


def _from_speculators(raw: dict, sd: dict[str, torch.Tensor], path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
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
    _refuse_multilayer(layer, sd, where)
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
    else:
        flat["architectures"] = ["LlamaForCausalLM"]
        flat["bias"] = bool(raw.get("fusion_bias", False)) or "fc.bias" in sd
    return flat, sd


def _drop_target_lm_head(sd: dict[str, torch.Tensor], target: nn.Module, vocab: TargetVocab | None,
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


def _refuse_multilayer(raw: dict, sd: dict[str, torch.Tensor], where: str) -> None:
    n_layers = int(raw.get("num_hidden_layers") or 1)
    deeper = sorted({k.split(".")[1] for k in sd if k.startswith("layers.") and k.split(".")[1] != "0"})
    if n_layers > 1 or deeper:
        raise ValueError(f"{where}: multi-layer heads are not supported (num_hidden_layers={n_layers}"
                         + (f", tensors for layers {deeper}" if deeper else "") + "); one decoder layer only")


def _refuse_yarn(raw: dict, path: Path) -> None:
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
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        return tuple(int(i) for i in raw["eagle_aux_hidden_state_layer_ids"])
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        return tuple(int(i) + 1 for i in nested)
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


def expected_shapes(cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
    """Full (unsharded) checkpoint shapes a head with this config needs, in published names."""
    H, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    eagle3 = cfg.kind == "eagle3"
    pre = "midlayer." if eagle3 else "layers.0."
    attn_in = 2 * H if eagle3 else H
    fc_in = max(1, len(cfg.aux_layers)) * H if eagle3 else 2 * H
    s = {"fc.weight": (H, fc_in)}
    if cfg.fc_bias:
        s["fc.bias"] = (H,)
    for n, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        s[f"{pre}self_attn.{n}.weight"] = (rows, attn_in)
        if cfg.qkv_bias:
            s[f"{pre}self_attn.{n}.bias"] = (rows,)
    s[f"{pre}self_attn.o_proj.weight"] = (H, q)
    s[f"{pre}mlp.gate_proj.weight"] = (inter, H)
    s[f"{pre}mlp.up_proj.weight"] = (inter, H)
    s[f"{pre}mlp.down_proj.weight"] = (H, inter)
    s[f"{pre}post_attention_layernorm.weight"] = (H,)
    if eagle3:
        s[f"{pre}input_layernorm.weight"] = (H,)
        s[f"{pre}hidden_norm.weight"] = (H,)
        s["norm.weight"] = (H,)
        if not cfg.lm_head_from_target:
            s["lm_head.weight"] = (cfg.draft_vocab_size, H)
        s["d2t"] = (cfg.draft_vocab_size,)
        s["t2d"] = (cfg.vocab_size,)
    return s


_OPTIONAL = ("embed_tokens.weight", "d2t", "t2d")


def _check(cfg: HeadConfig, sd: dict[str, torch.Tensor], path: Path, target_desc: str) -> None:
    want = expected_shapes(cfg)
    unexpected = [n for n in sd if n not in want and n != "embed_tokens.weight"]
    if unexpected:
        raise ValueError(f"draft head {path}: unexpected tensor(s) {unexpected[:6]} for a {cfg.kind} head")
    if "embed_tokens.weight" in sd:
        want["embed_tokens.weight"] = (cfg.vocab_size, cfg.hidden_size)
    bad = [f"{n!r} has shape {tuple(sd[n].shape)}, expected {want[n]}"
           for n in want if n in sd and tuple(sd[n].shape) != want[n]]
    if bad:
        raise ValueError(f"draft head {path} does not fit the target ({target_desc}): " + "; ".join(bad))
    missing = [n for n in want if n not in sd and not (n in _OPTIONAL and cfg.draft_vocab_size == cfg.vocab_size)]
    if missing:
        raise ValueError(f"draft head {path} ({cfg.kind}) is missing tensor(s): {missing}")
    if cfg.kind == "eagle3" and "d2t" in sd:
        tgt = torch.arange(cfg.draft_vocab_size) + sd["d2t"].long()
        if int(tgt.min()) < 0 or int(tgt.max()) >= cfg.vocab_size:
            raise ValueError(f"draft head {path}: 'd2t' maps draft ids outside the target vocabulary [0, {cfg.vocab_size})")
    hsz = cfg.raw.get("hidden_size")
    if hsz is not None and int(hsz) != cfg.hidden_size:
        raise ValueError(f"draft head {path}: config hidden_size {hsz} != target hidden size {cfg.hidden_size}")
    vs = cfg.raw.get("vocab_size")
    if vs is not None and int(vs) != cfg.vocab_size:
        raise ValueError(f"draft head {path}: config vocab_size {vs} != target vocab size {cfg.vocab_size}")


def _load_into(head: DraftHead, sd: dict[str, torch.Tensor]) -> None:
    params = dict(head.named_parameters())
    eagle3 = head.kind == "eagle3"
    with torch.no_grad():
        for name, t in sd.items():
            if name in ("d2t", "t2d"):
                getattr(head, name).copy_(t.to(getattr(head, name).dtype))
                continue
            parts = name.split(".")
            shard = None
            for i, p in enumerate(parts):
                if p in _PACKED:
                    parts[i], shard = _PACKED[p]
            pname = ".".join(parts)
            if name == "embed_tokens.weight" and not head.config.own_embedding:
                continue
            param = params[pname]
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, t) if shard is None else loader(param, t, shard)
        if eagle3 and "d2t" not in sd:
            head.d2t.zero_()


def load_draft_head(path: str | Path, target_model: nn.Module, target_hf_config,
                    vocab: TargetVocab | None = None, dtype: torch.dtype | None = None) -> DraftHead:
    """Build the head for `target_model` from an EAGLE-1/2 or EAGLE-3 checkpoint folder, on the
    target's device, in `dtype` (None: the target's; see `head_dtype`). Raises ValueError (naming
    tensors and shapes) if it does not fit. The head is never sharded: under tensor parallelism it
    runs on rank 0 alone, borrowing the target's vocabulary through `vocab` (full copies of the
    sharded tables)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ValueError(f"draft head {path}: no config.json")
    raw = json.loads(cfg_file.read_text())
    sd = _normalise_names(read_state_dict(path))
    if raw.get("speculators_model_type") is not None:
        raw, sd = _from_speculators(raw, sd, path)
        if detect_kind(raw, sd) == "eagle":
            sd = _drop_target_lm_head(sd, target_model, vocab, path)
    _refuse_multilayer(raw, sd, f"draft head {path}")
    _refuse_yarn(raw, path)
    if detect_kind(raw, sd) == "eagle3":
        sd = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in sd.items()}
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"draft head {path}: hidden_act {raw['hidden_act']!r} is not supported (silu only)")
    cfg = head_config(raw, sd, target_model, target_hf_config, vocab)
    desc = (f"{type(target_model).__name__}, hidden_size={cfg.hidden_size}, vocab_size={cfg.vocab_size}, "
            f"num_layers={target_model.num_layers}")
    _check(cfg, sd, path, desc)
    head = build_head_like_target(cfg, target_model, vocab, dtype)
    _load_into(head, sd)
    return head.eval()


def head_dtype(setting: str, target_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a head runs in (`SpecConfig.head_dtype`): "target" (the default) the target's;
    "auto" bfloat16 under a float32 target where the device has bf16 arithmetic (a CUDA GPU that
    supports it, a CPU with AVX512-BF16 or AMX), else the target's. The head only proposes: the
    target verifies every token in its own dtype, so the output does not change; a bf16 head's
    GEMMs are about 2x faster on such a CPU and draft the same tokens, but drafting is a few percent
    of a run, below what the CPU benchmarks resolve: so it is opt-in."""
    if setting == "target":
        return target_dtype
    if setting != "auto":
        return getattr(torch, setting)
    if target_dtype == torch.float32 and fast_bf16(torch.device(device)):
        return torch.bfloat16
    return target_dtype


def build_head_like_target(cfg: HeadConfig, target: nn.Module, vocab: TargetVocab | None = None,
                           dtype: torch.dtype | None = None) -> DraftHead:
    """An (uninitialised, unsharded) head on the target's device, in `dtype` (None: the target's)."""
    ref = next(target.parameters())
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype or ref.dtype)
    try:
        with torch.device(ref.device), single_rank():
            return build_head(cfg, target, vocab)
    finally:
        torch.set_default_dtype(prev)


# ------------------------------------------------------------------------------------- saving

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
