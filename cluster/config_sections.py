"""The sections of a ServeConfig: autoscaling, rank resources, limits, speculation, the ingress."""
from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import Field, model_validator

from cluster.config_base import StrictModel
from eagle_worker.engine_api import SPEC_LIMITS


class PlacementStrategy(str, Enum):
    PACK = "PACK"                # prefer one node, spill over when it is full
    STRICT_PACK = "STRICT_PACK"  # all ranks of a replica on one node or not scheduled at all


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
    request_timeout_s: float | None = Field(
        None, gt=0, le=86400.0, description="seconds a completion may take once the ingress parsed it, queueing included; "
        "beyond it the engine aborts it and the client gets 504 `request_timeout` (an error event in a "
        "stream); null (default, as vLLM): no limit"
    )
    step_timeout_s: float | None = Field(
        300.0, gt=0, le=86400.0, description="an engine step running longer (a hung kernel or collective) "
        "fails the replica's health check, and Serve replaces the replica; null: never"
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
