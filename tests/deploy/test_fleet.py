"""One fleet (issue 24): a RayJob that runs its batch through the RayService's Serve app.

What must hold for it to work on a cluster: the job's entrypoint reaches the RayService's cluster by
a name KubeRay keeps stable across upgrades (`<rayservice>-head-svc`, its dashboard port) and names
the app the RayService deploys; the job holds no engine of its own; the RayService's pods (where the
batch's driver runs) see the job's data; both clusters share Ray's token; and the app autoscales
between the configured bounds, with KubeRay's autoscaler sizing the worker group to match.
(Every pod's Pod Security fields and the CRD schema are checked for this set-up with the others:
test_pod_security.py, test_crd_validation.py.)
"""
from __future__ import annotations

import math
import shlex
import textwrap

import pytest
import yaml

from cluster.config_base import ConfigError
from deploy.deploy_config import APP_OWNED_FLAGS, DeployConfig, RayJobConfig
from deploy.fleet import dashboard_address
from deploy.kuberay import render
from tests.deploy.examples import fresh, inputs

SETUP = "fleet-cpu"


def _files(setup: str = SETUP) -> dict[str, dict]:
    return {n: yaml.safe_load(t) for n, t in fresh(setup).items()}


def _argv(job: dict) -> list[str]:
    return shlex.split(job["spec"]["entrypoint"])


