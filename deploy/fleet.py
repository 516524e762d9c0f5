"""A RayJob that runs its batch through the RayService's Serve app: one fleet for online and offline.

Why not a cluster of its own: the serving fleet's replicas sit idle at night, and with Serve
autoscaling on, the job's queued rows make the app grow (up to `max_replicas`; Ray's autoscaler adds
the worker pods) and shrink after. So the job's entrypoint is `eaglectl submit-job IN --serve-app APP
--address http://<rayservice>-head-svc:8265 --wait`: it submits the batch's driver to the RayService's
cluster (Ray Jobs), which sends the rows to the app at offline priority, and follows it.

How it reaches that cluster: through `<rayservice>-head-svc`, the head Service KubeRay keeps for a
RayService and points at the cluster that currently serves, across zero-downtime upgrades. Not a
`clusterSelector`: KubeRay 1.7 reads only `ray.io/cluster` from it, the *name* of an existing
RayCluster, and a RayService's cluster is named `<rayservice>-<random>`, a new one on every upgrade
(the `ray.io/originated-from-cr-name` label that names the RayService is not matched). So the RayJob
keeps a cluster of its own, one small head and no workers, to run that `eaglectl` client; it asks
for no GPU and holds no model. The batch's own driver runs on the RayService's head (Ray Jobs,
0 CPUs): that is where `kubernetes.job_data` (volume, bucket credentials) is mounted.
"""
from __future__ import annotations

import shlex
from typing import Any

from cluster.config_base import ConfigError
from deploy.deploy_config import DeployConfig, PodResources, RayJobConfig, reachable
from deploy.kuberay import _check_job, _labels, _meta, _pod, _probe, _resources, _submitter_pod, auth_options
from jobs.job_config import submit_job_args_error

DASHBOARD_PORT = 8265
CLIENT_HEAD = PodResources(cpu="1", memory="2Gi")   # the job's own head: only the eaglectl client runs there


def head_service(cfg: DeployConfig) -> str:
    """The RayService's head Service (KubeRay: `<name>-head-svc`, following the serving cluster)."""
    return f"{cfg.kubernetes.name}-head-svc"


def dashboard_address(cfg: DeployConfig) -> str:
    """The RayService's Ray Jobs API, as the job's pods (same namespace) reach it."""
    return f"http://{head_service(cfg)}:{DASHBOARD_PORT}"


def _check(cfg: DeployConfig, job: RayJobConfig) -> None:
    k = cfg.kubernetes
    try:
        reachable(job.input, job.output, k.job_data, "kubernetes.job_data.data_volume (in the serve config)",
                  "kubernetes.job_data.object_store")
    except ValueError as e:
        raise ConfigError(f"job (serve_app: true) runs on the RayService's cluster: {e}") from None
    if k.ray_auth_secret is None:
        raise ConfigError("job (serve_app: true) submits to the RayService's dashboard from a cluster of its own: set "
                          "kubernetes.ray_auth_secret in the serve config (a Secret with key auth_token) so both "
                          "clusters share Ray's token")


def fleet_entrypoint(cfg: DeployConfig, job: RayJobConfig) -> str:
    """`eaglectl submit-job IN --output OUT [sampling] --serve-app APP --address <rayservice dashboard> --wait`."""
    _check(cfg, job)
    _check_job(cfg, job, own_cluster=False)
    app = cfg.serve.app_name
    argv = ["eaglectl", "submit-job", job.input, "--output", job.output]
    for flag, value in (("--max-tokens", job.max_tokens), ("--temperature", job.temperature),
                        ("--top-p", job.top_p), ("--seed", job.seed)):
        if value is not None:
            argv += [flag, str(value)]
    argv += [*job.extra_args, "--serve-app", app, "--address", dashboard_address(cfg), "--wait"]
    why = submit_job_args_error(argv[2:])
    if why is not None:
        raise ConfigError(f"job: eaglectl submit-job would refuse {shlex.join(argv[2:])!r}: {why}")
    return shlex.join(argv)


def _client_cluster(cfg: DeployConfig) -> dict[str, Any]:
    """One small head, no workers: runs the eaglectl client that submits to and follows the RayService."""
    k = cfg.kubernetes
    head = {"name": "ray-head",
            "ports": [{"containerPort": 6379, "name": "gcs"}, {"containerPort": DASHBOARD_PORT, "name": "dashboard"},
                      {"containerPort": 10001, "name": "client"}],
            "resources": _resources(CLIENT_HEAD),
            "readinessProbe": _probe(DASHBOARD_PORT, "/api/gcs_healthz", 10, 10),
            "livenessProbe": _probe(DASHBOARD_PORT, "/api/gcs_healthz", 30, 120)}
    labels = {**_labels(cfg, "batch"), "eagle-serve/role": "head"}
    return {**auth_options(cfg), "rayVersion": k.ray_version,
            "headGroupSpec": {"rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
                              "template": _pod(cfg, head, labels, None, worker=False, models=False)}}


def fleet_rayjob(cfg: DeployConfig, job: RayJobConfig) -> dict[str, Any]:
    """The RayJob: labelled with the RayService it runs through (`kubectl get rayjob -l
    eagle-serve/rayservice=NAME`), annotated with the app; its status is the batch's (`--wait`)."""
    meta = _meta(cfg, job.name, "batch", annotations={"eagle-serve/serve-app": cfg.serve.app_name})  # any app name
    meta["labels"]["eagle-serve/rayservice"] = cfg.kubernetes.name
    spec: dict[str, Any] = {"entrypoint": fleet_entrypoint(cfg, job), "shutdownAfterJobFinishes": True,
                            "ttlSecondsAfterFinished": job.ttl_seconds_after_finished,
                            "backoffLimit": job.backoff_limit, "submissionMode": "K8sJobMode"}
    if job.active_deadline_seconds:
        spec["activeDeadlineSeconds"] = job.active_deadline_seconds
    spec["rayClusterSpec"] = _client_cluster(cfg)
    spec["submitterPodTemplate"] = _submitter_pod(cfg)
    return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": meta, "spec": spec}

