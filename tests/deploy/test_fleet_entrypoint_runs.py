"""The fleet RayJob's entrypoint, as rendered, runs a batch through the serving app: real `ray start`
cluster (the RayService's, with its dashboard), real Serve app named as the example names it, real
`eaglectl` in a subprocess (the RayJob's client head), real Parquet on a folder standing in for the
`job_data` volume.

What stands in for Kubernetes: the cluster's dashboard URL replaces `http://<rayservice>-head-svc:8265`
(the only value changed in the rendered command), and both sides get `RAY_AUTH_MODE=token` and the
same `RAY_AUTH_TOKEN`, as KubeRay's `authOptions` with the shared `ray_auth_secret` gives every Ray
container. A client with another token is refused: why the renderer insists on the shared Secret.
"""
from __future__ import annotations

import json
import os
import secrets
import shlex
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from deploy.deploy_config import DeployConfig, RayJobConfig
from deploy.fleet import dashboard_address
from deploy.kuberay import render
from tests.deploy.examples import ROOT, inputs
from tests.ray_cluster import LocalCluster, free_ports

pytestmark = pytest.mark.slow
SETUP = "fleet-cpu"
N = 24

DEPLOY_APP = """
import sys, ray
from ray import serve
from cluster.config import ServeConfig
from cluster.serve_app import deploy_app
ray.init(address=sys.argv[1], namespace="eagle-serve", logging_level="WARNING", log_to_driver=False)
serve.start(http_options={"host": "127.0.0.1", "port": int(sys.argv[2])})
deploy_app(ServeConfig.model_validate_json(sys.argv[3]))
print("deployed")
"""


def _example(data_root: str) -> tuple[DeployConfig, RayJobConfig]:
    """The fleet example, with its job_data volume at `data_root` and the job's paths moved there."""
    serve_path, job_path = inputs(SETUP)
    doc = yaml.safe_load(serve_path.read_text())
    old_root = doc["kubernetes"]["job_data"]["data_volume"]["path"].rstrip("/")
    doc["kubernetes"]["job_data"]["data_volume"]["path"] = data_root
    cfg = DeployConfig.model_validate(doc)
    job = yaml.safe_load(job_path.read_text())
    job.update(input=job["input"].replace(old_root, data_root, 1), output=job["output"].replace(old_root, data_root, 1),
               max_tokens=8)   # the tiny model's context
    return cfg, RayJobConfig.model_validate(job)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model_dir):
    """The 'RayService': a token-auth cluster with the example's app (the tiny model in its place)."""
    data = tmp_path_factory.mktemp("job-data")
    cfg, job = _example(str(data))
    c = LocalCluster(node_cpus=(2,), dashboard=True)
    c.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), EAGLE_JOB_PYTHON=sys.executable)
    with c:
        app = cfg.serve.model_dump(mode="json", exclude_unset=True)
        app.update(model=str(tiny_model_dir("llama")), draft=None, dtype="float32",
                   resources_per_rank={"cpu": 1, "threads": 1}, autoscaling={"min_replicas": 1, "max_replicas": 1},
                   limits={"max_model_len": 128, "max_tokens": 64, "max_num_seqs": 4})
        r = subprocess.run([sys.executable, "-c", DEPLOY_APP, c.gcs, str(free_ports(1)[0]), json.dumps(app)],
                           cwd=ROOT, env=c.env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0 and "deployed" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]
        yield {"cluster": c, "cfg": cfg, "job": job, "data": data}


def _client_argv(fleet) -> list[str]:
    """The rendered RayJob entrypoint with the one Kubernetes-only value swapped: the dashboard's address."""
    rendered = render(fleet["cfg"], fleet["job"])["rayjob.yaml"]["spec"]["entrypoint"]
    argv = shlex.split(rendered)
    i = argv.index("--address")
    assert argv[i + 1] == dashboard_address(fleet["cfg"])
    argv[i + 1] = fleet["cluster"].dashboard_address
    assert argv[0] == "eaglectl"
    return [sys.executable, "-m", "eaglectl.main", *argv[1:]]


def _run_client(fleet, **env) -> subprocess.CompletedProcess:
    e = {**fleet["cluster"].env, **env}
    return subprocess.run(_client_argv(fleet), cwd=ROOT, env=e, capture_output=True, text=True, timeout=600)


def test_client_with_another_token_is_refused(fleet):
    job = fleet["job"]
    pq.write_table(pa.table({"prompt": [f"fox {i}" for i in range(N)]}), job.input)
    r = _run_client(fleet, RAY_AUTH_TOKEN=secrets.token_hex(32))
    assert r.returncode != 0, r.stdout
    assert "refused the token" in r.stdout + r.stderr, (r.stdout + r.stderr)[-2000:]
    assert not os.path.exists(os.path.join(job.output, "_manifest.json"))     # nothing was submitted


def test_rendered_entrypoint_runs_the_batch_through_the_app(fleet):
    job = fleet["job"]
    pq.write_table(pa.table({"prompt": [f"fox {i}" for i in range(N)]}), job.input)
    r = _run_client(fleet)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "submitted job" in r.stdout and fleet["cluster"].dashboard_address in r.stdout
    ids = pq.read_table(job.output, columns=["id"]).column("id").to_pylist()
    name = os.path.basename(job.input)
    assert sorted(ids) == sorted(f"{name}:{i}" for i in range(N))                # every row once
    manifest = json.loads(open(os.path.join(job.output, "_manifest.json")).read())
    app_name = fleet["cfg"].serve.app_name
    assert manifest["complete"] and manifest["config"]["serve_app"] == app_name   # through the example's app
    assert manifest["serve_app"]["name"] == app_name
