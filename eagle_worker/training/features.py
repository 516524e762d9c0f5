"""Target features for head training, computed by our own model code and kept in sharded files.

Per token position p of an example we keep: the head's first-step input feature (the three fused
aux layers for EAGLE-3, the final-norm output for EAGLE-1 -- also its regression target), the
token, the target's top-k next-token log-probs (its distribution, compact: the full 262k-way
softmax would not fit on disk), and whether predicting p+1 is trained (response tokens only).

Why prefill over fixed text works as distillation: the label at every position is the target's
own prediction, not the text's next token, so a cache-free forward over any text yields
self-distilled labels several times faster than generating. Shards are written atomically and the
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
from eagle_worker.training.workdir import write_json

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
        chunk = final[i:i + lm_chunk]
        logits = model.compute_logits(chunk) if rows is None else _restricted_logits(model, chunk, rows)
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


class Extractor:
    """Writes shards for `examples` into `out_dir` one at a time (`next_shard()`), resuming a
    previous run over the same examples; training can consume shards as they appear."""

    def __init__(self, model, examples: list[Example], out_dir: str | Path, spec: FeatureSpec, target_name: str,
                 batch_tokens: int = 2048, shard_tokens: int = 16384, progress: bool = True):
        self.model, self.examples, self.spec = model, examples, spec
        self.batch_tokens, self.shard_tokens = batch_tokens, shard_tokens
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        fp = fingerprint(target_name, spec, examples)
        self.mpath = self.out / MANIFEST
        m = json.loads(self.mpath.read_text()) if self.mpath.exists() else None
        if m and m["fingerprint"] != fp:
            raise ValueError(f"{self.out}: holds features of other data or settings (fingerprint {m['fingerprint']} "
                             f"!= {fp}); use a fresh folder")
        self.manifest = m or {
            "version": 1, "target": target_name, "kind": spec.kind, "aux_layers": list(spec.aux_layers),
            "topk": spec.topk, "fingerprint": fp,
            "label_ids": spec.label_ids.tolist() if spec.label_ids is not None else None,
            "num_examples": len(examples), "num_tokens": sum(len(e.ids) for e in examples),
            "shards": [], "complete": False}
        if not m:
            write_json(self.mpath, self.manifest)
        self.progress = progress
        self._bar = None

    @property
    def complete(self) -> bool:
        return self.manifest["complete"]

    def next_shard(self) -> bool:
        """Extract and publish the next shard; False once every example is done."""
        from safetensors.torch import save_file
        from tqdm import tqdm

        m = self.manifest
        first = m["shards"][-1]["examples"][1] if m["shards"] else 0
        if first >= len(self.examples):
            if not m["complete"]:
                m["complete"] = True
                write_json(self.mpath, m)
            return False
        if self._bar is None:
            self._bar = tqdm(total=m["num_tokens"], initial=sum(s["tokens"] for s in m["shards"]), desc="features",
                             unit="tok", disable=not self.progress, mininterval=10)
        pending, n, end = [], 0, first
        for i, j in _batches(self.examples, first, self.batch_tokens):
            pending.append(target_batch(self.model, [e.ids for e in self.examples[i:j]], self.spec))
            k = sum(len(e.ids) for e in self.examples[i:j])
            n += k
            end = j
            self._bar.update(k)
            if n >= self.shard_tokens:
                break
        exs = self.examples[first:end]
        shard = {k: torch.cat([p[k] for p in pending]) for k in pending[0]}
        shard["label_mask"] = label_mask(exs).to(torch.uint8)
        shard["offsets"] = torch.tensor([0] + [len(e.ids) for e in exs]).cumsum(0)
        name = f"shard-{len(m['shards']):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in shard.items()}, str(self.out / (name + ".tmp")))
        os.replace(self.out / (name + ".tmp"), self.out / name)
        m["shards"].append({"file": name, "examples": [first, end], "tokens": int(shard["tokens"].numel())})
        m["complete"] = end >= len(self.examples)
        write_json(self.mpath, m)
        if m["complete"]:
            self._bar.close()
        return True


def extract(model, examples: list[Example], out_dir: str | Path, spec: FeatureSpec, target_name: str,
            batch_tokens: int = 2048, shard_tokens: int = 16384, progress: bool = True) -> dict:
    """Extract every shard (resuming); returns the manifest."""
    ex = Extractor(model, examples, out_dir, spec, target_name, batch_tokens, shard_tokens, progress)
    while ex.next_shard():
        pass
    return ex.manifest


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
    """An extraction folder: shard paths and totals. With `require_complete=False` it may still be
    growing (training streams its first epoch from it; `refresh()` rereads the manifest)."""

    def __init__(self, folder: str | Path, require_complete: bool = True):
        self.folder = Path(folder)
        self._lengths: dict[Path, list[int]] = {}
        self.refresh()
        if require_complete and not self.complete:
            raise ValueError(f"{self.folder}: feature extraction did not finish; rerun to resume it")

    def refresh(self) -> None:
        self.manifest = json.loads((self.folder / MANIFEST).read_text())

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    @property
    def shards(self) -> list[Path]:
        return [self.folder / s["file"] for s in self.manifest["shards"]]

    @property
    def num_tokens(self) -> int:
        """Planned tokens (all examples), extracted or not."""
        return int(self.manifest["num_tokens"])

    def lengths(self, i: int) -> list[int]:
        """Example lengths of shard `i`, from its offsets alone (no features read)."""
        from safetensors import safe_open

        p = self.shards[i]
        if p not in self._lengths:
            with safe_open(str(p), "pt") as f:
                off = f.get_tensor("offsets").tolist()
            self._lengths[p] = [b - a for a, b in zip(off[:-1], off[1:])]
        return self._lengths[p]

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often the target predicts each token on trained positions (draft vocabulary input)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for p in self.shards:
            for s in load_shard(p):
                counts += torch.bincount(s.topk_ids[s.label_mask, 0].long(), minlength=vocab_size)
        return counts


class OnlineFeatures:
    """Features computed when training needs them and never stored: for targets whose features
    would not fit on disk (4 KB per token here, ~100 KB for an 8B target). Every epoch pays the
    target forward again; chunks of ~`chunk_tokens` are computed one at a time (the trainer packs
    their rows across chunks)."""

    complete = True

    def __init__(self, model, examples: list[Example], spec: FeatureSpec, batch_tokens: int = 2048,
                 chunk_tokens: int = 16384):
        self.model, self.examples, self.spec, self.batch_tokens = model, examples, spec, batch_tokens
        self.chunks = list(_batches(examples, 0, chunk_tokens))
        self.folder = None

    def refresh(self) -> None:
        pass

    @property
    def num_tokens(self) -> int:
        return sum(len(e.ids) for e in self.examples)

    def lengths(self, c: int) -> list[int]:
        i, j = self.chunks[c]
        return [len(e.ids) for e in self.examples[i:j]]

    def seqs(self, c: int) -> list[Seq]:
        i, j = self.chunks[c]
        out = []
        for a, b in _batches(self.examples, i, self.batch_tokens):
            if a >= j:
                break
            b = min(b, j)
            exs = self.examples[a:b]
            d = target_batch(self.model, [e.ids for e in exs], self.spec)
            lm = label_mask(exs)
            o = 0
            for e in exs:
                n = len(e.ids)
                out.append(Seq(d["features"][o:o + n], d["tokens"][o:o + n], d["topk_ids"][o:o + n],
                               d["topk_logp"][o:o + n], lm[o:o + n]))
                o += n
        return out
