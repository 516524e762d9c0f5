"""KubeRay manifests (RayService, RayCluster, RayJob, PodDisruptionBudget, Service) from the serve config.

Why a renderer instead of hand-written YAML: the RayService's Serve app, its GPU worker group and the
batch RayJob must agree on model, TP size, GPUs per node and replica bounds. They are all derived
here from one file whose `serve:` section is the `ServeConfig` that `eaglectl serve` reads and whose
`kubernetes:` section (`KubeConfig`) holds what only a cluster needs (image, GPU type, pod sizes,
volumes, secrets); those configs are deploy/deploy_config.py. A plain ServeConfig file works too (all-default `kubernetes:`).
`eaglectl deploy render --config serve.yaml [--job job.yaml] --out DIR` (eaglectl/deploy.py) writes
one manifest a file. No click here: the command line is eaglectl's.
"""
from __future__ import annotations

import copy
import math
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from cluster.config_base import ConfigError
from cluster.cpu_threads import SERVE_STREAMING_ENV
from deploy.deploy_config import (
    DASHBOARD_AGENT_PORT,
    GPU_PRODUCT_LABEL,
    HEAD_PORTS,
    DeployConfig,
    JobData,
    PodResources,
    RayJobConfig,
    flag_values,
    quantity_value,
    weights_error,
)
from jobs.job_config import JobConfig, submit_job_args_error

IMPORT_PATH = "cluster.serve_app:app_builder"
HOME = "/home/ray"              # the image's non-root user's home (uid 1000, like rayproject/ray)
GCP_KEY_DIR = "/var/run/secrets/eagle-serve/gcp"  # where a GCP service-account key Secret is mounted
# The "restricted" Pod Security Standard, as far as our pods are concerned (tests/deploy checks every pod):
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
DataAccess = RayJobConfig | JobData   # what pods read and write through: .data_volume, .object_store


# ---- pieces of pods ------------------------------------------------------------------------------
def _labels(cfg: DeployConfig, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "eagle-serve", "app.kubernetes.io/instance": cfg.kubernetes.name,
            "app.kubernetes.io/component": component, "app.kubernetes.io/managed-by": "eaglectl"}


def _meta(cfg: DeployConfig, name: str, component: str, **extra) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if cfg.kubernetes.namespace:
        meta["namespace"] = cfg.kubernetes.namespace
    return {**meta, "labels": _labels(cfg, component), **extra}


def _resources(r: PodResources, gpus: int = 0) -> dict[str, Any]:
    q = {"cpu": r.cpu, "memory": r.memory}
    if r.ephemeral_storage:
        q["ephemeral-storage"] = r.ephemeral_storage
    if gpus:
        q["nvidia.com/gpu"] = str(gpus)
    return {"requests": dict(q), "limits": dict(q)}


def _probe(port: int, path: str, delay: int, failures: int) -> dict[str, Any]:
    # httpGet, not exec: needs no wget/curl in the image and reads the same Ray health endpoints
    return {"httpGet": {"path": path, "port": port}, "initialDelaySeconds": delay, "periodSeconds": 5,
            "timeoutSeconds": 2, "failureThreshold": failures}


def _data_key(data: DataAccess | None) -> str:
    """Where `data` is set, for messages: job.yaml's fields or the serve config's kubernetes.job_data."""
    return "job" if isinstance(data, RayJobConfig) else "kubernetes.job_data"


class _Unique(dict):
    """Name -> what sets it; a second setting of a name is refused, naming both (the API server refuses
    a pod with duplicate env names or mount paths, and one of two values would be lost)."""

    def __init__(self, what: str, verb: str):
        super().__init__()
        self.what, self.verb = what, verb

    def add(self, name: str, source: str) -> None:
        if name in self:
            raise ConfigError(f"{source}: {self.what} {name} is also {self.verb} by {self[name]}: each must be used once")
        self[name] = source


