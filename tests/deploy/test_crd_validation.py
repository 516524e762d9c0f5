"""Manifests validate strictly against the KubeRay v1.7.0 CRDs (and core kinds against Kubernetes'),
and the validator really is strict: KubeRay's own samples pass, broken manifests fail."""
from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import pytest
import yaml

from tests.deploy import kube_schema as ks
from tests.deploy.examples import SETUPS, committed_manifest_files, fresh_manifests

HERE = Path(__file__).parent


def test_crds_are_the_pinned_v1_7_0_files():
    for line in (ks.CRDS / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        assert hashlib.sha256((ks.CRDS / name).read_bytes()).hexdigest() == digest, name
    for kind in ks.CRD_FILES:
        served = [v["name"] for v in ks.crd(kind)["spec"]["versions"] if v.get("served")]
        assert "v1" in served, kind


def test_documented_setups_exist():
    assert {"cpu-small", "gpu-tp2"} <= set(SETUPS)


@pytest.mark.parametrize("path", sorted((HERE / "upstream_samples").glob("*.yaml")), ids=lambda p: p.name)
def test_kuberay_samples_pass_the_strict_validator(path):
    """Positive control: strictness must not reject what KubeRay itself ships."""
    for m in ks.load_manifests(path):
        if m["kind"] in ks.CRD_FILES:
            assert ks.errors(m) == []


def test_there_are_committed_manifests():
    kinds = {m["kind"] for p in committed_manifest_files() for m in ks.load_manifests(p)}
    assert {"RayService", "RayJob", "RayCluster", "Service", "PodDisruptionBudget"} <= kinds


@pytest.mark.parametrize("path", committed_manifest_files(), ids=lambda p: str(p.relative_to(HERE.parents[1])))
def test_committed_manifest_is_valid(path):
    for m in ks.load_manifests(path):
        assert ks.errors(m) == [], f"{path}: {m['kind']} {m['metadata'].get('name')}"


@pytest.mark.parametrize("where,manifest", fresh_manifests(), ids=lambda v: v if isinstance(v, str) else "")
def test_fresh_render_is_valid(where, manifest):
    assert ks.errors(manifest) == [], where


def test_every_declared_object_is_closed():
    """strictify leaves no object with declared properties open to unknown fields."""
    open_nodes = []

    def walk(node, path):
        if isinstance(node, dict):
            if "properties" in node and node.get("additionalProperties") is not False \
                    and not node.get("x-kubernetes-preserve-unknown-fields"):
                open_nodes.append(path)
            for k, v in node.items():
                walk(v, f"{path}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")
    for kind in ("RayService", "RayJob", "RayCluster"):
        v1 = next(v for v in ks.crd(kind)["spec"]["versions"] if v["name"] == "v1")
        walk(ks.strictify(v1["schema"]["openAPIV3Schema"]), kind)
    assert open_nodes == []


def test_strictify_keeps_preserve_unknown_fields_open_and_types_int_or_string():
    schema = ks.strictify({"type": "object", "properties": {
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"a": {"type": "string"}}},
        "port": {"x-kubernetes-int-or-string": True}}})
    v = ks.KubeValidator(schema)
    assert v.is_valid({"free": {"a": "x", "anything": 1}, "port": 8000})
    assert v.is_valid({"port": "http"})
    assert not v.is_valid({"port": 1.5})
    assert not v.is_valid({"free": {}, "other": 1})


# ---- negative tests: each deliberate mistake must be reported at its path --------------------------
def _gpu_service() -> dict:
    return yaml.safe_load((HERE.parents[1] / "deploy/examples/gpu-tp2/manifests/rayservice.yaml").read_text())


def _worker(m):
    return m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]


def _set(getter, key, value):
    def mutate(m):
        getter(m)[key] = value
    return mutate


BROKEN = {
    "unknown spec field": (_set(lambda m: m["spec"], "serveConfig", "x"), "spec"),
    "typo in worker group": (_set(_worker, "maxReplica", 4), "workerGroupSpecs.0"),
    "unknown container field": (_set(lambda m: _worker(m)["template"]["spec"]["containers"][0], "resource", {}),
                                "containers.0"),
    "bad quantity": (_set(lambda m: _worker(m)["template"]["spec"]["containers"][0]["resources"]["limits"],
                          "memory", "96 GB"), "limits.memory"),
    "int32 overflow": (_set(_worker, "maxReplicas", 2 ** 40), "maxReplicas"),
    "wrong type": (_set(_worker, "minReplicas", "1"), "minReplicas"),
    "enum": (_set(lambda m: m["spec"]["rayClusterConfig"]["autoscalerOptions"], "version", "v3"), "version"),
    "missing required": (lambda m: _worker(m).pop("groupName"), "workerGroupSpecs.0"),
    "duplicate container name": (lambda m: _worker(m)["template"]["spec"]["containers"].append(
        copy.deepcopy(_worker(m)["template"]["spec"]["containers"][0])), "containers"),
    "bad object name": (_set(lambda m: m["metadata"], "name", "Eagle_LLM"), "metadata.name"),
    "CEL rule": (_set(lambda m: m["spec"], "managedBy", "someone-else"), "spec.managedBy"),
    "unknown metadata field": (_set(lambda m: m["metadata"], "label", {}), "metadata"),
    "bad int-or-string": (_set(lambda m: m["spec"]["serveService"]["spec"]["ports"][0], "targetPort", 1.5),
                          "targetPort"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_rayservice_is_rejected(case):
    mutate, where = BROKEN[case]
    m = _gpu_service()
    assert ks.errors(m) == []
    mutate(m)
    errs = ks.errors(m)
    assert errs and any(where in e for e in errs), errs


def test_broken_fixture_file_fails_with_every_mistake():
    errs = [e for m in ks.load_manifests(HERE / "fixtures" / "broken-rayjob.yaml") for e in ks.errors(m)]
    text = "\n".join(errs)
    for expected in ("shutdownAfterJobFinish", "minReplicas", "nvidia.com/gpu", "rayStartParams.num-cpus",
                     "apiVersion"):
        assert expected in text, text


def test_core_kinds_are_strict_too():
    svc = yaml.safe_load((HERE.parents[1] / "deploy/examples/cpu-small/manifests/raycluster-http.yaml").read_text())
    assert ks.errors(svc) == []
    svc["spec"]["port"] = 8000
    assert any("port" in e for e in ks.errors(svc))
    pdb = yaml.safe_load((HERE.parents[1] / "deploy/examples/cpu-small/manifests/pdb.yaml").read_text())
    pdb["spec"]["maxUnavailabe"] = 1
    assert ks.errors(pdb)
    assert ks.errors({"apiVersion": "ray.io/v2", "kind": "RayService", "metadata": {"name": "x"}, "spec": {}})
    assert ks.errors({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"}, "spec": {}})
