"""ServeConfig: everything needed to stand up the serving cluster, validated once at the edge.

The same model feeds `eaglectl serve`, the Ray Serve `app_builder` entry point (Serve config files,
KubeRay `RayService`) and the KubeRay manifest renderer, so it is light: it imports nothing from Ray,
and of the engine only its rule for `draft` settings (through the engine contract), so every reader
means the same head by `auto`. Load it from YAML with `ServeConfig.from_yaml(path)` (a plain serve file,
or a deploy file's `serve:` section); a bad file raises `ConfigError` listing every offending field
as a dotted path (`limits.max_tokens: ...`). `read_yaml` is the one YAML reader of config files.

Example YAML (every key optional)::

    model: gemma-3-270m
    served_model_name: gemma-3-270m   # name clients pass as "model"; defaults to `model`
    draft: auto                       # auto (the hybrid with the model's built-in EAGLE head, or prompt
                                      # lookup where it has none), default, a head folder, or null = plain decoding
    # speculation: {tree: dynamic, depth: 5, top_k: 8, num_draft_tokens: 16, adaptive: true, lookup: true}
    dtype: float32
    device: cpu                       # cpu | cuda
    tp_size: 1                        # ranks per replica (tensor parallel)
    kv_cache_gb: null                 # KV-cache budget per replica; null = engine default
    enable_prefix_caching: true       # reuse the KV of a shared prompt prefix (vLLM's name); with
                                      # several replicas the router also prefers a prefix's replica
    offline_slowdown: 0.25            # while online requests run, a job's rows may slow a step by at
                                      # most this fraction (null: no cap; eagle_worker/background_cap.py)
    num_replicas: 1                   # fixed count, or instead:
    # autoscaling: {min_replicas: 1, max_replicas: 4, target_ongoing_requests: 16,
    #               upscale_delay_s: 30, downscale_delay_s: 600,
    #               look_back_period_s: 30, metrics_interval_s: 10}   # Serve's defaults when omitted
    placement_strategy: PACK          # PACK | STRICT_PACK (all ranks of a replica on one node)
    resources_per_rank: {cpu: 1, gpu: 0, threads: null}   # cpu/gpu: Ray's reservation; threads: torch
                                      # threads on CPU, null = the node's cores / ranks that share it
    # ingress: {num_replicas: 1, num_cpus: 0, colocate: null}   # the HTTP front reserves no CPU by default;
                                      # colocate: in the engine's process where there is one replica
    limits: {max_model_len: 2048, max_tokens: 1024, max_num_seqs: 64,
             max_queued_requests: 64, max_router_queue: 128}
                                      # capacity = replicas x (max_num_seqs + max_queued_requests); the
                                      # ingress admits capacity + max_router_queue, then 503 + Retry-After
    api_keys: []                      # literal keys, and/or
    api_keys_env: EAGLE_API_KEYS      # env var with comma-separated keys, and/or
    api_keys_file: /etc/eagle/keys    # one key per line, '#' comments
    chat_template: null               # Jinja template overriding the model's
    host: 127.0.0.1                   # 0.0.0.0 to accept outside connections
    port: 8000
"""
from __future__ import annotations

import os
from enum import Enum
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from eagle_worker.engine_api import SPEC_LIMITS, draft_rules


class ConfigError(ValueError):
    """A config that cannot be served; the message lists each bad field and why."""


class PlacementStrategy(str, Enum):
    PACK = "PACK"                # prefer one node, spill over when it is full
    STRICT_PACK = "STRICT_PACK"  # all ranks of a replica on one node or not scheduled at all


MAX_COUNT = 2**31 - 1     # Kubernetes' int32: a count or size past it is a typo (and fails the CRDs)


class StrictModel(BaseModel):
    # Unknown keys are almost always typos in hand-written YAML: reject them; so are inf/NaN, a YAML
    # boolean (`yes`, `true`) where a number belongs, which pydantic would read as 1, and counts past int32.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _plain_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        kinds = _numeric(cls.model_fields[info.field_name].annotation)
        if isinstance(value, bool) and kinds:
            raise ValueError(f"expected a number, got {str(value).lower()}")
        if isinstance(value, int) and kinds == {int} and value > MAX_COUNT:
            raise ValueError(f"must be at most {MAX_COUNT}, got {value}")
        return value