def _env(cfg: DeployConfig, data: DataAccess | None, api_keys: bool) -> list[dict[str, Any]]:
    k, where = cfg.kubernetes, _data_key(data)
    fixed = [("HF_HOME", "the renderer (the cache volume)", {"value": f"{HOME}/.cache/huggingface"}),
             ("EAGLE_CACHE_DIR", "the renderer (the cache volume)", {"value": f"{HOME}/.cache/eagle-serve/models"})]
    if k.storage.download:
        fixed.append(("EAGLE_ALLOW_DOWNLOAD", "kubernetes.storage.download", {"value": "1"}))
    if k.storage.hf_token_secret:
        fixed.append(("HF_TOKEN", "kubernetes.storage.hf_token_secret",
                      {"valueFrom": {"secretKeyRef": k.storage.hf_token_secret.model_dump()}}))
    if k.api_keys_secret and api_keys:
        fixed.append((cfg.serve.api_keys_env, "serve.api_keys_env",
                      {"valueFrom": {"secretKeyRef": k.api_keys_secret.model_dump()}}))
    plain = [(n, "kubernetes.env", v) for n, v in k.env.items()]
    store = data.object_store if data is not None else None
    if store is not None:
        plain += [(n, f"{where}.object_store.env", v) for n, v in store.env.items()]
        if store.gcp_key_secret:
            plain.append(("GOOGLE_APPLICATION_CREDENTIALS", f"{where}.object_store.gcp_key_secret",
                          f"{GCP_KEY_DIR}/key.json"))
    names = _Unique("the environment variable", "set")
    for name, source, _ in fixed + plain:
        names.add(name, source)
    # the Serve proxy too takes the streaming fast path, unless a setting above says otherwise
    values = {**SERVE_STREAMING_ENV, **{n: v for n, _, v in plain}}
    return [{"name": n, **how} for n, _, how in fixed] + [{"name": n, "value": v} for n, v in sorted(values.items())]


def _env_from(data: DataAccess | None) -> list[dict[str, Any]]:
    """The object-store credentials Secret, every key an env var (AWS_ACCESS_KEY_ID, ...)."""
    if data is None or data.object_store is None or data.object_store.credentials_secret is None:
        return []
    return [{"secretRef": {"name": data.object_store.credentials_secret}}]


def _volumes(cfg: DeployConfig, data: DataAccess | None, models: bool = True) -> tuple[list[dict], list[dict]]:
    st, where = cfg.kubernetes.storage, _data_key(data)
    vols = [{"name": "dshm", "emptyDir": {"medium": "Memory"}},  # Ray's object store lives in /dev/shm
            {"name": "cache", "emptyDir": {"sizeLimit": st.cache_size}}]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "cache", "mountPath": f"{HOME}/.cache"}]
    sources = ["the renderer (Ray's object store)", "the renderer (the cache volume, kubernetes.storage.cache_size)"]
    if st.models_claim and models:
        vols.append({"name": "models", "persistentVolumeClaim": {"claimName": st.models_claim, "readOnly": True}})
        mounts.append({"name": "models", "mountPath": st.models_path, "readOnly": True})
        sources.append("kubernetes.storage.models_path")
    if data is not None and data.data_volume is not None:
        vols.append({"name": "data", "persistentVolumeClaim": {"claimName": data.data_volume.claim}})
        mounts.append({"name": "data", "mountPath": data.data_volume.path})
        sources.append(f"{where}.data_volume.path")
    gcp = data.object_store.gcp_key_secret if data is not None and data.object_store else None
    if gcp is not None:
        vols.append({"name": "gcp-key", "secret": {"secretName": gcp.name, "items": [{"key": gcp.key, "path": "key.json"}]}})
        mounts.append({"name": "gcp-key", "mountPath": GCP_KEY_DIR, "readOnly": True})
        sources.append(f"{where}.object_store.gcp_key_secret")
    paths = _Unique("the mount path", "used")
    for mount, source in zip(mounts, sources):   # '/data/' and '/data' are one place in the container
        paths.add("/" + "/".join(p for p in mount["mountPath"].split("/") if p not in ("", ".")), source)
    return vols, mounts


