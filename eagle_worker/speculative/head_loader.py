"""Load a published EAGLE head onto a target (formats: head_format.py): every tensor's shape checked
against the head the config describes, the weights loaded into our packed layers, in the head's dtype."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from eagle_worker.layers import gemm_paths
from eagle_worker.layers.argmax_screen import fast_bf16
from eagle_worker.layers.linear import default_weight_loader
from eagle_worker.parallel import single_rank
from eagle_worker.speculative.head_format import (
    detect_kind,
    drop_target_lm_head,
    from_speculators,
    head_config,
    normalise_names,
    read_state_dict,
    refuse_multilayer,
    refuse_yarn,
)
from eagle_worker.speculative.heads import DraftHead, HeadConfig, TargetVocab, build_head

logger = logging.getLogger(__name__)

_PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


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
    # t2d is never read (vLLM and SGLang skip it too); d2t and the table only with the full vocabulary
    missing = [n for n in want if n not in sd and not (n == "t2d" or n in _OPTIONAL and cfg.draft_vocab_size == cfg.vocab_size)]
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


def warn_if_unfinished(path: Path) -> None:
    """`train-head` exports its checkpoints while it trains; a head whose training record says it
    did not finish (an interrupted run) still loads, with a warning."""
    try:
        record = json.loads((path / "training_record.json").read_text())
    except (OSError, ValueError):
        return
    if isinstance(record, dict) and record.get("complete") is False:
        logger.warning("draft head %s is a checkpoint of an unfinished training run (step %s of %s; "
                       "training_record.json says complete: false)", path, record.get("steps"),
                       (record.get("train_config") or {}).get("steps", "?"))


def load_draft_head(path: str | Path, target_model: nn.Module, target_hf_config,
                    vocab: TargetVocab | None = None, dtype: torch.dtype | None = None) -> DraftHead:
    """Build the head for `target_model` from an EAGLE-1/2 or EAGLE-3 checkpoint folder, on the
    target's device, in `dtype` (None: the target's; see `head_dtype`). Raises ValueError (naming
    tensors and shapes) if it does not fit. The head is never sharded: under tensor parallelism it
    runs on rank 0 alone, borrowing the target's vocabulary through `vocab` (full copies of the
    sharded tables)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"draft head {path}: no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except (ValueError, OSError) as e:     # bad JSON, not UTF-8, unreadable
        raise ValueError(f"draft head {cfg_file}: not a readable JSON file ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"draft head {cfg_file}: expected a JSON object, got {type(raw).__name__}")
    warn_if_unfinished(path)
    sd = normalise_names(read_state_dict(path))
    if raw.get("speculators_model_type") is not None:
        raw, sd = from_speculators(raw, sd, path)
        if detect_kind(raw, sd) == "eagle":
            sd = drop_target_lm_head(sd, target_model, vocab, path)
    refuse_multilayer(raw, sd, f"draft head {path}")
    refuse_yarn(raw, path)
    if raw.get("norm_output"):
        raise ValueError(f"draft head {path}: norm_output (vLLM's EAGLE-3 option: the head's normed output is "
                         "its next step's input) is not supported: our heads feed back the output before the norm")
    if detect_kind(raw, sd) == "eagle3":
        sd = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in sd.items()}
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"draft head {path}: hidden_act {raw['hidden_act']!r} is not supported (silu only)")
    cfg = head_config(raw, sd, target_model, target_hf_config, vocab)
    desc = (f"{type(target_model).__name__}, hidden_size={cfg.hidden_size}, vocab_size={cfg.vocab_size}, "
            f"num_layers={target_model.num_layers}")
    _check(cfg, sd, path, desc)
    broken = [k for k, v in sd.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if broken:     # it would load, draft nothing the target accepts, and cost every step
        raise ValueError(f"draft head {path}: NaN or infinite values in {', '.join(sorted(broken)[:5])}")
    head = build_head_like_target(cfg, target_model, vocab, dtype)
    _load_into(head, sd)
    gemm_paths.tune_module(head)
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
