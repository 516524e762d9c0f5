"""Target features for head training, computed by our own model code and kept in sharded files.

Per token position p of an example we keep: the head's first-step input feature (the three fused
aux layers for EAGLE-3, the final-norm output for EAGLE-1 -- also its regression target), the
token, the target's top-k next-token log-probs (its distribution, compact: the full 262k-way
softmax would not fit on disk), and whether predicting p+1 is trained (response tokens only).

Why prefill over fixed text works as distillation: the label at every position is the target's
own prediction, not the text's next token, so a cache-free forward over any text yields
self-distilled labels at ~3x the speed of generating. Shards are written atomically and the
manifest names the examples each covers, so a crashed extraction resumes where it stopped.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle_worker.attention import attention_context, causal_context
from eagle_worker.training.render import Example

MANIFEST = "manifest.json"


@dataclass
class FeatureSpec:
    kind: str                     # "eagle3" | "eagle"
    aux_layers: tuple[int, ...]   # () for EAGLE-1 (final-norm output)
    topk: int = 8
    label_ids: torch.Tensor | None = None   # score only these target ids (the draft vocabulary)


def fingerprint(target: str, spec: FeatureSpec, examples: list[Example]) -> str:
    ids = spec.label_ids.tolist() if spec.label_ids is not None else None
    h = hashlib.sha256(json.dumps([target, spec.kind, list(spec.aux_layers), spec.topk, ids]).encode())
    for e in examples:
        h.update(json.dumps([e.ids, e.loss_start]).encode())
    return h.hexdigest()[:16]


@torch.inference_mode()
def target_batch(model, seqs: list[list[int]], spec: FeatureSpec, lm_chunk: int = 256) -> dict[str, torch.Tensor]:
    """One cache-free forward of packed sequences -> features, top-k log-probs (all on CPU)."""
    dev = next(model.parameters()).device
    lens = [len(s) for s in seqs]
    ids = torch.tensor([t for s in seqs for t in s], device=dev)
    pos = torch.cat([torch.arange(n) for n in lens]).to(dev)
    with attention_context(causal_context(lens, dev)):
        out = model(ids, pos, aux_layers=spec.aux_layers)
    final, feats = (out[0], torch.cat(list(out[1]), -1)) if spec.aux_layers else (out, out)
    top_ids, top_lp = [], []
    rows = None
    if spec.label_ids is not None:
        rows = model.lm_head.weight[spec.label_ids.to(dev)]
    for i in range(0, final.shape[0], lm_chunk):
        logits = model.compute_logits(final[i:i + lm_chunk]) if rows is None else _restricted_logits(model, final[i:i + lm_chunk], rows)
        v, j = torch.log_softmax(logits.float(), -1).topk(spec.topk, -1)
        top_ids.append(j.int() if rows is None else spec.label_ids.to(dev)[j].int())
        top_lp.append(v)
    return {"features": feats.to(torch.bfloat16).cpu(), "tokens": ids.int().cpu(),
            "topk_ids": torch.cat(top_ids).cpu(), "topk_logp": torch.cat(top_lp).half().cpu()}


def _restricted_logits(model, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The target's logits over a subset of its vocabulary: their softmax is EAGLE-3's target
    distribution over the draft vocabulary (SpecForge restricts the same way)."""
    logits = hidden @ rows.t()
    cap = getattr(model, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def label_mask(examples: list[Example]) -> torch.Tensor:
    """Position p is trained when the token after it is a response token."""
    return torch.cat([torch.arange(len(e.ids)) >= e.loss_start - 1 for e in examples])


def _batches(examples: list[Example], start: int, batch_tokens: int):
    i = start
    while i < len(examples):
        j, n = i, 0
        while j < len(examples) and (j == i or n + len(examples[j].ids) <= batch_tokens):
            n += len(examples[j].ids)
            j += 1
        yield i, j
        i = j


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def extract(model, examples: list[Example], out_dir: str | Path, spec: FeatureSpec, target_name: str,
            batch_tokens: int = 2048, shard_tokens: int = 65536, progress: bool = True) -> dict:
    """Write shards for `examples` into `out_dir`, resuming a previous run over the same examples."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fp = fingerprint(target_name, spec, examples)
    mpath = out / MANIFEST
    manifest = json.loads(mpath.read_text()) if mpath.exists() else None
    if manifest and manifest["fingerprint"] != fp:
        raise ValueError(f"{out}: holds features of other data or settings (fingerprint {manifest['fingerprint']} "
                         f"!= {fp}); use a fresh folder")
    if not manifest:
        manifest = {"version": 1, "target": target_name, "kind": spec.kind, "aux_layers": list(spec.aux_layers),
                    "topk": spec.topk, "fingerprint": fp,
                    "label_ids": spec.label_ids.tolist() if spec.label_ids is not None else None, "num_examples": len(examples),
                    "num_tokens": sum(len(e.ids) for e in examples), "shards": [], "complete": False}
    done = manifest["shards"][-1]["examples"][1] if manifest["shards"] else 0
    bar = tqdm(total=manifest["num_tokens"], initial=sum(s["tokens"] for s in manifest["shards"]),
               desc="features", unit="tok", disable=not progress, mininterval=10)
    pending: list[dict] = []
    first = done

    def flush(end: int) -> None:
        nonlocal pending, first
        if not pending:
            return
        exs = examples[first:end]
        shard = {k: torch.cat([p[k] for p in pending]) for k in pending[0]}
        shard["label_mask"] = label_mask(exs).to(torch.uint8)
        shard["offsets"] = torch.tensor([0] + [len(e.ids) for e in exs]).cumsum(0)
        name = f"shard-{len(manifest['shards']):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in shard.items()}, str(out / (name + ".tmp")))
        os.replace(out / (name + ".tmp"), out / name)
        manifest["shards"].append({"file": name, "examples": [first, end], "tokens": int(shard["tokens"].numel())})
        _write_json(mpath, manifest)
        pending, first = [], end

    n_pending = 0
    for i, j in _batches(examples, done, batch_tokens):
        pending.append(target_batch(model, [e.ids for e in examples[i:j]], spec))
        n = sum(len(e.ids) for e in examples[i:j])
        n_pending += n
        bar.update(n)
        if n_pending >= shard_tokens:
            flush(j)
            n_pending = 0
    flush(len(examples))
    bar.close()
    manifest["complete"] = True
    _write_json(mpath, manifest)
    return manifest


@dataclass
class Seq:
    """One example's stored rows (a view into its shard)."""

    features: torch.Tensor
    tokens: torch.Tensor
    topk_ids: torch.Tensor
    topk_logp: torch.Tensor
    label_mask: torch.Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]


def load_shard(path: Path) -> list[Seq]:
    from safetensors.torch import load_file

    d = load_file(str(path))
    off = d["offsets"].tolist()
    return [Seq(*(d[k][a:b] for k in ("features", "tokens", "topk_ids", "topk_logp")), d["label_mask"][a:b].bool())
            for a, b in zip(off[:-1], off[1:])]


class FeatureStore:
    """A finished extraction folder: shard paths and totals."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.manifest = json.loads((self.folder / MANIFEST).read_text())
        if not self.manifest.get("complete"):
            raise ValueError(f"{self.folder}: feature extraction did not finish; rerun to resume it")

    @property
    def shards(self) -> list[Path]:
        return [self.folder / s["file"] for s in self.manifest["shards"]]

    @property
    def num_tokens(self) -> int:
        return sum(s["tokens"] for s in self.manifest["shards"])

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often the target predicts each token on trained positions (draft vocabulary input)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for p in self.shards:
            for s in load_shard(p):
                counts += torch.bincount(s.topk_ids[s.label_mask, 0].long(), minlength=vocab_size)
        return counts
