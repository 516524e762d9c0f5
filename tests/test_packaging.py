"""The wheel -- what the images install (`pip install .` in deploy/Dockerfile.*) -- carries what the CLI
reads at run time besides code: the built-in draft head(s) and the benchmark prompts (issue 25, item 6).

The wheel is built from exactly what the CPU Dockerfile COPYs (its build context), without build
isolation (no network here); then installed into a fresh venv that sees the dependencies of this
environment through a .pth line (a path line: the editable install of this repository, a .pth *file*
there, is not processed), and used from a folder outside the repository."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.deploy.test_dockerfiles import _instructions

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "deploy" / "Dockerfile.cpu"
SHIPPED = ("eagle_worker/heads", "bench/data")     # package data: every file under these


def _shipped_files() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for d in SHIPPED for p in (REPO / d).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)


def _docker_context(dest: Path) -> Path:
    """The sources the Dockerfile COPYs, at the same relative paths (its COPY targets mirror them)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "results")
    for ins, args in _instructions(DOCKERFILE):
        if ins != "COPY":
            continue
        for src in (a for a in args.split()[:-1] if not a.startswith("--")):
            (dest / src).parent.mkdir(parents=True, exist_ok=True)
            if (REPO / src).is_dir():
                shutil.copytree(REPO / src, dest / src, ignore=ignore)
            else:
                shutil.copy2(REPO / src, dest / src)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    ctx = _docker_context(tmp / "context")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                        "-w", str(tmp / "dist"), str(ctx)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = (tmp / "dist").glob("eagle_serve-*.whl")
    return whl


@pytest.mark.slow  # builds the wheel (~30 MB, the head's weights)
def test_wheel_carries_the_heads_and_the_bench_prompts(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = _shipped_files()
    assert any(f.endswith("heads/gemma-3-270m/model.safetensors") for f in shipped)
    assert any(f.endswith("spec_bench/question.jsonl") for f in shipped)
    missing = [f for f in shipped if f not in names]
    assert not missing, f"not in the wheel: {missing}"
    assert not [n for n in names if n.startswith(("tests/", "bench/results/", "data/")) or "__pycache__" in n]
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "eaglectl = eaglectl.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


CHECK = r"""
import json, sys
from pathlib import Path
site = Path(sys.argv[1]).resolve()
import bench.prompts, eagle_worker
from eagle_worker import LLM, SamplingParams
from eagle_worker.speculative.config import SpecConfig, choose_draft, resolve_draft
head = Path(resolve_draft(choose_draft("auto", "gemma-3-270m"), "gemma-3-270m")).resolve()
out = LLM(model="gemma-3-270m", spec=SpecConfig(draft="default", lookup=False, tree="chain", adaptive=False)).generate(
    ["Question: What is 12 times 12?\nAnswer:"], SamplingParams(max_tokens=16, temperature=0.0))
print(json.dumps({"package": str(Path(eagle_worker.__file__).resolve()), "head": str(head),
                  "prompts": str(bench.prompts.SPEC_BENCH.resolve()), "questions": len(bench.prompts.load_questions()),
                  "site": str(site), "tau": out[0].metrics["mean_accepted_tokens"]}))
"""


@pytest.mark.slow  # a venv, the real default model and its head
def test_a_venv_from_the_wheel_loads_the_default_head_and_finds_the_bench_prompts(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")   # dependencies, not this repo
    # --ignore-installed: the project's editable install is visible through deps.pth, and pip must
    # neither take it for this wheel nor touch it
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q",
                        "--ignore-installed", str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "RAY_ADDRESS", "VIRTUAL_ENV") and not k.startswith("EAGLE_")}
    env["PATH"] = f"{venv / 'bin'}:/usr/bin:/bin"
    r = subprocess.run([str(py), "-c", CHECK, str(site)], cwd=elsewhere, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("package", "head", "prompts"):
        assert Path(got[key]).is_relative_to(site), (key, got)   # the wheel's copy, not the repository's
    assert got["questions"] > 0 and got["tau"] > 1.0, got            # prompts read; the head drafts and is accepted

    # the console script finds its prompts (and the head): one prompt a category, one token
    res = subprocess.run([str(venv / "bin" / "eaglectl"), "bench", "spec", "--methods", "vanilla,chain", "--per-category", "1",
                          "--max-tokens", "1", "--warmup", "0", "--json", str(tmp_path / "spec.json")],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    report = (tmp_path / "spec.json").read_text()
    assert "math_reasoning" in report and "chain" in report, report[:2000]   # categories of the shipped prompts
