"""The renderer's inputs: `DeployConfig` (a serve config's `serve:` + `kubernetes:` sections) and
`RayJobConfig` (`job.yaml`), validated with pydantic so a config that could never run on a cluster is
refused before any manifest is written (deploy/kuberay.py turns them into manifests)."""
from __future__ import annotations

import math
import posixpath
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

from cluster.config import DEPLOY_SECTIONS, ServeConfig, is_builtin
from cluster.config_base import ConfigError, StrictModel, format_validation_error
from cluster.config_sections import PlacementStrategy
from cluster.config_yaml import YamlDoc, read_yaml
from cluster.openai_requests import MAX_SEED
from jobs.job_config import OWN_REPLICA_FLAGS, SUBMIT_JOB_FLAGS, same_place

RAY_VERSION = "2.60.0"          # must equal the Ray in the image (deploy/Dockerfile.* ARG RAY_VERSION)
IMAGE_VERSION = "0.1.0"         # tag of the images the README builds
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"  # set by NVIDIA GPU feature discovery / the GPU operator
OBJECT_STORE_SCHEMES = ("s3", "gs", "gcs")       # what `eaglectl submit-job` reads and writes (pyarrow.fs)
HEAD_PORTS = {"gcs": 6379, "dashboard": 8265, "client": 10001, "metrics": 8080}  # the head pod's Ray ports
DASHBOARD_AGENT_PORT = 52365    # Ray's dashboard agent on every node (the workers' health probe)
RAY_WORKER_PORTS = (10002, 19999)   # `ray start`'s default --min-worker-port / --max-worker-port, on every node
MIN_MEMORY = "512Mi"            # less than this holds no Ray node (raylet, object store, a Python process)