def _pod(cfg: DeployConfig, container: dict, labels: dict, data: DataAccess | None, worker: bool,
         api_keys: bool = False, models: bool = True) -> dict:
    k = cfg.kubernetes
    vols, mounts = _volumes(cfg, data, models)
    container = {"name": container["name"], "image": cfg.image, "imagePullPolicy": k.image_pull_policy, **container,
                 "env": _env(cfg, data, api_keys), **({"envFrom": _env_from(data)} if _env_from(data) else {}),
                 "volumeMounts": mounts, "securityContext": copy.deepcopy(CONTAINER_SECURITY)}
    spec: dict[str, Any] = {"containers": [container], "volumes": vols, "securityContext": copy.deepcopy(POD_SECURITY)}
    if k.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": n} for n in k.image_pull_secrets]
    if worker:
        sel = dict(k.workers.node_selector)
        if k.workers.gpu_product:
            sel[GPU_PRODUCT_LABEL] = k.workers.gpu_product
        if sel:
            spec["nodeSelector"] = sel
        tolerations = [t.manifest() for t in k.workers.tolerations]
        if k.workers.gpus_per_node and not any(t.get("key") == "nvidia.com/gpu" for t in tolerations):
            # GPU node pools are usually tainted so only GPU pods land there
            tolerations.insert(0, {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
        if tolerations:
            spec["tolerations"] = tolerations
        spec["terminationGracePeriodSeconds"] = 60  # Serve drains a replica for up to 30 s
    return {"metadata": {"labels": labels}, "spec": spec}


def _cluster_spec(cfg: DeployConfig, component: str, job: RayJobConfig | None = None,
                  serving: bool = False) -> dict[str, Any]:
    """A RayCluster spec: CPU-less head (GCS, Serve controller, dashboard) + one worker group."""
    k, s = cfg.kubernetes, cfg.serve
    dashboard, agent = HEAD_PORTS["dashboard"], DASHBOARD_AGENT_PORT   # serve.port is neither (DeployConfig)
    head_ports = [*({"containerPort": p, "name": n} for n, p in HEAD_PORTS.items()), {"containerPort": s.port, "name": "serve"}]
    head = {"name": "ray-head", "ports": head_ports, "resources": _resources(k.head.resources),
            "readinessProbe": _probe(dashboard, "/api/gcs_healthz", 10, 10),
            "livenessProbe": _probe(dashboard, "/api/gcs_healthz", 30, 120)}
    worker_ready = _probe(s.port, "/-/healthz", 10, 10) if serving else _probe(agent, "/api/local_raylet_healthz", 10, 10)
    worker = {"name": "ray-worker", "resources": _resources(cfg.worker_resources, k.workers.gpus_per_node),
              "readinessProbe": worker_ready,
              "livenessProbe": _probe(agent, "/api/local_raylet_healthz", 30, 120)}
    lo, hi = cfg.node_bounds if job is None else (_job_nodes(cfg, job),) * 2
    # a batch cluster's pods read and write the job's data; the serving and interactive clusters get
    # kubernetes.job_data, for jobs run through the serving app (their driver runs on that head)
    data: DataAccess | None = job if job is not None else k.job_data
    head_labels = {**_labels(cfg, component), "eagle-serve/role": "head"}
    worker_labels = {**_labels(cfg, component), "eagle-serve/role": "worker"}
    spec: dict[str, Any] = {
        "rayVersion": k.ray_version,
        "headGroupSpec": {"rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0",
                                             "metrics-export-port": str(HEAD_PORTS["metrics"])},
                          "template": _pod(cfg, head, head_labels, data, worker=False, api_keys=job is None)},
        "workerGroupSpecs": [{"groupName": "gpu-workers" if s.device == "cuda" else "cpu-workers", "replicas": lo,
                              "minReplicas": lo, "maxReplicas": hi, "numOfHosts": 1, "rayStartParams": {},
                              "template": _pod(cfg, worker, worker_labels, data, worker=True, api_keys=job is None)}],
    }
    spec = {**auth_options(cfg), **spec}
    if job is None:  # serving and interactive clusters grow and shrink; a batch cluster is sized up front
        spec = {"enableInTreeAutoscaling": True,
                "autoscalerOptions": {"version": "v2", "upscalingMode": k.upscaling_mode,
                                      "idleTimeoutSeconds": k.idle_timeout_seconds, "imagePullPolicy": k.image_pull_policy,
                                      "resources": _resources(PodResources(cpu="500m", memory="512Mi")),
                                      "securityContext": copy.deepcopy(CONTAINER_SECURITY)},  # KubeRay's sidecar
                **spec}
    return spec


def auth_options(cfg: DeployConfig) -> dict[str, Any]:
    """Ray token auth with the shared Secret (key auth_token), on every cluster of this config, so a
    job's cluster can submit to the RayService's dashboard; nothing when none is set."""
    secret = cfg.kubernetes.ray_auth_secret
    return {"authOptions": {"mode": "token", "secretName": secret}} if secret else {}


# ---- manifests -----------------------------------------------------------------------------------
def serve_config_v2(cfg: DeployConfig) -> dict[str, Any]:
    """The Serve config: our app, args = the serve section as written, and its replica scaling
    repeated as a deployment override so `kubectl get rayservice -o yaml` shows it."""
    s = cfg.serve
    args = s.model_dump(mode="json", exclude_unset=True)
    llm = {"name": "LLMServer", **s.replica_count_options(), "max_ongoing_requests": s.llm_server_max_ongoing}
    ingress = {"name": "OpenAIIngress", "num_replicas": s.ingress.num_replicas}
    deployments = [llm] if s.colocated else [llm, ingress]   # colocated: one deployment (cluster/serve_app.py)
    return {"proxy_location": "EveryNode", "http_options": {"host": "0.0.0.0", "port": s.port},
            "applications": [{"name": s.app_name, "route_prefix": "/", "import_path": IMPORT_PATH, "args": args,
                              "deployments": deployments}]}


def _scrape_annotations(port: int) -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def _http_ports(port: int) -> list[dict[str, Any]]:
    return [{"name": "serve", "port": port, "targetPort": port, "protocol": "TCP"}]


def rayservice(cfg: DeployConfig) -> dict[str, Any]:
    k, name = cfg.kubernetes, cfg.kubernetes.name
    http = {"metadata": {"name": f"{name}-http", "labels": _labels(cfg, "serving"),
                         "annotations": _scrape_annotations(cfg.serve.port)},
            "spec": {"type": k.service_type, "ports": _http_ports(cfg.serve.port)}}
    return {"apiVersion": "ray.io/v1", "kind": "RayService", "metadata": _meta(cfg, name, "serving"),
            "spec": {"serveConfigV2": yaml.safe_dump(serve_config_v2(cfg), sort_keys=False),
                     "serveService": http, "rayClusterConfig": _cluster_spec(cfg, "serving", serving=True)}}


def pdb_min_available(cfg: DeployConfig) -> int:
    """The serving workers voluntary evictions leave: the worker group's minimum less `pdb_max_unavailable`."""
    return max(0, cfg.node_bounds[0] - cfg.kubernetes.pdb_max_unavailable)


def pdb(cfg: DeployConfig) -> dict[str, Any]:
    """Voluntary evictions (node drains, cluster-autoscaler consolidation) keep at least `min_nodes -
    pdb_max_unavailable` serving workers; above the minimum (scaled up) a drain may evict more at once.
    An integer `minAvailable`, never `maxUnavailable` or a percentage: the worker pods' owner is a
    RayCluster, which has no scale subresource, so for those Kubernetes cannot count the pods expected,
    allows no disruption at all and node drains hang (kuberay#2662). The Ray autoscaler deletes pods
    rather than evicting them: unaffected."""
    sel = {"app.kubernetes.io/instance": cfg.kubernetes.name, "app.kubernetes.io/component": "serving",
           "eagle-serve/role": "worker"}
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(cfg, f"{cfg.kubernetes.name}-workers", "serving"),
            "spec": {"minAvailable": pdb_min_available(cfg), "selector": {"matchLabels": sel}}}


