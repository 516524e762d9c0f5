"""The engine's EngineConfig for a ServeConfig: what replicas (Serve's, a job's, each TP rank) build
their engine from, for whichever engine module `ServeConfig.engine` names."""
from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any

from cluster.config import ServeConfig
from eagle_worker.engine_api import load_engine_module

logger = logging.getLogger(__name__)


def engine_config(config: ServeConfig) -> Any:
    """The engine's EngineConfig for `config`: without `speculation` the engine's default for `draft`
    (default_spec); with it, its SpecConfig with the draft the engine resolved (`auto` -> the
    model's built-in head, or none)."""
    backend = load_engine_module(config.engine)
    kw = config.engine_kwargs()
    spec = kw.pop("spec", None)
    fields = _config_fields(backend.EngineConfig)
    if "enable_prefix_caching" not in fields:   # an engine without the feature
        if not kw.pop("enable_prefix_caching"):
            logger.warning("enable_prefix_caching: false ignored: engine %s has no prefix caching", config.engine)
    if "offline_slowdown" not in fields and kw.pop("offline_slowdown") is not None \
            and "offline_slowdown" in config.model_fields_set:        # asked for, not just the default
        logger.warning("offline_slowdown ignored: engine %s has no offline cap (offline rows are only "
                       "admitted and preempted by priority)", config.engine)
    ec = backend.EngineConfig(**kw)
    if isinstance(spec, dict):
        spec["draft"] = ec.draft
        if spec["draft"] is None and not spec.get("lookup"):
            logger.warning("speculation off: model %s has no draft head and speculation.lookup is false", config.model)
            ec.spec = None
            return ec
        ec.spec = backend.SpecConfig(**spec)
    return ec


def _config_fields(cls) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(inspect.signature(cls).parameters)
