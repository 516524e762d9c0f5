"""Strict offline validation of Kubernetes manifests against the KubeRay v1.7.0 CRD schemas.

Why strict: the API server silently drops a field its schema does not declare (or refuses the
object under strict field validation), so a typo such as `maxReplica` or a field from another
KubeRay version would deploy "fine" and do nothing. Here every object that declares `properties`
gets `additionalProperties: false`, except under `x-kubernetes-preserve-unknown-fields: true`.
Also enforced, as the API server does: `x-kubernetes-int-or-string`, `int32`/`int64` ranges,
`x-kubernetes-list-type` (map keys / set items unique), the ObjectMeta of the top-level object,
and `x-kubernetes-validations` (CEL) rules, each of which must be known here: an unknown rule is
an error rather than a silent pass. Core kinds (Service, PodDisruptionBudget) use the strict
Kubernetes v1.33 schemas in schemas/.
"""
from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator

import jsonschema
import yaml
from jsonschema import Draft7Validator, Draft202012Validator, FormatChecker, ValidationError, validators

HERE = Path(__file__).parent
CRDS = HERE / "crds"
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml",
             "RayService": "ray.io_rayservices.yaml", "RayCronJob": "ray.io_raycronjobs.yaml"}
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_QUALIFIED = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
_LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"

# What the API server checks on every object's metadata when it is created (apimachinery ObjectMeta).
OBJECT_META = {
    "type": "object", "required": ["name"], "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "maxLength": 253, "pattern": DNS1123_SUBDOMAIN},
        "namespace": {"type": "string", "maxLength": 63, "pattern": DNS1123_LABEL},
        "labels": {"type": "object", "propertyNames": {"pattern": _QUALIFIED, "maxLength": 316},
                   "additionalProperties": {"type": "string", "maxLength": 63, "pattern": _LABEL_VALUE}},
        "annotations": {"type": "object", "propertyNames": {"pattern": _QUALIFIED},
                        "additionalProperties": {"type": "string"}},
    },
}

# CEL rules met in the v1.7.0 CRDs. Objects are validated as creates, so transition rules
# (`oldSelf`) hold trivially. A rule missing here makes validation fail (see _cel).
_MANAGED_BY = {"ray.io/kuberay-operator", "kueue.x-k8s.io/multikueue"}
CEL_RULES: dict[str, Callable[[Any], bool]] = {
    "self == oldSelf": lambda v: True,
    "self in ['ray.io/kuberay-operator', 'kueue.x-k8s.io/multikueue']": lambda v: v in _MANAGED_BY,
    "!((has(self.onSuccess) || has(self.onFailure)) && has(self.deletionRules))":
        lambda v: not (("onSuccess" in v or "onFailure" in v) and "deletionRules" in v),
    "((has(self.onSuccess) && has(self.onFailure)) || has(self.deletionRules))":
        lambda v: ("onSuccess" in v and "onFailure" in v) or "deletionRules" in v,
    "!(has(self.jobStatus) && has(self.jobDeploymentStatus))":
        lambda v: not ("jobStatus" in v and "jobDeploymentStatus" in v),
    "has(self.jobStatus) || has(self.jobDeploymentStatus)":
        lambda v: "jobStatus" in v or "jobDeploymentStatus" in v,
}


