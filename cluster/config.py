"""ServeConfig: everything needed to stand up the serving cluster, validated once at the edge.

The same model feeds `eaglectl serve`, the Ray Serve `app_builder` entry point (Serve config files,
KubeRay `RayService`) and the KubeRay manifest renderer, so it is light: it imports nothing from Ray,
and of the engine only its rule for `draft` settings (through the engine contract), so every reader
means the same head by `auto`. Load it from YAML with `ServeConfig.from_yaml(path)` (a plain serve file,
or a deploy file's `serve:` section); a bad file raises `ConfigError` listing every offending field
as a dotted path (`limits.max_tokens: ...`). Its sections are cluster/config_sections.py; `read_yaml`
(cluster/config_yaml.py) is the one YAML reader of config files.

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
                                      # step_timeout_s (300): a step running longer (hung) fails
                                      # the health check and Serve replaces the replica
    api_keys: []                      # literal keys, and/or
    api_keys_env: EAGLE_API_KEYS      # env var with comma-separated keys, and/or
    api_keys_file: /etc/eagle/keys    # one key per line, '#' comments
    chat_template: null               # Jinja template overriding the model's
    host: 127.0.0.1                   # 0.0.0.0 to accept outside connections
    port: 8000
"""
from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from cluster.config_base import ConfigError, StrictModel, format_validation_error
from cluster.config_sections import (
    AutoscalingConfig,
    IngressConfig,
    Limits,
    PlacementStrategy,
    RankResources,
    SpeculationConfig,
)
from cluster.config_yaml import read_yaml
from eagle_worker.engine_api import draft_rules, is_builtin  # noqa: F401  (is_builtin: the KubeRay renderer's)


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

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        """An IP address or a host name to bind: `http://x` or `my host` would fail only when the
        server starts."""
        try:
            ipaddress.ip_address(v)
            return v
        except ValueError:
            pass
        if len(v) > 253 or not re.fullmatch(rf"{_LABEL}(\.{_LABEL})*", v):
            raise ValueError(f"{v!r} is not an IP address or a host name (no scheme, port or spaces)")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "ServeConfig":
        if self.num_replicas is not None and self.autoscaling is not None:
            raise ValueError("set either num_replicas or autoscaling, not both")
        if self.device == "cuda" and self.resources_per_rank.gpu != 1:
            raise ValueError("device: cuda needs resources_per_rank.gpu: 1 (one GPU per rank)")
        if self.device == "cpu" and self.resources_per_rank.gpu:
            raise ValueError("device: cpu must not reserve GPUs (resources_per_rank.gpu: 0)")
        try:     # refuses what is no module name before importing it (eagle_worker/engine_api.py)
            choose, resolve = draft_rules(self.engine)
        except ImportError as e:    # whatever the import raised (draft_rules): a config error naming the field
            raise ValueError(f"engine: {self.engine!r} is not an engine module (LLMEngine, EngineConfig, "
                             f"SamplingParams): {e}") from None
        if self.speculation is not None and not self.speculation.lookup and str(self.draft).lower() == "none":
            # draft none (null or the string): nothing would draft (`auto` on a model without a head
            # decodes plainly: it asked for whatever the model has)
            raise ValueError("speculation needs a draft head (draft: auto, default or a folder) or "
                             "speculation.lookup: true")
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
                raise ConfigError(f"api_keys_file: {path} " + ("is a folder, not a file" if path.is_dir() else
                                                              "does not exist"))
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"api_keys_file: {path} cannot be read as text ({type(e).__name__})") from None
            for line in text.splitlines():
                line = line.split("#", 1)[0].strip()
                if line:
                    keys.add(line)
        if self.auth_enabled and not keys:
            raise ConfigError("API keys are configured but none were found: refusing to serve open")
        return frozenset(keys)

    # ---- loading ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, source: str = "config", at: str = "",
                  key_lines: dict | None = None) -> "ServeConfig":
        """Validate a plain dict (YAML document, Serve `args`), raising ConfigError on failure;
        `at` is the section the dict came from (`serve` in a deploy file), for the error's field paths;
        `key_lines` the file's lines by path (cluster/config_yaml.py), to name the line of each."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(format_validation_error(e, source, at=at, key_lines=key_lines)) from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "ServeConfig":
        """The one loader of serve config files: a plain ServeConfig file, or a deploy file
        (deploy/kuberay.py) whose `serve:` section is one (its `kubernetes:` section is the renderer's)."""
        data = read_yaml(path, empty_ok=True)
        if data.keys() & DEPLOY_SECTIONS:
            other = sorted(map(str, data.keys() - DEPLOY_SECTIONS))
            if other:     # a misspelt section, or serve fields beside the sections: never silently dropped
                raise ConfigError(f"{path}: a deploy file has only `serve:` and `kubernetes:` sections; "
                                  f"{', '.join(other)} belong{'s' if len(other) == 1 else ''} under one of them")
            return cls.from_dict(data.get("serve"), source=str(path), at="serve", key_lines=data.lines)
        return cls.from_dict(data, source=str(path), key_lines=data.lines)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", exclude_none=True), sort_keys=False)


_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"     # one dot-separated part of a host name
DEPLOY_SECTIONS = frozenset({"serve", "kubernetes"})   # the top-level keys of a deploy file