def _numeric(annotation: Any) -> set:
    """The number types of an int or float field (optional or not), where a YAML boolean is a mistake."""
    args = get_args(annotation) or (annotation,)
    return set() if bool in args else {a for a in args if a in (int, float)}


class AutoscalingConfig(StrictModel):
    """Ray Serve autoscaling of engine replicas, driven by ongoing requests per replica."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float = Field(16.0, gt=0)
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)
    look_back_period_s: float | None = Field(None, gt=0, description="window ongoing requests are averaged "
                                             "over; None = Serve's default (30 s)")
    metrics_interval_s: float | None = Field(None, gt=0, description="how often callers report their load to "
                                             "Serve's controller; None = Serve's default (10 s; "
                                             "Serve deprecates the field for RAY_SERVE_*_AUTOSCALING_METRIC_PUSH_INTERVAL_S)")

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        if self.initial_replicas is not None and not (
            self.min_replicas <= self.initial_replicas <= self.max_replicas
        ):
            raise ValueError("initial_replicas must lie within [min_replicas, max_replicas]")
        return self

    def to_serve(self) -> dict[str, Any]:
        """The `autoscaling_config` dict Ray Serve expects."""
        out = {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
        }
        for key in ("initial_replicas", "look_back_period_s", "metrics_interval_s"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        # Serve's rule plus the offline rows jobs still have to send (cluster/autoscale.py)
        out["policy"] = {"policy_function": "cluster.autoscale:offline_backlog_policy"}
        return out


class RankResources(StrictModel):
    """Resources one tensor-parallel rank (one process) reserves; CPU may be fractional.

    `cpu` is Ray's logical reservation (how many ranks fit on a node), not the rank's thread count:
    on CPU devices a rank computes with `threads` torch threads, by default the node's cores divided
    by the deployment's engine ranks that can share it (cluster/cpu_threads.py): one replica on a
    machine uses every core."""

    cpu: float = Field(1.0, ge=0)
    gpu: int = Field(0, ge=0, le=1)
    threads: int | None = Field(None, ge=1, description="torch threads per rank on CPU; None = the node's "
                                "cores / the engine ranks that can share the node")

    def bundle(self) -> dict[str, float]:
        out = {"CPU": self.cpu}
        if self.gpu:
            out["GPU"] = float(self.gpu)
        return out


class Limits(StrictModel):
    """Admission limits: what one request may ask for and how much work a replica queues."""

    max_model_len: int | None = Field(None, ge=16, description="prompt + output tokens; None = engine default")
    max_tokens: int = Field(1024, ge=1, description="largest max_tokens a request may ask for "
                            "(default 1024, or max_model_len // 2 when only that is set)")
    max_num_seqs: int = Field(64, ge=1, description="sequences the engine batches at once")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="token budget per step; None = engine default")
    max_queued_requests: int = Field(64, ge=0, description="requests waiting inside one replica")
    max_router_queue: int = Field(
        128, ge=1, description="requests waiting in the ingress for a free replica slot (beyond every "
        "replica's max_num_seqs + max_queued_requests) before 503 with Retry-After"
    )

    max_request_body_bytes: int = Field(
        2 * 2**20, ge=1024, description="largest HTTP request body the ingress reads (413 beyond; default 2 MiB)"
    )
    request_body_timeout_s: float = Field(
        30.0, ge=1.0, le=3600.0, description="seconds a request body may take to arrive (408 beyond): a client "
        "that sends headers and stalls does not hold one of the ingress's open-request slots for longer"
    )

    @model_validator(mode="before")
    @classmethod
    def _default_max_tokens(cls, data: Any) -> Any:
        """Only max_model_len given: max_tokens defaults to what fits next to a prompt."""
        if isinstance(data, dict) and data.get("max_model_len") and data.get("max_tokens") is None:
            try:
                data = {**data, "max_tokens": max(1, min(1024, int(data["max_model_len"]) // 2))}
            except (TypeError, ValueError):
                pass  # the field validator reports the bad max_model_len
        return data

    @model_validator(mode="after")
    def _tokens_fit(self) -> "Limits":
        if self.max_model_len is not None and self.max_tokens >= self.max_model_len:
            raise ValueError(
                f"max_tokens ({self.max_tokens}) must be < max_model_len ({self.max_model_len}) "
                "to leave room for a prompt"
            )
        return self


class SpeculationConfig(StrictModel):
    """EAGLE settings beyond `draft` (the engine's SpecConfig); omit for the engine's defaults."""

    tree: Literal["dynamic", "static", "chain"] = "dynamic"
    depth: int = Field(5, ge=1, le=SPEC_LIMITS["depth"], description="draft levels")
    top_k: int = Field(8, ge=1, le=SPEC_LIMITS["top_k"], description="dynamic tree: nodes expanded per level")
    num_draft_tokens: int = Field(16, ge=1, le=SPEC_LIMITS["num_draft_tokens"], description="tree nodes verified per step")
    adaptive: bool = Field(True, description="size the tree per step from batch size and measured speed")
    lookup: bool = Field(True, description="also propose prompt-lookup continuations (false: the head alone)")
    head_dtype: Literal["target", "auto", "float32", "bfloat16", "float16"] = Field(
        "target", description="the head's dtype: the target's, or auto = bfloat16 under a float32 target where the "
        "device has bf16 arithmetic (the target verifies every token: the output does not change)")


class IngressConfig(StrictModel):
    """The HTTP front (FastAPI) deployment. It reserves no CPU by default (as Serve's own proxy):
    a fractional reservation made it unschedulable whenever the replicas reserved every CPU."""

    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.0, ge=0)
    max_ongoing_requests: int = Field(1024, ge=1, description="open HTTP requests per ingress replica")
    stream_interval: int = Field(1, ge=1, le=1024, description="streamed responses: the first token at once, then "
                                 "a chunk per this many tokens at most, and the last (vLLM's --stream-interval)")
    direct: bool = Field(False, description="Ray Serve's direct ingress (experimental in Ray 2.60): the ingress "
                         "replica serves HTTP on `port` itself, without Serve's proxy, one hop fewer per streamed "
                         "chunk; only where `eaglectl serve` starts Ray, with one ingress replica")
    colocate: bool | None = Field(None, description="the ingress and the engine in one process (one deployment, "
                                  "`LLMServer`): no Ray message per streamed chunk. None (default): where the app "
                                  "has one engine replica, no autoscaling, one ingress replica reserving no CPU")


class ServeConfig(StrictModel):
    """The whole serving cluster: model, parallelism, scaling, placement, limits and auth."""

    model: str = Field("gemma-3-270m", min_length=1)
    served_model_name: str | None = Field(None, min_length=1)
    draft: str | None = Field("auto", description='"auto" (the hybrid with the built-in head, or prompt lookup '
                              'where the model has none), a head folder, "default", or None/"none" (no speculation)')
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    device: Literal["cpu", "cuda"] = "cpu"
    engine: str = Field("eagle_worker", description="module exposing LLMEngine/EngineConfig/SamplingParams")
    tp_size: int = Field(1, ge=1, le=64)
    kv_cache_gb: float | None = Field(None, gt=0, description="KV-cache budget per replica; None = engine default")
    offline_slowdown: float | None = Field(
        0.25, ge=0, le=1000, allow_inf_nan=False,
        description="while online requests run, offline (job) rows may make an engine step at most this much slower "
        "(a fraction of the online part's modelled time); None = no cap")
    enable_prefix_caching: bool = Field(True, description="automatic prefix caching in the engine (vLLM's name) "
                                        "and prefix-aware routing across replicas")
    speculation: SpeculationConfig | None = Field(None, description="omit for the engine's default (the hybrid, or "
                                                  "prompt lookup where the model has no head)")
    num_replicas: int | None = Field(None, ge=1)
    autoscaling: AutoscalingConfig | None = None
    placement_strategy: PlacementStrategy = PlacementStrategy.PACK
    resources_per_rank: RankResources = RankResources()
    limits: Limits = Limits()
    ingress: IngressConfig = IngressConfig()
    api_keys: list[str] = Field(default_factory=list)
    api_keys_env: str | None = None
    api_keys_file: str | None = None
    chat_template: str | None = None
    app_name: str = Field("eagle", min_length=1, pattern=r"^\S(.*\S)?$",
                          description="the Serve application's name (no leading or trailing blanks)")
    host: str = Field("127.0.0.1", min_length=1)
    port: int = Field(8000, ge=1, le=65535)

    @model_validator(mode="after")
    def _consistent(self) -> "ServeConfig":
        if self.num_replicas is not None and self.autoscaling is not None:
            raise ValueError("set either num_replicas or autoscaling, not both")
        if self.device == "cuda" and self.resources_per_rank.gpu != 1:
            raise ValueError("device: cuda needs resources_per_rank.gpu: 1 (one GPU per rank)")
        if self.device == "cpu" and self.resources_per_rank.gpu:
            raise ValueError("device: cpu must not reserve GPUs (resources_per_rank.gpu: 0)")
        if self.speculation is not None and self.draft is None and not self.speculation.lookup:
            raise ValueError("speculation needs a draft head (draft: auto, default or a folder) or speculation.lookup: true")
        try:
            choose, resolve = draft_rules(self.engine)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"engine: {self.engine!r} is not an engine module (LLMEngine, EngineConfig, "
                             f"SamplingParams): {e}") from None
        if choose(self.draft, self.model) == "default":   # a folder may live only where replicas run
            try:
                resolve("default", self.model)
            except ValueError as e:
                raise ValueError(f"draft: {e}") from None
        if self.ingress.direct and self.ingress.num_replicas != 1:
            raise ValueError("ingress.direct: one ingress replica serves the port (ingress.num_replicas must be 1)")
        if any(not k.strip() for k in self.api_keys):
            raise ValueError("api_keys must not contain empty keys")
        if self.ingress.colocate and not self._colocatable():
            raise ValueError("ingress.colocate: the ingress shares a process with the engine only where the app has "
                             "one engine replica (num_replicas: 1, no autoscaling), one ingress replica "
                             "(ingress.num_replicas: 1) and the ingress reserves no CPU of its own (ingress.num_cpus: 0)")
        return self

    def _colocatable(self) -> bool:
        return (self.autoscaling is None and (self.num_replicas or 1) == 1 and self.ingress.num_replicas == 1
                and self.ingress.num_cpus == 0)

    @property
    def colocated(self) -> bool:
        """One deployment serves HTTP and runs the engine (`ingress.colocate`, or where it may)."""
        return self._colocatable() if self.ingress.colocate is None else self.ingress.colocate

    # ---- derived values --------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        """The name clients must send as `model`."""
        return self.served_model_name or self.model

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys or self.api_keys_env or self.api_keys_file)

    @property
    def max_ongoing_per_replica(self) -> int:
        """Serve's per-replica cap: what the engine runs plus what it may queue."""
        return self.limits.max_num_seqs + self.limits.max_queued_requests

    @property
    def llm_server_max_ongoing(self) -> int:
        """Serve's per-replica cap of the `LLMServer` deployment: the engine's, and where the ingress
        shares its process, at least the ingress's open HTTP requests (the ingress admits, answering
        503 beyond `admission_limit`)."""
        if self.colocated:
            return max(self.max_ongoing_per_replica, self.ingress.max_ongoing_requests)
        return self.max_ongoing_per_replica

    @property
    def max_engine_replicas(self) -> int:
        """Engine replicas at most: `num_replicas`, or `autoscaling.max_replicas`."""
        return self.autoscaling.max_replicas if self.autoscaling is not None else (self.num_replicas or 1)

    @property
    def capacity(self) -> int:
        """Requests the engine replicas take at once: replicas x (max_num_seqs + max_queued_requests)."""
        return self.max_engine_replicas * self.max_ongoing_per_replica

    @property
    def admission_limit(self) -> int:
        """Requests one ingress replica admits at once: the capacity plus `limits.max_router_queue`
        waiting for a slot; beyond it the ingress answers 503 with Retry-After at once."""
        return self.capacity + self.limits.max_router_queue

    @property
    def resolved_draft(self) -> str | None:
        """What `draft` means for this model, by the engine's one rule (`auto`: the model's built-in
        head if it ships one, else none), on every tensor-parallel size."""
        choose, _ = draft_rules(self.engine)
        return choose(self.draft, self.model)

    def check_draft_here(self) -> None:
        """ConfigError when the head `draft` names is not on this machine. For commands whose
        replicas run here (a local `eaglectl serve`); elsewhere the replica's engine checks it."""
        _, resolve = draft_rules(self.engine)
        try:
            resolve(self.resolved_draft, self.model)
        except ValueError as e:
            raise ConfigError(f"invalid serve config: draft: {e}") from None

    def replica_count_options(self) -> dict[str, Any]:
        """`num_replicas` or `autoscaling_config` for the engine deployment."""
        if self.autoscaling is not None:
            return {"autoscaling_config": self.autoscaling.to_serve()}
        return {"num_replicas": self.num_replicas or 1}

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the engine's `EngineConfig`."""
        kw: dict[str, Any] = dict(
            model=self.model, dtype=self.dtype, device=self.device, draft=self.draft,   # the engine's default_spec
            tp_size=self.tp_size, max_num_seqs=self.limits.max_num_seqs,
            enable_prefix_caching=self.enable_prefix_caching, offline_slowdown=self.offline_slowdown,
        )
        if self.limits.max_model_len is not None:
            kw["max_model_len"] = self.limits.max_model_len
        if self.kv_cache_gb is not None:
            kw["kv_cache_gb"] = self.kv_cache_gb
        if self.chat_template is not None:
            kw["chat_template"] = self.chat_template
        if self.limits.max_num_batched_tokens is not None:
            kw["max_num_batched_tokens"] = self.limits.max_num_batched_tokens
        if self.speculation is not None:  # a plain dict: the replica turns it into the engine's SpecConfig
            kw["spec"] = {"draft": self.resolved_draft, **self.speculation.model_dump()}
        return kw

    def resolve_api_keys(self) -> frozenset[str]:
        """All accepted keys. Read where the server runs (env/secret files live there), and
        fail loudly when a named source is missing: serving open by accident is worse than not
        starting."""
        keys = {k.strip() for k in self.api_keys}
        if self.api_keys_env:
            raw = os.environ.get(self.api_keys_env)
            if raw is None:
                raise ConfigError(f"api_keys_env: environment variable {self.api_keys_env!r} is not set")
            keys |= {k.strip() for k in raw.split(",") if k.strip()}
        if self.api_keys_file:
            path = Path(self.api_keys_file)
            if not path.is_file():
                raise ConfigError(f"api_keys_file: {path} does not exist")
            for line in path.read_text().splitlines():
                line = line.split("#", 1)[0].strip()
                if line:
                    keys.add(line)
        if self.auth_enabled and not keys:
            raise ConfigError("API keys are configured but none were found: refusing to serve open")
        return frozenset(keys)

    # ---- loading ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, source: str = "config", at: str = "") -> "ServeConfig":
        """Validate a plain dict (YAML document, Serve `args`), raising ConfigError on failure;
        `at` is the section the dict came from (`serve` in a deploy file), for the error's field paths."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(format_validation_error(e, source, at=at)) from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "ServeConfig":
        """The one loader of serve config files: a plain ServeConfig file, or a deploy file
        (deploy/kuberay.py) whose `serve:` section is one (its `kubernetes:` section is the renderer's)."""
        data = read_yaml(path, empty_ok=True)
        if data.keys() & DEPLOY_SECTIONS:
            return cls.from_dict(data.get("serve"), source=str(path), at="serve")
        return cls.from_dict(data, source=str(path))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", exclude_none=True), sort_keys=False)


DEPLOY_SECTIONS = frozenset({"serve", "kubernetes"})   # the top-level keys of a deploy file


def read_yaml(path: str | os.PathLike, empty_ok: bool = False) -> dict[str, Any]:
    """The one reader of YAML config files (serve, deploy, RayJob): the top-level mapping, or
    ConfigError naming the file. An empty file is {} when `empty_ok`."""
    path = Path(path)
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if data is None and empty_ok:
        return {}
    if not isinstance(data, dict):
        got = "an empty file" if data is None else type(data).__name__
        raise ConfigError(f"{path}: expected a mapping at the top level, got {got}")
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, but a key given twice in one mapping is an error: silently keeping the last
    one hides an edit that did not take."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def format_validation_error(err: ValidationError, source: str = "config", what: str = "serve config",
                            at: str = "") -> str:
    """One line per problem, with a dotted field path: `config: limits.max_tokens: ...`; `at`
    prefixes the paths with the section the data came from."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in ((at,) if at else ()) + tuple(e["loc"])) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        lines.append(f"{loc}: {msg}")
    return f"{source}: invalid {what}:\n  " + "\n  ".join(lines)