def _opt(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, (flag, argv)
    return argv[argv.index(flag) + 1]


def _serve_app(service: dict) -> dict:
    apps = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    assert len(apps) == 1
    return apps[0]


def _pods(cluster: dict) -> list[dict]:
    return [g["template"]["spec"] for g in [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]]


# ---- the committed example -------------------------------------------------------------------------
def test_job_submits_to_the_rayservices_stable_head_service():
    f = _files()
    svc, job = f["rayservice.yaml"], f["rayjob.yaml"]
    address = _opt(_argv(job), "--address")
    assert address == f"http://{svc['metadata']['name']}-head-svc:8265"       # KubeRay: <rayservice>-head-svc
    assert job["metadata"].get("namespace") == svc["metadata"].get("namespace")   # the short name resolves
    assert job["metadata"]["labels"]["eagle-serve/rayservice"] == svc["metadata"]["name"]
    # no clusterSelector: KubeRay matches only a RayCluster *name* there, and a RayService's changes on upgrades
    assert "clusterSelector" not in job["spec"]
    assert _argv(job)[-1] == "--wait"          # the RayJob's status is the batch's


def test_entrypoint_names_the_rayservices_app():
    f = _files()
    app = _serve_app(f["rayservice.yaml"])
    argv = _argv(f["rayjob.yaml"])
    assert argv[:2] == ["eaglectl", "submit-job"]
    assert _opt(argv, "--serve-app") == app["name"] == DeployConfig.from_yaml(inputs(SETUP)[0]).serve.app_name
    assert f["rayjob.yaml"]["metadata"]["annotations"]["eagle-serve/serve-app"] == app["name"]
    assert not set(argv) & (set(APP_OWNED_FLAGS) - {"--serve-app", "--address", "--wait"})   # the app's model, sizes


def test_job_cluster_is_one_small_head_without_engines():
    f = _files()
    cluster = f["rayjob.yaml"]["spec"]["rayClusterSpec"]
    assert not cluster.get("workerGroupSpecs")
    assert not cluster.get("enableInTreeAutoscaling")
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    pod = head["template"]["spec"]
    limits = pod["containers"][0]["resources"]["limits"]
    assert "nvidia.com/gpu" not in limits and float(limits["cpu"]) <= 1
    assert not {v["name"] for v in pod["volumes"]} & {"models", "data"}   # holds no model, reads no data


def test_rayservice_pods_see_the_jobs_data():
    f = _files()
    job = RayJobConfig.from_yaml(inputs(SETUP)[1])
    for pod in _pods(f["rayservice.yaml"]["spec"]["rayClusterConfig"]):
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert claims["data"] == "eagle-data"
        for path in (job.input, job.output):
            assert path.startswith(mounts["data"].rstrip("/") + "/"), (path, mounts)


def test_both_clusters_share_the_ray_token():
    f = _files()
    svc_auth = f["rayservice.yaml"]["spec"]["rayClusterConfig"]["authOptions"]
    job_auth = f["rayjob.yaml"]["spec"]["rayClusterSpec"]["authOptions"]
    assert svc_auth == job_auth == {"mode": "token", "secretName": "eagle-fleet-ray-token"}


def test_autoscaling_bounds():
    """Serve scales the app 1..4 (a job's queued rows count toward it); the worker group follows, one
    replica per CPU worker pod, and KubeRay's in-tree autoscaler adds and removes the pods."""
    f = _files()
    cfg = DeployConfig.from_yaml(inputs(SETUP)[0])
    cluster = f["rayservice.yaml"]["spec"]["rayClusterConfig"]
    llm = next(d for d in _serve_app(f["rayservice.yaml"])["deployments"] if d["name"] == "LLMServer")
    scaling = llm["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (1, 4) == (
        cfg.serve.autoscaling.min_replicas, cfg.serve.autoscaling.max_replicas)
    assert "num_replicas" not in llm
    # the jobs' queued rows count: the app's own policy, restated (Serve replaces the app's whole config)
    from cluster.autoscale import POLICY
    assert scaling["policy"] == {"policy_function": POLICY}
    assert cluster["enableInTreeAutoscaling"] is True and cluster["autoscalerOptions"]["version"] == "v2"
    (group,) = cluster["workerGroupSpecs"]
    per_node = cfg.replicas_per_node
    assert (group["minReplicas"], group["maxReplicas"]) == (1, math.ceil(4 / per_node)) == (1, 4)
    assert group["replicas"] == group["minReplicas"]


# ---- the renderer's rules ------------------------------------------------------------------------
SERVE = textwrap.dedent("""
    serve: {model: gemma-3-270m, device: cpu, app_name: chat, autoscaling: {min_replicas: 1, max_replicas: 6}}
    kubernetes:
      name: llm
      namespace: ml
      ray_auth_secret: llm-ray-token
      job_data: {data_volume: {claim: data, path: /data}, object_store: {credentials_secret: s3-creds}}
""")


def _cfg(text: str = SERVE, **kube) -> DeployConfig:
    data = yaml.safe_load(text)
    data["kubernetes"].update(kube)
    return DeployConfig.model_validate(data)


def _job(**kw) -> RayJobConfig:
    return RayJobConfig.model_validate({"name": "nightly", "serve_app": True, "input": "s3://bucket/in/",
                                        "output": "/data/out/run-1", **kw})


def test_a_job_follows_the_rayservice_it_is_rendered_with():
    m = render(_cfg(), _job(max_tokens=64, extra_args=["--keep-columns"]))
    job, svc = m["rayjob.yaml"], m["rayservice.yaml"]
    argv = _argv(job)
    assert _opt(argv, "--address") == dashboard_address(_cfg()) == "http://llm-head-svc:8265"
    assert _opt(argv, "--serve-app") == "chat" == _serve_app(svc)["name"]
    assert job["metadata"]["namespace"] == svc["metadata"]["namespace"] == "ml"
    assert _opt(argv, "--max-tokens") == "64" and "--keep-columns" in argv
    assert (argv[2], _opt(argv, "--output")) == ("s3://bucket/in/", "/data/out/run-1")
    # the bucket credentials and the volume are on the RayService's pods (and the interactive cluster's)
    for cluster in (svc["spec"]["rayClusterConfig"], m["raycluster.yaml"]["spec"]):
        for pod in _pods(cluster):
            c = pod["containers"][0]
            assert {"secretRef": {"name": "s3-creds"}} in c["envFrom"]
            assert "/data" in {v["mountPath"] for v in c["volumeMounts"]}
    assert "envFrom" not in job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    group = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert (group["minReplicas"], group["maxReplicas"]) == (1, 6)


def test_an_own_cluster_job_is_unchanged_by_job_data():
    """job_data is for jobs through the app; a job with a cluster of its own keeps its own storage."""
    m = render(_cfg(), RayJobConfig(input="/vol/in.parquet", output="/vol/out", data_volume={"claim": "v", "path": "/vol"}))
    argv = _argv(m["rayjob.yaml"])
    assert "--serve-app" not in argv and _opt(argv, "--address") == "http://127.0.0.1:8265"
    assert m["rayjob.yaml"]["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    for pod in _pods(m["rayjob.yaml"]["spec"]["rayClusterSpec"]):
        claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
        assert "v" in claims and "data" not in claims
        assert "envFrom" not in pod["containers"][0]


def test_no_auth_secret_means_no_auth_options():
    cfg = _cfg(ray_auth_secret=None)
    assert "authOptions" not in render(cfg)["rayservice.yaml"]["spec"]["rayClusterConfig"]


@pytest.mark.parametrize("field,value", [("model", "other"), ("draft", "none"), ("tp_size", 2), ("replicas", 3),
                                         ("data_volume", {"claim": "x", "path": "/data"}),
                                         ("object_store", {"credentials_secret": "s"})])
def test_a_job_through_the_app_refuses_its_own_engine_and_storage(field, value):
    with pytest.raises(ValueError, match=field):
        _job(**{field: value})


@pytest.mark.parametrize("args", [["--replicas", "2"], ["--model", "x"], ["--address", "http://x:8265"],
                                  ["--tp-size=2"], ["--serve-app", "other"], ["--no-wait"],
                                  ["--speculation", '{"adaptive": false}']])
def test_extra_args_cannot_override_what_the_app_or_renderer_sets(args):
    with pytest.raises(ValueError, match=args[0].partition("=")[0]):   # job.yaml's validation (extra_args)
        render(_cfg(), _job(extra_args=args))


def test_paths_must_lie_on_the_fleets_job_data():
    with pytest.raises(ConfigError, match="kubernetes.job_data.data_volume"):
        render(_cfg(), _job(output="/elsewhere/out"))
    no_data = _cfg(job_data=None)
    with pytest.raises(ConfigError, match="kubernetes.job_data.data_volume"):
        render(no_data, _job())
    assert render(no_data, _job(output="s3://bucket/out/"))["rayjob.yaml"]   # buckets: the pods' own identity


def test_a_job_through_the_app_needs_the_shared_token():
    with pytest.raises(ConfigError, match="ray_auth_secret"):
        render(_cfg(ray_auth_secret=None), _job())


def test_the_example_entrypoint_parses_with_the_real_cli():
    """`--serve-app` is a real submit-job option (jobs through a running app, jobs/app_pool.py)."""
    from eaglectl.jobs import submit_job

    params = submit_job.make_context("submit-job", _argv(_files()["rayjob.yaml"])[2:]).params
    assert params["serve_app"] == "eagle" and params["address"] == "http://eagle-fleet-head-svc:8265"