def raycluster(cfg: DeployConfig) -> dict[str, Any]:
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster",
            "metadata": _meta(cfg, f"{cfg.kubernetes.name}-dev", "interactive"),
            "spec": _cluster_spec(cfg, "interactive")}


def raycluster_http(cfg: DeployConfig) -> dict[str, Any]:
    """The interactive cluster's HTTP port: an app started on it (e.g. `serve deploy`) answers here."""
    name = f"{cfg.kubernetes.name}-dev"
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(cfg, f"{name}-http", "interactive", annotations=_scrape_annotations(cfg.serve.port)),
            "spec": {"type": cfg.kubernetes.service_type, "ports": _http_ports(cfg.serve.port),
                     "selector": {"ray.io/cluster": name, "ray.io/node-type": "head"}}}


def _job_tp(cfg: DeployConfig, job: RayJobConfig) -> int:
    return job.tp_size or cfg.serve.tp_size


def _job_nodes(cfg: DeployConfig, job: RayJobConfig) -> int:
    """Worker pods for the job's engine replicas, `gpus_per_node // tp` replicas a node (1 on CPU).
    The job's workers are the serving workers' size; a job reserves at least 1 CPU a rank
    (jobs/replica_pool.py default_cpus_per_replica), so a worker must hold its ranks' CPUs: a job that
    could never place a replica is refused (the workers are not resized: their size is what the nodes fit)."""
    gpus, tp, replicas = cfg.kubernetes.workers.gpus_per_node, _job_tp(cfg, job), job.replicas or 1
    if cfg.serve.device != "cuda":
        nodes, ranks = replicas, tp
    else:
        if gpus < tp or gpus % tp:
            raise ConfigError(f"job tp_size ({tp}) must divide kubernetes.workers.gpus_per_node ({gpus})")
        nodes, ranks = math.ceil(replicas / (gpus // tp)), min(replicas, gpus // tp) * tp
    per_rank = next((v for name, v in reversed(flag_values(job.extra_args)) if name == "--cpus-per-replica"), None)
    try:
        per_rank = 1.0 if per_rank is None else float(per_rank)    # a bad value: submit-job's own check says so
    except ValueError:
        return nodes
    cpus = cfg.worker_resources.cpu
    if quantity_value(cpus) < ranks * per_rank:
        raise ConfigError(f"job tp_size ({tp}): a worker pod would run {ranks} ranks reserving {per_rank:g} CPU each "
                          f"(jobs/replica_pool.py: at least 1 unless --cpus-per-replica says otherwise), but has {cpus} "
                          "CPUs (kubernetes.workers.resources.cpu): no replica could ever be placed; lower the job's "
                          "tp_size or give the workers more CPUs")
    return nodes


def _check_job(cfg: DeployConfig, job: RayJobConfig, own_cluster: bool) -> None:
    """What `submit-job` or the engine would refuse on the cluster, refused now: a `max_tokens` the
    context cannot hold (the job config's rule, against serve.limits.max_model_len) and, for a job with
    replicas of its own, a model or draft its pods cannot load."""
    s = cfg.serve
    max_tokens = job.max_tokens if job.max_tokens is not None else JobConfig.model_fields["max_tokens"].default
    if s.limits.max_model_len is not None and max_tokens >= s.limits.max_model_len:
        given = "" if job.max_tokens is not None else ", submit-job's default"
        raise ConfigError(f"job: max_tokens ({max_tokens}{given}) must be < max_model_len ({s.limits.max_model_len}, "
                          "serve.limits.max_model_len)")
    if not own_cluster:
        return
    mounts, download = cfg.weight_mounts(job), cfg.kubernetes.storage.download
    for model, draft, inherited in ((job.model or s.model, None, job.model is None),
                                    (None, job.draft if job.draft is not None else s.draft, job.draft is None)):
        why = weights_error(model, draft, mounts, download, "job")
        if why:
            raise ConfigError(why + (" (the serve section's, which the job uses)" if inherited else ""))


def job_entrypoint(cfg: DeployConfig, job: RayJobConfig) -> str:
    """`eaglectl submit-job ...` with the serve section's model settings, run as the RayJob's driver
    on the head: it submits the batch to the dashboard next to it and, with --wait, exits with the
    batch's status, which becomes the RayJob's. Its flags are checked against submit-job's
    (`jobs.job_config.SUBMIT_JOB_FLAGS`, which tests/jobs keeps equal to the CLI's)."""
    s = cfg.serve
    _check_job(cfg, job, own_cluster=True)
    draft = job.draft if job.draft is not None else (s.draft or "none")
    argv = ["eaglectl", "submit-job", job.input, "--output", job.output, "--model", job.model or s.model,
            "--draft", draft, "--dtype", s.dtype, "--device", s.device]
    for flag, value in (("--max-tokens", job.max_tokens), ("--temperature", job.temperature),
                        ("--top-p", job.top_p), ("--seed", job.seed), ("--max-model-len", s.limits.max_model_len)):
        if value is not None:
            argv += [flag, str(value)]
    argv += ["--max-num-seqs", str(s.limits.max_num_seqs), "--replicas", str(job.replicas or 1),
             "--tp-size", str(_job_tp(cfg, job)), *job.extra_args, "--address", "http://127.0.0.1:8265", "--wait"]
    why = submit_job_args_error(argv[2:])
    if why is not None:
        raise ConfigError(f"job: eaglectl submit-job would refuse {shlex.join(argv[2:])!r}: {why}")
    return shlex.join(argv)


def rayjob(cfg: DeployConfig, job: RayJobConfig) -> dict[str, Any]:
    if job.serve_app:  # no cluster of its own: through the RayService's app
        from deploy.fleet import fleet_rayjob

        return fleet_rayjob(cfg, job)
    spec: dict[str, Any] = {"entrypoint": job_entrypoint(cfg, job), "shutdownAfterJobFinishes": True,
                            "ttlSecondsAfterFinished": job.ttl_seconds_after_finished,
                            "backoffLimit": job.backoff_limit, "submissionMode": "K8sJobMode"}
    if job.active_deadline_seconds:
        spec["activeDeadlineSeconds"] = job.active_deadline_seconds
    spec["rayClusterSpec"] = _cluster_spec(cfg, "batch", job=job)
    spec["submitterPodTemplate"] = _submitter_pod(cfg)
    return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": _meta(cfg, job.name, "batch"), "spec": spec}


def _submitter_pod(cfg: DeployConfig) -> dict[str, Any]:
    """The pod KubeRay runs `ray job submit` in (it fills in the command): KubeRay's default one,
    plus what the restricted Pod Security level asks, which the default lacks."""
    k = cfg.kubernetes
    container = {"name": "ray-job-submitter", "image": cfg.image, "imagePullPolicy": k.image_pull_policy,
                 "resources": _resources(PodResources(cpu="500m", memory="1Gi")),
                 "securityContext": copy.deepcopy(CONTAINER_SECURITY)}
    spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container],
                            "securityContext": copy.deepcopy(POD_SECURITY)}
    if k.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": n} for n in k.image_pull_secrets]
    return {"metadata": {"labels": {**_labels(cfg, "batch"), "eagle-serve/role": "submitter"}}, "spec": spec}


