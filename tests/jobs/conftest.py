"""Fixtures for job tests: Parquet helpers, a shared local Ray for in-process jobs, CLI subprocesses,
(the multi-node cluster is `tests.ray_cluster.LocalCluster`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]


def write_parquet(path: Path, **columns) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


def read_rows(out_dir: Path) -> list[dict]:
    return pq.read_table(out_dir).to_pylist()


def read_manifest(out_dir: Path) -> dict:
    return json.loads((Path(out_dir) / "_manifest.json").read_text())


def cli_env(**extra) -> dict:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.update(extra)
    return env


def cli(*args, env=None, **kw) -> subprocess.CompletedProcess:
    """`python -m eaglectl.main ARGS` (= `eaglectl ARGS`) in a subprocess (its own embedded Ray unless --address)."""
    return subprocess.run([sys.executable, "-m", "eaglectl.main", *map(str, args)], cwd=REPO, env=env or cli_env(),
                          capture_output=True, text=True, **kw)


def cli_popen(*args, env=None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "eaglectl.main", *map(str, args)], cwd=REPO,
                            env=env or cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def local_ray():
    """One embedded Ray for the in-process jobs of a module (jobs reuse it and leave it running)."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="eagle-jobs-test",
             logging_level="WARNING")
    yield ray
    ray.shutdown()
