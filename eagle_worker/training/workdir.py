"""What built the examples cached in a work folder (`examples_fingerprint.json`).

Why: a rerun reuses the cached examples (and the distilled responses, features and checkpoints
made from them), so a rerun with other data or example settings would silently train on the old
ones and record the new. The fingerprint covers the samples themselves (their text and source,
after --data limits, --drop-responses and the seeded --heldout split: so an edited data file counts
too) and every option that shapes an example. A mismatch is refused, not rebuilt: the features and
checkpoints in the folder belong to the old examples, and deleting a user's work is not ours to do.
Left out on purpose: --distill-batch, --distill-seconds, --device (how the examples are made, not
which), so a run resumed with a larger budget or on a GPU keeps its distilled responses.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from eagle_worker.training.data import Sample

STAMP = "examples_fingerprint.json"
# what a run caches from the examples: a folder holding any of them without a stamp predates stamps
_CACHED = ("train_examples.jsonl", "heldout_examples.jsonl", "distill_train.partial.jsonl",
           "distill_held-out.partial.jsonl")
_OPTION = {"target": "--target", "samples": "--data", "prompt_format": "--prompt-format", "max_tokens": "--max-tokens",
           "self_distill": "--self-distill", "distill_tokens": "--distill-tokens", "fixed_text": "--fixed-text",
           "drop_responses": "--drop-responses", "heldout": "--heldout", "seed": "--seed", "dtype": "--dtype"}


def _samples_hash(samples: list[Sample]) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(json.dumps([s.prompt, s.response, s.source]).encode())
    return h.hexdigest()[:16]


def examples_stamp(cfg, held: list[Sample], train: list[Sample]) -> dict:
    """The settings that decide the examples (pipeline order: held-out, then train samples)."""
    return {"target": cfg.target, "samples": _samples_hash(held) + "/" + _samples_hash(train),
            "prompt_format": cfg.prompt_format, "max_tokens": cfg.max_tokens, "self_distill": cfg.self_distill,
            "distill_tokens": cfg.distill_tokens if cfg.self_distill else None, "fixed_text": cfg.fixed_text,
            "drop_responses": cfg.drop_responses, "heldout": cfg.heldout, "seed": cfg.seed,
            "dtype": cfg.dtype if cfg.self_distill else None,    # the target's greedy text depends on it
            "data": list(cfg.data)}                              # shown, not compared: the samples are


def check_stamp(work: Path, stamp: dict, opt: str) -> None:
    """Refuse a work folder whose cached examples were built from other samples or settings."""
    path = work / STAMP
    if not path.exists():
        if any((work / f).exists() for f in _CACHED):
            raise ValueError(f"{opt} {work}: holds examples of an earlier run that did not record the data "
                             "and settings that built them; use a fresh --work-dir")
        return
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{opt} {work}: {STAMP} is not readable ({type(e).__name__}); use a fresh --work-dir") from None
    old = old if isinstance(old, dict) else {}
    differ = [k for k in _OPTION if old.get(k) != stamp[k]]
    if differ:
        if "samples" in differ and old.get("data") == stamp["data"] and {"drop_responses", "heldout", "seed"} & {*differ}:
            differ.remove("samples")     # the same files: the samples differ because of those options
        was = f" (built from --data {' '.join(map(str, old['data']))})" if isinstance(old.get("data"), list) else ""
        if differ == ["samples"] and old.get("data") == stamp["data"]:     # split_samples changed: it groups prompts
            was += " (the same files: edited since, or split into held-out and train by an earlier train-head)"
        raise ValueError(f"{opt} {work}: holds examples built from other data or settings{was}; differing: "
                         f"{', '.join(dict.fromkeys(_OPTION[k] for k in differ))}; use a fresh --work-dir")


def write_stamp(work: Path, stamp: dict) -> None:
    """Written before the first example-derived file, once (atomically)."""
    path = work / STAMP
    if path.exists():
        return
    work.mkdir(parents=True, exist_ok=True)
    write_json(path, stamp)


def write_json(path: Path, obj) -> None:
    """`obj` as JSON at `path`, whole or not at all (a temp file renamed): a kill never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    os.replace(tmp, path)