# Every file `render` may write: what a re-render may remove from its output folder when it no longer
# renders it (rayjob.yaml without a job), and nothing else there.
FILE_NAMES = ("rayservice.yaml", "pdb.yaml", "raycluster.yaml", "raycluster-http.yaml", "rayjob.yaml")


def render(cfg: DeployConfig, job: RayJobConfig | None = None) -> dict[str, dict[str, Any]]:
    """File name -> manifest. Apply `rayservice.yaml` + `pdb.yaml` to serve, `rayjob.yaml` for a
    batch, `raycluster*.yaml` for an interactive cluster."""
    out = {"rayservice.yaml": rayservice(cfg), "pdb.yaml": pdb(cfg), "raycluster.yaml": raycluster(cfg),
           "raycluster-http.yaml": raycluster_http(cfg)}
    if job is not None:
        out["rayjob.yaml"] = rayjob(cfg, job)
    return out


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(str, lambda d, s: d.represent_scalar(
    "tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def to_yaml(manifest: dict[str, Any], sources: str) -> str:
    head = f"# Rendered by `eaglectl deploy render` from {sources}: edit those and re-render, not this file.\n"
    return head + yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, width=1 << 16)


def render_files(config: str | Path, job: str | Path | None = None,
                 check_job_args: Callable[[list[str]], str | None] | None = None) -> dict[str, str]:
    """File name -> YAML text, from config files (what the CLI writes and the tests compare).

    `check_job_args`: the submit-job command's own check of an argument list (None when it would start,
    else why not); `eaglectl deploy render` passes `eaglectl.jobs.submit_job_refusal`, which parses the
    RayJob's entrypoint with the command itself and validates its values (`extra_args: [--top-k, "-5"]`),
    beyond the flag check every render makes (no CLI import here: the renderer is below the CLI)."""
    cfg = DeployConfig.from_yaml(config)
    job_cfg = RayJobConfig.from_yaml(job) if job else None
    sources = " + ".join(Path(p).name for p in (config, job) if p)
    try:
        manifests = render(cfg, job_cfg)
        if check_job_args is not None and "rayjob.yaml" in manifests:
            argv = shlex.split(manifests["rayjob.yaml"]["spec"]["entrypoint"])
            why = check_job_args(argv[2:])
            if why is not None:
                raise ConfigError(f"job: eaglectl submit-job would refuse {shlex.join(argv[2:])!r} (its extra_args or "
                                  f"settings): {why}")
    except ConfigError as e:   # a clash between settings: say which files hold them
        raise ConfigError(f"{' + '.join(str(p) for p in (config, job) if p)}: {e}") from None
    return {name: to_yaml(m, sources) for name, m in manifests.items()}
