"""The documented set-ups (deploy/examples/<setup>/) and their fresh renders, shared by the tests."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml

from deploy.kuberay import render_files

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
EXAMPLES = DEPLOY / "examples"
SETUPS = sorted(p.name for p in EXAMPLES.iterdir() if (p / "serve.yaml").is_file()) if EXAMPLES.is_dir() else []
INPUTS = {"serve.yaml", "job.yaml"}


def inputs(setup: str) -> tuple[Path, Path | None]:
    job = EXAMPLES / setup / "job.yaml"
    return EXAMPLES / setup / "serve.yaml", job if job.is_file() else None


@lru_cache(maxsize=None)
def fresh(setup: str) -> dict[str, str]:
    """File name -> YAML text, rendered now from the set-up's input files."""
    return render_files(*inputs(setup))


def fresh_manifests() -> list[tuple[str, dict]]:
    return [(f"{s}/{name}", yaml.safe_load(text)) for s in SETUPS for name, text in fresh(s).items()]


def committed_manifest_files() -> list[Path]:
    """Every YAML under deploy/ that is a Kubernetes object (inputs to the renderer excluded)."""
    out = []
    for p in sorted(DEPLOY.rglob("*.y*ml")):
        if p.name in INPUTS:
            continue
        docs = [d for d in yaml.safe_load_all(p.read_text()) if d]
        if any(isinstance(d, dict) and "apiVersion" in d for d in docs):
            out.append(p)
    return out