Name = Annotated[str, StringConstraints(pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$", max_length=40)]  # what we create
Ref = Annotated[str, StringConstraints(pattern=r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$", max_length=253)]  # what exists
# What Kubernetes itself would refuse at apply time, refused at render time instead:
# a resource quantity (apimachinery's grammar: number, then a binary or decimal suffix or an exponent)
_QUANTITY = re.compile(r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(?:([KMGTPE]i|[numkMGTPE])|[eE]([+-]?[0-9]+))?")
_SCALE = {"": 1, "n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
          **{f"{u}i": 2.0 ** (10 * (i + 1)) for i, u in enumerate("KMGTPE")}}


def quantity_value(q: str) -> float:
    """A Kubernetes resource quantity's value ('500m' -> 0.5, '2Gi' -> 2**31, '2e3' -> 2000)."""
    m = _QUANTITY.fullmatch(q)
    if m is None:
        raise ValueError(f"{q!r} is not a Kubernetes quantity (e.g. 2, 500m, 1.5, 8Gi, 512Mi, 20G, 1k, 2e3; binary "
                         "suffixes Ki Mi Gi Ti Pi Ei, decimal n u m k M G T P E)")
    number, suffix, exponent = m.groups()
    value = float(f"{number}e{exponent}") if exponent is not None else float(number) * _SCALE[suffix or ""]
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{q!r}: a resource quantity must be a finite amount, not negative")
    return value


def _quantity(q: str) -> str:
    quantity_value(q)
    return q


def _positive(q: str) -> str:
    if quantity_value(q) <= 0:
        raise ValueError(f"{q!r}: must be more than 0")
    return q


def _memory(q: str) -> str:
    if quantity_value(q) < quantity_value(MIN_MEMORY):
        raise ValueError(f"{q!r} is less than {MIN_MEMORY}: a Ray pod needs memory for the raylet, the object store "
                         "and its Python processes (a plain number is bytes: write 8Gi, not 8)")
    return q


def _number_as_quantity(v: Any) -> Any:
    """`cpu: 2` or `cpu: 0.5`, as Kubernetes takes them: the quantity "2", "0.5"."""
    if isinstance(v, bool):
        raise ValueError(f"expected a quantity (e.g. 2, 500m), got {str(v).lower()}")
    if isinstance(v, int | float):
        if not math.isfinite(v):
            raise ValueError(f"{v!r} is not a finite amount")
        return str(v)
    return v


Quantity = Annotated[str, AfterValidator(_quantity)]
PositiveQuantity = Annotated[str, AfterValidator(_quantity), AfterValidator(_positive)]   # sizes where 0 fails
CpuQuantity = Annotated[str, BeforeValidator(_number_as_quantity), AfterValidator(_quantity), AfterValidator(_positive)]
MemoryQuantity = Annotated[str, AfterValidator(_quantity), AfterValidator(_memory)]


def _mount_path(path: str) -> str:
    if not path.startswith("/") or ".." in path.split("/") or any(c in path for c in ": \t\n"):
        raise ValueError(f"{path!r} must be an absolute path without '..', ':' or blanks (a container mountPath)")
    return path


MountPath = Annotated[str, AfterValidator(_mount_path)]
LabelKey = Annotated[str, StringConstraints(
    pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")]
LabelValue = Annotated[str, StringConstraints(pattern=r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")]
ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
EnvName = Annotated[str, StringConstraints(pattern=ENV_NAME)]
# an image reference (distribution/reference): [host[:port]/]path[:tag][@digest], path components lowercase
_HOST = r"(?:[a-zA-Z0-9](?:[-a-zA-Z0-9]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[-a-zA-Z0-9]*[a-zA-Z0-9])?)*(?::[0-9]+)?/)"
_PATH = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
_IMAGE = re.compile(rf"(?P<name>{_HOST}?{_PATH})(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}}))?"
                    r"(?P<digest>@sha256:[0-9a-f]{64})?")


def _image_pinned(image: str) -> str:
    ref = _IMAGE.fullmatch(image)
    if ref is None or len(ref["name"]) > 255:
        raise ValueError(f"{image!r} is not an image reference: [host[:port]/]path[:tag][@sha256:digest], the path "
                         "lowercase, a tag of letters, digits, '_', '.', '-' (the kubelet would refuse it)")
    if ref["digest"] is None and ref["tag"] in (None, "latest"):
        raise ValueError("pin a tag or digest (not ':latest'): pods must run the Ray of ray_version")
    return image


class SecretRef(StrictModel):
    """One key of a Kubernetes Secret, exposed to the pods as an environment variable."""
    name: Ref
    key: Annotated[str, StringConstraints(pattern=r"^[-._a-zA-Z0-9]+$", max_length=253)]  # a Secret's key


class PodResources(StrictModel):
    """Requests = limits (Ray sizes itself from the limits; GPUs must be equal anyway)."""
    cpu: CpuQuantity                          # "2", "500m", or a number (2, 0.5)
    memory: MemoryQuantity                    # at least MIN_MEMORY
    ephemeral_storage: PositiveQuantity | None = None


class HeadPodConfig(StrictModel):
    resources: PodResources = PodResources(cpu="2", memory="8Gi")


class Toleration(StrictModel):
    """A pod toleration, checked as the API server would (e.g. a spot pool's taint:
    `{key: cloud.google.com/gke-spot, value: "true", effect: NoSchedule}`)."""
    key: LabelKey | None = None               # none (with Exists): every taint
    operator: Literal["Equal", "Exists"] = "Equal"
    value: LabelValue | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None   # none: every effect
    toleration_seconds: int | None = Field(None, ge=0, le=2**63 - 1)   # Kubernetes: int64 (negative: 0)

    @model_validator(mode="after")
    def _consistent(self) -> "Toleration":
        if self.operator == "Exists" and self.value:
            raise ValueError("operator Exists takes no value")
        if self.operator == "Equal" and not self.key:
            raise ValueError("operator Equal needs a key (a toleration without a key must use Exists)")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("toleration_seconds applies to effect NoExecute only")
        return self

    def manifest(self) -> dict:
        out = {"key": self.key, "operator": self.operator, "value": self.value, "effect": self.effect,
               "tolerationSeconds": self.toleration_seconds}
        return {k: v for k, v in out.items() if v is not None}


class WorkerPodConfig(StrictModel):
    """Worker pods. Serving replicas live only here (the head advertises 0 CPUs)."""
    gpus_per_node: int = Field(0, ge=0, le=16)
    gpu_product: LabelValue | None = Field(None, description=f"node label {GPU_PRODUCT_LABEL}, e.g. NVIDIA-L4")
    resources: PodResources | None = None   # None: sized from the serve config
    min_nodes: int | None = Field(None, ge=0)  # None: from the serve replica bounds
    max_nodes: int | None = Field(None, ge=1)
    node_selector: dict[LabelKey, LabelValue] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)   # besides nvidia.com/gpu's

    @model_validator(mode="after")
    def _one_gpu_product(self) -> "WorkerPodConfig":
        chosen = self.node_selector.get(GPU_PRODUCT_LABEL)
        if self.gpu_product is not None and chosen is not None and chosen != self.gpu_product:
            raise ValueError(f"gpu_product ({self.gpu_product}) and node_selector {GPU_PRODUCT_LABEL} ({chosen}) "
                             f"pick different GPUs: gpu_product sets that label; give it once")
        return self


class StorageConfig(StrictModel):
    """Weights are mounted (a PVC holding models and EAGLE heads) or downloaded at start, never baked."""
    models_claim: Ref | None = None           # PVC mounted read-only at models_path
    models_path: MountPath = "/models"
    download: bool = False                    # fetch hub ids at start (EAGLE_ALLOW_DOWNLOAD=1)
    hf_token_secret: SecretRef | None = None  # HF_TOKEN for gated models
    cache_size: PositiveQuantity = "20Gi"     # emptyDir for the HF / built-in model caches


class DataVolume(StrictModel):
    claim: Ref                                # PVC, ReadWriteMany: the driver and every replica see it
    path: MountPath = "/data"


# Environment variables that are credentials: they belong in a Secret, never in a plain `env` (the manifests,
# and every `kubectl get -o yaml`, would hold them in plain text). Name -> the setting that sets it from a Secret.
_ENV_FROM_SECRET = ("object_store.credentials_secret (job.yaml's, or kubernetes.job_data's for the RayService's "
                    "pods: every key of that Secret becomes an environment variable)")
_SECRET_ENV = {
    "AWS_ACCESS_KEY_ID": _ENV_FROM_SECRET, "AWS_SECRET_ACCESS_KEY": _ENV_FROM_SECRET,
    "AWS_SESSION_TOKEN": _ENV_FROM_SECRET,
    "GOOGLE_APPLICATION_CREDENTIALS": "object_store.gcp_key_secret (a service-account key, mounted; it sets "
                                      "GOOGLE_APPLICATION_CREDENTIALS)",
    "HF_TOKEN": "kubernetes.storage.hf_token_secret (it sets HF_TOKEN from a Secret's key)",
    "HUGGING_FACE_HUB_TOKEN": "kubernetes.storage.hf_token_secret (it sets HF_TOKEN, which the hub reads first)",
    "RAY_AUTH_TOKEN": "kubernetes.ray_auth_secret (KubeRay sets RAY_AUTH_TOKEN from it)",
}
# ... and any name with one of these words in it (between '_', '.', '-' or the ends; any case)
_SECRET_WORDS = re.compile(r"(?:^|[_.-])(?:TOKEN|SECRET|PASSWORD|PASSWD|API[_.-]?KEYS?)(?:$|[_.-])", re.IGNORECASE)
_OTHER_SECRET = (f"a Secret: {_ENV_FROM_SECRET}; the server's own API keys: serve.api_keys_env with "
                 "kubernetes.api_keys_secret")


def no_plain_secrets(env: dict[str, str], field: str | None) -> None:
    """ValueError naming the credentials in `env` (`field`: where it is, unless the error's path says it)."""
    leaked = sorted(k for k in env if k in _SECRET_ENV or _SECRET_WORDS.search(k))
    if leaked:
        homes = "; ".join(f"{k}: {_SECRET_ENV.get(k, _OTHER_SECRET)}" for k in leaked)
        where = f"{field}: " if field else ""
        raise ValueError(f"{where}{', '.join(leaked)} would be written into the manifests in plain text (a credential): "
                         f"set {'it' if len(leaked) == 1 else 'them'} from a Secret instead. {homes}")


class ObjectStoreConfig(StrictModel):
    """Credentials and settings for s3:// and gs:// input/output, in the job cluster's Ray pods (the
    driver and the replicas), as pyarrow.fs reads them from the environment."""
    credentials_secret: Ref | None = None     # envFrom: every key of this Secret becomes an env var
    env: dict[EnvName, str] = Field(default_factory=dict)   # not secret: AWS_REGION, AWS_ENDPOINT_URL, ...
    gcp_key_secret: SecretRef | None = None   # a GCP service-account JSON key: mounted, GOOGLE_APPLICATION_CREDENTIALS

    @model_validator(mode="after")
    def _no_plain_secrets(self) -> "ObjectStoreConfig":
        return no_plain_secrets(self.env, "object_store.env") or self


def object_store_scheme(location: str) -> str | None:
    """'s3' / 'gs' for an object-store URL with a bucket, None for a path; other URLs are refused."""
    scheme, sep, rest = location.partition("://")
    if not sep:
        return None
    if scheme.lower() not in OBJECT_STORE_SCHEMES or not rest.split("/", 1)[0]:
        raise ValueError(f"{location!r}: only s3://BUCKET/... and gs://BUCKET/... URLs (or paths on data_volume)")
    return scheme.lower()


class JobData(StrictModel):
    """Where jobs run through the serving app (`serve_app: true` in job.yaml) read and write: their
    driver runs on the RayService's head, so the RayService's pods mount the volume and get the
    credentials (set once with the fleet, not per job: a change of pods is a new cluster)."""
    data_volume: DataVolume | None = None
    object_store: ObjectStoreConfig | None = None


class KubeConfig(StrictModel):
    """Deployment-only settings: the `kubernetes:` section of the config file."""
    name: Name = "eagle"
    namespace: Name | None = None
    image: Annotated[str, AfterValidator(_image_pinned)] | None = None   # None: eagle-serve:<version>-cpu|cuda
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = "IfNotPresent"
    image_pull_secrets: list[Ref] = Field(default_factory=list)
    ray_version: Annotated[str, StringConstraints(pattern=r"^\d+\.\d+\.\d+$")] = RAY_VERSION
    head: HeadPodConfig = HeadPodConfig()
    workers: WorkerPodConfig = WorkerPodConfig()
    storage: StorageConfig = StorageConfig()
    api_keys_secret: SecretRef | None = None  # fills the env var named by serve.api_keys_env
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    idle_timeout_seconds: int = Field(300, ge=0)  # autoscaler v2: idle worker -> removed
    upscaling_mode: Literal["Default", "Aggressive", "Conservative"] = "Default"
    pdb_max_unavailable: int = Field(1, ge=1)     # the PDB's minAvailable: the minimum workers less this (kuberay.pdb)
    env: dict[EnvName, str] = Field(default_factory=dict)
    # Ray token auth on every cluster rendered from this file (KubeRay authOptions): a Secret with key
    # auth_token, shared, so a job's cluster can submit to the RayService's dashboard
    ray_auth_secret: Ref | None = None
    job_data: JobData | None = None          # storage for jobs through the serving app (JobData)

    @field_validator("env")
    @classmethod
    def _no_plain_secrets(cls, env: dict[str, str]) -> dict[str, str]:
        return no_plain_secrets(env, None) or env


class DeployConfig(StrictModel):
    """A serve config plus how to run it on Kubernetes; checks that the two fit together."""
    serve: ServeConfig = ServeConfig()
    kubernetes: KubeConfig = KubeConfig()

    @model_validator(mode="after")
    def _fits(self) -> "DeployConfig":
        s, w = self.serve, self.kubernetes.workers
        if s.device == "cuda":
            if w.gpus_per_node < s.tp_size or w.gpus_per_node % s.tp_size:
                raise ValueError(f"kubernetes.workers.gpus_per_node ({w.gpus_per_node}) must be a multiple of "
                                 f"serve.tp_size ({s.tp_size}): a TP replica never spans nodes")
            if s.tp_size > 1 and s.placement_strategy != PlacementStrategy.STRICT_PACK:
                raise ValueError("serve.placement_strategy must be STRICT_PACK for tp_size > 1 on Kubernetes "
                                 "(all ranks of a replica on one node)")
        elif w.gpus_per_node or w.gpu_product:
            raise ValueError("serve.device is cpu: kubernetes.workers must not ask for GPUs")
        if s.api_keys:
            raise ValueError("serve.api_keys would be written into the RayService in plain text: "
                             "use serve.api_keys_env with kubernetes.api_keys_secret")
        if s.api_keys_file:
            raise ValueError(f"serve.api_keys_file: nothing mounts {s.api_keys_file} in the pods: use "
                             "serve.api_keys_env with kubernetes.api_keys_secret (a Secret's key in that variable)")
        if s.api_keys_env is not None and not re.fullmatch(ENV_NAME, s.api_keys_env):
            raise ValueError(f"serve.api_keys_env ({s.api_keys_env!r}) is not an environment variable name "
                             "(letters, digits, '_', '.', '-', not starting with a digit)")
        if s.ingress.direct:
            raise ValueError("serve.ingress.direct: Serve's controller must start with "
                             "RAY_SERVE_ENABLE_DIRECT_INGRESS=1, which no rendered cluster sets (only `eaglectl serve` "
                             "starting Ray does): drop it on Kubernetes")
        ray = {p: f"the head pod's {n}" for n, p in HEAD_PORTS.items()} | {DASHBOARD_AGENT_PORT: "every node's dashboard agent"}
        if s.port in ray:
            raise ValueError(f"serve.port ({s.port}) is {ray[s.port]} port: pick another HTTP port")
        lo_port, hi_port = RAY_WORKER_PORTS
        if lo_port <= s.port <= hi_port:
            raise ValueError(f"serve.port ({s.port}) is in Ray's worker port range ({lo_port}-{hi_port}), which Ray's "
                             "worker processes on every node bind: pick another HTTP port (e.g. 8000)")
        if s.port < 1024:
            raise ValueError(f"serve.port ({s.port}) is below 1024: the pods run as a non-root user with every "
                             "capability dropped, which cannot bind it: pick 1024 or above (e.g. 8000; a Service "
                             "may still expose another port)")
        if (self.kubernetes.api_keys_secret is None) != (s.api_keys_env is None):
            raise ValueError("kubernetes.api_keys_secret and serve.api_keys_env go together")
        if s.device == "cuda" and s.autoscaling and s.autoscaling.min_replicas == 0:
            raise ValueError("serve.autoscaling.min_replicas: 0 frees no GPU node on Kubernetes: the HTTP ingress "
                             "keeps one worker, so set min_replicas >= 1")
        lo, hi = self.node_bounds
        if lo > hi:
            raise ValueError(f"kubernetes.workers: min_nodes ({lo}) > max_nodes ({hi})")
        need = self.replicas_per_node * s.tp_size * s.resources_per_rank.cpu + s.ingress.num_cpus
        if quantity_value(self.worker_resources.cpu) < need:
            raise ValueError(f"kubernetes.workers.resources.cpu ({self.worker_resources.cpu}) is below the "
                             f"{need:g} CPUs one node's replicas and the ingress reserve: they would never schedule")
        why = weights_error(s.model, s.draft, self.weight_mounts(), self.kubernetes.storage.download, "serve")
        if why:
            raise ValueError(why)
        threads = getattr(s.resources_per_rank, "threads", None)
        if s.device != "cuda" and threads is not None:
            busy = self.replicas_per_node * s.tp_size * threads
            if busy > quantity_value(self.worker_resources.cpu):
                raise ValueError(f"serve.resources_per_rank.threads ({threads}) x {self.replicas_per_node * s.tp_size} "
                                 f"ranks a worker pod = {busy} torch threads, more than its "
                                 f"{self.worker_resources.cpu} CPUs: the pod's CPU limit would throttle them")
        return self

    def weight_mounts(self, data: "RayJobConfig | JobData | None | Literal[False]" = False) -> list[tuple[str, str]]:
        """(path, setting) of the volumes where pods may find weights: the models claim, and the data
        volume of `data` (a job's own cluster: the job's; False: the serving clusters', kubernetes.job_data)."""
        k = self.kubernetes
        out = [(k.storage.models_path, "kubernetes.storage.models_path")] if k.storage.models_claim else []
        if data is False:
            data, where = k.job_data, "kubernetes.job_data.data_volume.path"
        else:
            where = "job data_volume.path"
        if data is not None and data.data_volume is not None:
            out.append((data.data_volume.path, where))
        return out

    # ---- derived sizes ---------------------------------------------------------------------
    @property
    def replicas_per_node(self) -> int:
        gpus = self.kubernetes.workers.gpus_per_node
        return gpus // self.serve.tp_size if self.serve.device == "cuda" else 1

    @property
    def node_bounds(self) -> tuple[int, int]:
        """Worker pods for the serve replica bounds: one node per `replicas_per_node` replicas."""
        s, w = self.serve, self.kubernetes.workers
        lo, hi = (s.autoscaling.min_replicas, s.autoscaling.max_replicas) if s.autoscaling else (
            s.num_replicas or 1, s.num_replicas or 1)
        # at least one worker: the HTTP ingress runs on a worker (the head advertises no CPUs)
        lo_n = max(1, math.ceil(lo / self.replicas_per_node))
        hi_n = max(lo_n, math.ceil(hi / self.replicas_per_node))
        return (lo_n if w.min_nodes is None else w.min_nodes, hi_n if w.max_nodes is None else w.max_nodes)

    @property
    def worker_resources(self) -> PodResources:
        w, s = self.kubernetes.workers, self.serve
        if w.resources is not None:
            return w.resources
        if s.device == "cuda":  # a few CPUs and 24Gi of host memory per GPU (loading, tokenizing, Ray)
            return PodResources(cpu=str(4 * w.gpus_per_node), memory=f"{24 * w.gpus_per_node}Gi")
        cpus = math.ceil(s.tp_size * s.resources_per_rank.cpu + s.ingress.num_cpus)
        return PodResources(cpu=str(max(2, cpus)), memory="8Gi")

    @property
    def image(self) -> str:
        return self.kubernetes.image or f"eagle-serve:{IMAGE_VERSION}-{'cuda' if self.serve.device == 'cuda' else 'cpu'}"

    @classmethod
    def from_yaml(cls, path: str | Path) -> "DeployConfig":
        """`serve:` + `kubernetes:` sections, or a plain ServeConfig file (default `kubernetes:`). As with
        `eaglectl serve --config` (ServeConfig.from_yaml), an empty file or an empty section is the defaults."""
        data = read_yaml(path, empty_ok=True)
        if not (data.keys() & DEPLOY_SECTIONS):   # a plain serve file: its lines under `serve`
            lines = {("serve", *k): n for k, n in data.lines.items()}
            data = YamlDoc(serve=data)
            data.lines = lines
        for section in DEPLOY_SECTIONS:
            if section in data and data[section] is None:    # `serve:` with nothing under it
                data[section] = {}
        return _validate(cls, data, str(path))


def _under(path: str, root: str) -> bool:
    p, r = posixpath.normpath(path), posixpath.normpath(root)
    return p == r or p.startswith(r.rstrip("/") + "/")


def weights_error(model: str | None, draft: str | None, mounts: list[tuple[str, str]], download: bool,
                  field: str) -> str | None:
    """None when pods with volumes `mounts` ((path, setting) pairs) and hub downloads on or off can load
    `model` and `draft` (None: not checked), else why not (`field`: where they are set, `serve` or `job`). The engine's rules
    (eagle_worker/loader.py, model_runner.py, speculative/config.py): a built-in name loads from the image, a
    path must be on a mounted volume, any other model name is a hub id the pods must download (their cache
    starts empty); a draft is `auto`, `default`, `none` or a head folder (a path; no hub id)."""
    roots = ", ".join(f"{setting} ({root})" for root, setting in mounts)
    where = (f"the pods see only {roots}" if mounts else
             "no volume holds weights: set kubernetes.storage.models_claim (mounted at kubernetes.storage.models_path)")
    for what, value in (("model", model), ("draft", draft)):
        if value is None or (what == "draft" and value in ("", "none", "auto", "default")):
            continue
        if what == "model" and is_builtin(value):
            continue
        if value.startswith("/"):
            if not any(_under(value, root) for root, _ in mounts):
                return f"{field}.{what} {value!r} is not on a volume the pods mount: {where}"
        elif what == "draft":
            return (f"{field}.draft {value!r} is not a head folder the pods have: a draft is auto, default, none or "
                    f"the absolute path of a folder on a mounted volume ({where}); heads are never downloaded")
        elif value.startswith(("./", "../", "~", ".")) or value.endswith(".gguf"):
            return (f"{field}.{what} {value!r} is a path on this machine, which the pods do not have: give an "
                    f"absolute path on a mounted volume ({where})")
        elif not download:
            return (f"{field}.{what} {value!r} is a Hugging Face Hub id, but kubernetes.storage.download is off and the "
                    "pods start with an empty cache: set kubernetes.storage.download: true, or put the weights on "
                    "the models volume (kubernetes.storage.models_claim) and give their path")
    return None


# what a job through the serving app takes from the app, never from job.yaml
_APP_OWNED = ("model", "draft", "tp_size", "replicas", "data_volume", "object_store")
# submit-job flags never taken from extra_args (click would take the last one, past the render-time checks):
# those the renderer sets in any job (job.yaml's fields; where and how to submit) ...
RENDERER_FLAGS = ("--output", "-o", "--max-tokens", "--temperature", "--top-p", "--seed", "--address", "--wait", "--no-wait",
                  "--serve-app")
# ... those a job with replicas of its own takes from the serve section (deploy/kuberay.py job_entrypoint) ...
OWN_JOB_FLAGS = ("--model", "--draft", "--dtype", "--device", "--max-model-len", "--max-num-seqs", "--replicas", "--tp-size")
# ... and those a job through the serving app takes from the app (`submit-job --serve-app` refuses them)
APP_OWNED_FLAGS = (*(f for flags in OWN_REPLICA_FLAGS.values() for f in flags.split("/") if f.startswith("--")), "--job-id")


def flag_values(args: list[str]) -> list[tuple[str, str | None]]:
    """The options in a submit-job argument list with their values (None: a switch, or a value missing)."""
    found, i = [], 0
    while i < len(args) and args[i] != "--":
        a = args[i]
        i += 1
        if a.startswith("-") and a != "-":
            name, eq, value = a.partition("=") if a.startswith("--") else (a[:2], "", a[2:])
            if SUBMIT_JOB_FLAGS.get(name) and not eq and a == name:     # `--flag VALUE`
                value, i = (args[i] if i < len(args) else None), i + 1
            found.append((name, value if value or eq else None))
    return found


def reachable(input: str, output: str, data: "RayJobConfig | JobData | None", volume_key: str, store_key: str) -> None:
    """Raise ValueError unless the pods with `data` (a volume, bucket credentials) can read `input`
    and write `output`; `*_key` name the settings in the message."""
    urls = 0
    volume = data.data_volume if data is not None else None
    for field, where in (("input", input), ("output", output)):
        try:
            urls += object_store_scheme(where) is not None
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from None
        if object_store_scheme(where) is not None:
            continue
        if volume is None:
            raise ValueError(f"{field} {where!r} is a path: set {volume_key} (a ReadWriteMany PVC the job's pods "
                             "mount) or use an s3:// or gs:// URL")
        root = volume.path.rstrip("/") + "/"
        if not where.startswith(root):
            raise ValueError(f"{field} must be an s3:// or gs:// URL or a path under {volume_key}.path ({root}): "
                             "the job's pods see only that volume")
    if data is not None and data.object_store is not None and not urls:
        raise ValueError(f"{store_key} is set but input and output are paths: use s3:// or gs:// URLs, "
                         f"or drop {store_key}")


class RayJobConfig(StrictModel):
    """A batch RayJob: `eaglectl submit-job` over a Parquet (or OpenAI Batch JSONL) dataset.

    Input and output are object-store URLs (s3://, gs://: every pod reads and writes the bucket with
    the credentials of `object_store`) or paths on `data_volume`, a ReadWriteMany PVC mounted in
    every pod of the job's cluster; the two may be mixed. With `serve_app: true` the job has no
    engine replicas of its own: it runs through the RayService's Serve app (deploy/fleet.py), and
    reads and writes what the serve config's `kubernetes.job_data` gives the RayService's pods."""
    name: Name = "eagle-batch"
    input: str                                # s3://bucket/prefix/, gs://..., or a path under data_volume.path
    output: str                               # output folder: the same kinds
    data_volume: DataVolume | None = None
    object_store: ObjectStoreConfig | None = None
    model: str | None = None                  # None: serve.model / serve.draft / serve.tp_size
    draft: str | None = None
    tp_size: int | None = Field(None, ge=1)
    replicas: int | None = Field(None, ge=1)  # engine replicas of the job's own cluster (None: 1)
    # true: no cluster of its own; `submit-job --serve-app serve.app_name` on the RayService's cluster
    serve_app: bool = False
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=MAX_SEED)   # the job config's (and the engine's) range: [0, 2**63)
    extra_args: list[str] = Field(default_factory=list)  # more submit-job flags, e.g. [--keep-columns]
    ttl_seconds_after_finished: int = Field(60, ge=0)     # finished cluster kept for logs, then deleted
    active_deadline_seconds: int | None = Field(None, ge=1)
    backoff_limit: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _reachable(self) -> "RayJobConfig":
        owned = (*RENDERER_FLAGS, *(APP_OWNED_FLAGS if self.serve_app else OWN_JOB_FLAGS))
        taken = sorted({name for name, _ in flag_values(self.extra_args)} & set(owned))
        if taken:
            raise ValueError(f"extra_args: {', '.join(taken)}: the renderer sets these (from job.yaml's fields, the "
                             f"{'serving app' if self.serve_app else 'serve section'}, where to submit): drop them "
                             "from extra_args")
        if same_place(self.output, self.input):      # submit-job would refuse it on the cluster
            raise ValueError(f"output {self.output} is the input itself; the output is a folder of its own")
        if not self.serve_app:
            reachable(self.input, self.output, self, "data_volume", "object_store")
            return self
        for field in ("input", "output"):       # where they live is checked against the fleet's job_data
            try:
                object_store_scheme(getattr(self, field))
            except ValueError as e:
                raise ValueError(f"{field}: {e}") from None
        owned = [f for f in _APP_OWNED if getattr(self, f) is not None]
        if owned:
            raise ValueError(f"serve_app: the job runs on the serving app's replicas, with its model and sizes: drop "
                             f"{', '.join(owned)} (storage for such jobs is the serve config's kubernetes.job_data)")
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> "RayJobConfig":
        return _validate(cls, read_yaml(path), str(path))


def _validate(cls, data: dict, source: str):
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source, what="config", key_lines=getattr(data, "lines", None))) from None
