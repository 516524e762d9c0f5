"""The Kubernetes "restricted" Pod Security Standard (v1.33), written out independently of the renderer,
for the pods our manifests make: what the admission controller would refuse in a namespace labelled
`pod-security.kubernetes.io/enforce: restricted`. https://kubernetes.io/docs/concepts/security/pod-security-standards/

Pods in a RayCluster also get containers KubeRay adds: the autoscaler sidecar (its securityContext is
`autoscalerOptions.securityContext`) and the workers' `wait-gcs-ready` init container (a copy of the
Ray container's securityContext); `pods_of` lists them with the pod they land in."""
from __future__ import annotations

from typing import Any

ALLOWED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
BASELINE_FORBIDDEN_POD = ("hostNetwork", "hostPID", "hostIPC")


def restricted_violations(pod: dict[str, Any], injected: list[dict[str, Any]] = ()) -> list[str]:
    """What in this pod spec (plus containers injected into it) breaks the restricted level."""
    bad = []
    psc = pod.get("securityContext") or {}
    for key in BASELINE_FORBIDDEN_POD:
        if pod.get(key):
            bad.append(f"spec.{key}")
    for v in pod.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            bad.append(f"volume {v['name']}: {sorted(kinds - ALLOWED_VOLUMES)}")
    containers = [*pod.get("initContainers", []), *pod.get("containers", []), *injected]
    if not containers:
        bad.append("no containers")
    for c in containers:
        name, sc = c.get("name", "?"), c.get("securityContext") or {}
        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            bad.append(f"{name}: capabilities.drop must include ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: capabilities.add beyond NET_BIND_SERVICE")
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            bad.append(f"{name}: runAsNonRoot must be true (pod or container)")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            bad.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile.type must be RuntimeDefault or Localhost (pod or container)")
        for p in c.get("ports", []):
            if p.get("hostPort"):
                bad.append(f"{name}: hostPort {p['hostPort']}")
    return bad


def pods_of(manifest: dict[str, Any]) -> list[tuple[str, dict[str, Any], list[dict[str, Any]]]]:
    """(where, pod spec, containers KubeRay injects) for every pod a manifest makes."""
    kind, spec = manifest.get("kind"), manifest.get("spec") or {}
    out = []
    if kind == "Pod":
        out.append(("pod", spec, []))
    cluster = spec.get("rayClusterConfig") or spec.get("rayClusterSpec") or (spec if kind == "RayCluster" else None)
    if cluster:
        head = cluster["headGroupSpec"]["template"]["spec"]
        sidecar = []
        if cluster.get("enableInTreeAutoscaling"):
            sidecar = [{"name": "autoscaler", "securityContext": (cluster.get("autoscalerOptions") or {}).get("securityContext")}]
        out.append(("head", head, sidecar))
        for g in cluster.get("workerGroupSpecs") or []:   # a head-only cluster has none
            worker = g["template"]["spec"]
            init = [{"name": "wait-gcs-ready", "securityContext": worker["containers"][0].get("securityContext")}]
            out.append((f"worker {g['groupName']}", worker, init))
    if kind == "RayJob":
        if spec.get("submissionMode", "K8sJobMode") == "K8sJobMode":
            sub = spec.get("submitterPodTemplate")
            # without a template KubeRay's default submitter pod has no securityContext at all
            out.append(("submitter", (sub or {}).get("spec") or {"containers": [{"name": "ray-job-submitter"}]}, []))
    return out