def strictify(schema: Any) -> Any:
    """A copy of an openAPIV3Schema in which undeclared fields are errors (see module doc)."""
    node = dict(schema)
    if "properties" in node:
        node["properties"] = {name: strictify(sub) for name, sub in node["properties"].items()}
        if "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        # The API server fills in defaults before it checks `required`: a defaulted field is never missing.
        if "required" in node:
            node["required"] = [r for r in node["required"] if "default" not in node["properties"].get(r, {})]
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = strictify(node["additionalProperties"])
    if isinstance(node.get("items"), dict):
        node["items"] = strictify(node["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in node:
            node[key] = [strictify(sub) for sub in node[key]]
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return node


def _list_type(validator, list_type, instance, schema) -> Iterator[ValidationError]:
    if not isinstance(instance, list):
        return
    if list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys", [])
        defaults = {k: sub.get("default") for k, sub in schema.get("items", {}).get("properties", {}).items()}
        seen: dict[tuple, int] = {}
        for i, item in enumerate(instance):
            if not isinstance(item, dict):
                continue
            key = tuple(item.get(k, defaults.get(k)) for k in keys)
            if None in key:
                yield ValidationError(f"list-map item {i} lacks key field(s) {[k for k in keys if item.get(k) is None]}")
            elif key in seen:
                yield ValidationError(f"duplicate entry {dict(zip(keys, key))} (items {seen[key]} and {i})")
            seen.setdefault(key, i)
    elif list_type == "set":
        dumped = [json.dumps(v, sort_keys=True) for v in instance]
        if len(set(dumped)) != len(dumped):
            yield ValidationError("duplicate items in a list-type set")


def _cel(validator, rules, instance, schema) -> Iterator[ValidationError]:
    for rule in rules:
        check = CEL_RULES.get(rule["rule"])
        if check is None:
            yield ValidationError(f"CEL rule not known to this offline validator: {rule['rule']!r}")
        elif not check(instance):
            yield ValidationError(rule.get("message") or f"CEL rule failed: {rule['rule']}")


def _int_format(bits: int) -> Callable[[Any], bool]:
    def check(v: Any) -> bool:
        return not isinstance(v, int) or isinstance(v, bool) or -(2 ** (bits - 1)) <= v < 2 ** (bits - 1)
    return check


FORMATS = FormatChecker()
FORMATS.checks("int32")(_int_format(32))
FORMATS.checks("int64")(_int_format(64))

KubeValidator = validators.extend(Draft7Validator, {"x-kubernetes-list-type": _list_type,
                                                    "x-kubernetes-validations": _cel})


@lru_cache(maxsize=None)
def crd(kind: str) -> dict[str, Any]:
    return yaml.load((CRDS / CRD_FILES[kind]).read_text(), Loader=_Loader)


@lru_cache(maxsize=None)
def _crd_validator(kind: str, version: str):
    doc = crd(kind)
    for v in doc["spec"]["versions"]:
        if v["name"] == version and v.get("served"):
            schema = strictify(v["schema"]["openAPIV3Schema"])
            schema["properties"]["metadata"] = OBJECT_META
            schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata", "spec"})
            return KubeValidator(schema, format_checker=FORMATS)
    raise KeyError(f"{kind} {doc['spec']['group']}/{version} is not served by the CRD")


@lru_cache(maxsize=None)
def _core_validator(key: str):
    bundle = json.loads((HERE / "schemas" / "k8s-v1.33-strict.json").read_text())
    schema = copy.deepcopy(bundle["kinds"][key])
    schema["$defs"] = bundle["$defs"]
    schema["properties"]["metadata"] = OBJECT_META
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    return Draft202012Validator(schema, format_checker=FORMATS)


def validator_for(manifest: dict[str, Any]):
    api, kind = manifest.get("apiVersion", ""), manifest.get("kind", "")
    if kind in CRD_FILES:
        group, _, version = api.partition("/")
        if group != "ray.io":
            raise KeyError(f"{kind} must be apiVersion ray.io/..., not {api!r}")
        return _crd_validator(kind, version)
    return _core_validator(f"{api}/{kind}")


def errors(manifest: dict[str, Any]) -> list[str]:
    """Every schema violation of one manifest, as 'path: message' lines ([] when valid)."""
    try:
        v = validator_for(manifest)
    except KeyError as e:
        return [f"(top level): no schema for apiVersion/kind: {e}"]
    out = []
    for err in sorted(v.iter_errors(manifest), key=lambda e: list(map(str, e.absolute_path))):
        path = ".".join(str(p) for p in err.absolute_path) or "(top level)"
        out.append(f"{path}: {err.message[:300]}")
    return out


def load_manifests(path: Path) -> list[dict[str, Any]]:
    """The objects of a (multi-document) YAML file, empty documents skipped."""
    return [d for d in yaml.load_all(path.read_text(), Loader=_Loader) if d]


__all__ = ["errors", "strictify", "load_manifests", "crd", "jsonschema"]
