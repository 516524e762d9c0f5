"""Every pod the manifests make (Ray heads and workers, KubeRay's autoscaler sidecar and init
containers, the RayJob's submitter, the README's helper pod) passes the "restricted" Pod Security
level, so the manifests apply in a namespace that enforces it (issue 25, item 8)."""
from __future__ import annotations

import copy
import re

import pytest
import yaml

from tests.deploy.examples import DEPLOY, ROOT, committed_manifest_files, fresh_manifests
from tests.deploy.pod_security import pods_of, restricted_violations

FRESH = fresh_manifests()
COMMITTED = [(str(p.relative_to(ROOT)), d) for p in committed_manifest_files()
             for d in yaml.safe_load_all(p.read_text()) if d]
README_PODS = [d for text in re.findall(r"```yaml\n(.*?)```", (DEPLOY / "README.md").read_text(), re.S)
               for d in yaml.safe_load_all(text) if isinstance(d, dict) and d.get("kind") == "Pod"]


def _all_pods(manifests):
    return [(f"{where} {pod_where}", pod, injected) for where, m in manifests for pod_where, pod, injected in pods_of(m)]


@pytest.mark.parametrize("where,pod,injected", _all_pods(FRESH + COMMITTED), ids=lambda x: x if isinstance(x, str) else "")
def test_every_pod_is_restricted(where, pod, injected):
    assert restricted_violations(pod, injected) == [], where


def test_there_are_pods_of_every_kind():
    kinds = {w.split()[-1] for w, _, _ in _all_pods(FRESH)}      # head, submitter, or the worker group
    assert {"head", "submitter", "gpu-workers", "cpu-workers"} <= kinds, kinds
    assert any(inj and inj[0]["name"] == "autoscaler" for _, _, inj in _all_pods(FRESH))


def test_readme_helper_pod_is_restricted():
    assert README_PODS, "deploy/README.md's fill-models pod is gone"
    for pod in README_PODS:
        assert restricted_violations(pod["spec"]) == [], pod["metadata"]["name"]


def _rayjob():
    return copy.deepcopy(next(m for _, m in FRESH if m["kind"] == "RayJob"))


@pytest.mark.parametrize("breakage,expected", [
    (lambda m: m["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["securityContext"].pop("seccompProfile"),
     "seccompProfile"),
    (lambda m: m["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
     .pop("securityContext"), "allowPrivilegeEscalation"),
    (lambda m: m["spec"].pop("submitterPodTemplate"), "submitter"),
    (lambda m: m["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["volumes"].append(
        {"name": "host", "hostPath": {"path": "/"}}), "hostPath"),
    (lambda m: m["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["securityContext"].update(
        runAsNonRoot=False), "runAsNonRoot"),
])
def test_the_checker_catches_each_mistake(breakage, expected):
    m = _rayjob()
    assert not [v for _, pod, inj in pods_of(m) for v in restricted_violations(pod, inj)]
    breakage(m)
    found = [f"{w}: {v}" for w, pod, inj in pods_of(m) for v in restricted_violations(pod, inj)]
    assert any(expected in f for f in found), found


def test_autoscaler_sidecar_without_security_context_is_caught():
    m = copy.deepcopy(next(m for _, m in FRESH if m["kind"] == "RayService"))
    m["spec"]["rayClusterConfig"]["autoscalerOptions"].pop("securityContext")
    found = [v for _, pod, inj in pods_of(m) for v in restricted_violations(pod, inj)]
    assert any(v.startswith("autoscaler:") for v in found), found
