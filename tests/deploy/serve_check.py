"""Checks of a RayService's `serveConfigV2` that the CRD cannot make: it is an opaque string there.

Why: KubeRay hands the string to Ray Serve only after the cluster is up, so a bad key, an import
path that does not import or args the app rejects would surface minutes later as an unhealthy
RayService. Here: the string parses as YAML; it is a valid Ray Serve config with no key Ray's
schema does not declare (Ray's models ignore unknown keys, so they are checked by hand); every
`import_path` imports; our app's `args` pass `ServeConfig`; and `deployments` overrides name
deployments the app really builds, restating (not changing) their replica scaling.
"""
from __future__ import annotations

import importlib
import types
import typing
from typing import Any

import pydantic
import yaml
from ray.serve.schema import ServeDeploySchema

from cluster.config import ServeConfig
from cluster.config_base import ConfigError

OUR_IMPORT_PATH = "cluster.serve_app:app_builder"


def _model_of(annotation: Any) -> type[pydantic.BaseModel] | None:
    """The pydantic model inside `Model`, `Optional[Model]` or `List[Model]`, if any."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list, typing.List):
        for arg in typing.get_args(annotation):
            found = _model_of(arg)
            if found is not None:
                return found
    return None


def unknown_keys(data: Any, model: type[pydantic.BaseModel], where: str) -> list[str]:
    """Keys of `data` (recursively) that `model` does not declare."""
    if isinstance(data, list):
        return [e for i, item in enumerate(data) for e in unknown_keys(item, model, f"{where}[{i}]")]
    if not isinstance(data, dict):
        return []
    fields = model.model_fields
    names = set(fields) | {f.alias for f in fields.values() if f.alias}
    out = [f"{where}.{k}: unknown field for Ray Serve's {model.__name__}" for k in data if k not in names]
    for name, field in fields.items():
        sub = _model_of(field.annotation)
        if sub is not None and name in data:
            out += unknown_keys(data[name], sub, f"{where}.{name}")
    return out


def import_error(import_path: str) -> str | None:
    """Why `module:attr` (or `module.attr`) does not import, or None when it does."""
    module, sep, attr = import_path.partition(":")
    if not sep:
        module, _, attr = import_path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"
    return None if callable(obj) or hasattr(obj, "_bound_deployment") else f"{import_path} is not callable"


def built_deployments(args: dict[str, Any]) -> dict[str, Any]:
    """Deployment name -> Deployment, for the app our builder makes from `args` (no Ray needed)."""
    from cluster.serve_app import app_builder

    found: dict[str, Any] = {}

    def walk(app: Any) -> None:
        dep = getattr(app, "_bound_deployment", None)
        if dep is None:
            return
        found[dep.name] = dep
        for arg in [*dep.init_args, *dep.init_kwargs.values()]:
            walk(arg)
    walk(app_builder(args))
    return found


def _override_errors(app: dict[str, Any], where: str) -> list[str]:
    built = built_deployments(app.get("args") or {})
    out = []
    for i, dep in enumerate(app.get("deployments") or []):
        name, w = dep.get("name"), f"{where}.deployments[{i}]"
        if name not in built:
            out.append(f"{w}.name: {name!r} is not a deployment of the app (it builds {sorted(built)})")
            continue
        code = built[name]
        for key in ("num_replicas", "max_ongoing_requests"):
            if key in dep and getattr(code, key) != dep[key]:
                out.append(f"{w}.{key}: {dep[key]!r} but the app sets {getattr(code, key)!r}")
        auto = code._deployment_config.autoscaling_config
        if "autoscaling_config" in dep:
            out += _autoscaling_errors(dep["autoscaling_config"] or {}, auto, w)
    return out


def _autoscaling_errors(override: dict[str, Any], code: Any, where: str) -> list[str]:
    """The override's autoscaling_config must restate the app's: same values for what it names
    (compared as Serve parses them, so a policy given as a dict matches the app's policy object),
    and nothing the app sets left out."""
    from ray.serve.config import AutoscalingConfig

    if code is None:
        return [f"{where}.autoscaling_config: given but the app does not autoscale"]
    try:
        effective = AutoscalingConfig(**override).model_dump()
    except Exception as e:  # pydantic's ValidationError, or a policy that does not import
        return [f"{where}.autoscaling_config: Serve rejects it: {e}"]
    app = code.model_dump()
    out = [f"{where}.autoscaling_config.{k}: {override[k]!r} but the app sets {app.get(k)!r}"
           for k in override if effective.get(k) != app.get(k)]
    return out + _autoscaling_dropped(override, code, where)


def _autoscaling_dropped(override: dict[str, Any], code: Any, where: str) -> list[str]:
    """Serve *replaces* the app's autoscaling_config with a config file's (no merge): whatever the
    app's code sets that the override leaves out -- e.g. a custom autoscaling `policy` (the one that
    counts a job's queued rows) -- falls back to Serve's default on the cluster."""
    from ray.serve.config import AutoscalingConfig

    effective = AutoscalingConfig(**override).model_dump()
    return [f"{where}.autoscaling_config.{k}: the app sets {v!r} but the override leaves "
            f"{effective.get(k)!r} (Serve replaces the whole autoscaling_config)"
            for k, v in code.model_dump().items() if k not in override and effective.get(k) != v]


def serve_config_errors(manifest: dict[str, Any], check_import: bool = True) -> list[str]:
    """Every problem of a RayService's serveConfigV2 ([] when it would deploy)."""
    raw = manifest.get("spec", {}).get("serveConfigV2")
    if not isinstance(raw, str):
        return ["spec.serveConfigV2: missing (a YAML string)"]
    try:
        doc = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        return [f"spec.serveConfigV2: not YAML: {e}"]
    if not isinstance(doc, dict):
        return ["spec.serveConfigV2: not a mapping"]
    out = unknown_keys(doc, ServeDeploySchema, "serveConfigV2")
    try:
        ServeDeploySchema.model_validate(doc)
    except pydantic.ValidationError as e:
        out += [f"serveConfigV2.{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
    for i, app in enumerate(doc.get("applications") or []):
        where = f"serveConfigV2.applications[{i}]"
        path = app.get("import_path", "")
        if check_import and (err := import_error(path)):
            out.append(f"{where}.import_path: {path!r} does not import: {err}")
            continue
        if path != OUR_IMPORT_PATH:
            continue
        try:
            ServeConfig.from_dict(app.get("args"), source=f"{where}.args")
        except ConfigError as e:
            out.append(str(e))
            continue
        if check_import:
            out += _override_errors(app, where)
    return out
