"""The renderer: examples are up to date, the CLI works, sizes follow the serve config, bad configs fail."""
from __future__ import annotations

import textwrap

import pytest
import yaml
from click.testing import CliRunner

from cluster.config import ServeConfig
from cluster.config_base import ConfigError
from deploy.deploy_config import RAY_VERSION, DeployConfig, RayJobConfig
from deploy.kuberay import FILE_NAMES, job_entrypoint, render, render_files
from eaglectl.deploy import deploy
from tests.deploy.examples import EXAMPLES, SETUPS, fresh, inputs


# ---- committed examples == fresh renders -------------------------------------------------------------
@pytest.mark.parametrize("setup", SETUPS)
def test_committed_examples_are_up_to_date(setup):
    out = EXAMPLES / setup / "manifests"
    committed = {p.name: p.read_text() for p in out.glob("*.yaml")}
    assert committed == fresh(setup), (f"deploy/examples/{setup}/manifests is stale: run eaglectl deploy render "
                                       f"--config deploy/examples/{setup}/serve.yaml --job deploy/examples/{setup}/job.yaml "
                                       f"--out deploy/examples/{setup}/manifests")


@pytest.mark.parametrize("setup", SETUPS)
def test_cli_check_agrees(setup):
    serve, job = inputs(setup)
    args = ["render", "--config", str(serve), "--out", str(EXAMPLES / setup / "manifests"), "--check"]
    r = CliRunner().invoke(deploy, args + (["--job", str(job)] if job else []))
    assert r.exit_code == 0, r.output


# ---- the CLI -------------------------------------------------------------------------------------------
def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_cli_renders_a_plain_serve_config(tmp_path):
    cfg = _write(tmp_path, "serve.yaml", "model: gemma-3-270m\nnum_replicas: 2\n")
    r = CliRunner().invoke(deploy, ["render", "--config", str(cfg), "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["pdb.yaml", "raycluster-http.yaml", "raycluster.yaml", "rayservice.yaml"]
    svc = yaml.safe_load((tmp_path / "out" / "rayservice.yaml").read_text())
    group = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert (group["minReplicas"], group["maxReplicas"]) == (2, 2)
    assert svc["spec"]["rayClusterConfig"]["rayVersion"] == RAY_VERSION
    # then --check passes, and a hand edit makes it fail
    check = ["render", "--config", str(cfg), "--out", str(tmp_path / "out"), "--check"]
    assert CliRunner().invoke(deploy, check).exit_code == 0
    (tmp_path / "out" / "pdb.yaml").write_text("edited: by hand\n")
    r = CliRunner().invoke(deploy, check)
    assert r.exit_code == 1 and "pdb.yaml" in r.output


def test_cli_reports_bad_config_with_dotted_paths(tmp_path):
    cfg = _write(tmp_path, "serve.yaml", """\
        serve: {tp_size: 0}
        kubernetes: {workers: {gpus_per_nod: 2}}
        """)
    r = CliRunner().invoke(deploy, ["render", "--config", str(cfg), "--out", str(tmp_path / "out")])
    assert r.exit_code == 2      # bad input; 1 is --check's "not up to date"
    assert "serve.tp_size" in r.output and "kubernetes.workers.gpus_per_nod: unknown field" in r.output
    assert not (tmp_path / "out").exists()


def test_cli_needs_config_and_out(tmp_path):
    assert CliRunner().invoke(deploy, ["render", "--out", str(tmp_path)]).exit_code == 2
    assert "render" in CliRunner().invoke(deploy, ["--help"]).output


def _render(cfg, out, *extra):
    return CliRunner().invoke(deploy, ["render", "--config", str(cfg), "--out", str(out), *extra])


def test_cli_out_under_a_file_is_one_line_naming_out(tmp_path):
    """Not a NotADirectoryError traceback: --out's parent is a file."""
    cfg = _write(tmp_path, "serve.yaml", "model: gemma-3-270m\n")
    (tmp_path / "afile").write_text("x")
    for out in (tmp_path / "afile" / "manifests", tmp_path / "afile" / "a" / "b"):
        r = _render(cfg, out)
        assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
        assert "--out" in r.output and "afile is a file" in r.output


def test_cli_writes_nothing_when_a_target_is_in_the_way(tmp_path):
    """Every target is checked before the first is written: a folder named raycluster.yaml used to be
    found after rayservice.yaml and pdb.yaml were written (IsADirectoryError, half a set)."""
    cfg = _write(tmp_path, "serve.yaml", "model: gemma-3-270m\n")
    out = tmp_path / "out"
    (out / "raycluster.yaml").mkdir(parents=True)
    r = _render(cfg, out)
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
    assert "--out" in r.output and "raycluster.yaml" in r.output
    assert [p.name for p in out.iterdir()] == ["raycluster.yaml"]          # nothing written, no temp files


def test_cli_removes_the_manifests_it_no_longer_renders_and_nothing_else(tmp_path):
    """Rendering again without --job removes the rayjob.yaml an earlier render wrote (`kubectl apply -f
    OUT` would start that batch job again); files the renderer never writes stay, and are noted."""
    serve, job = inputs("cpu-small")
    out = tmp_path / "out"
    assert _render(serve, out, "--job", str(job)).exit_code == 0
    assert (out / "rayjob.yaml").is_file()
    (out / "kustomization.yaml").write_text("resources: []\n")
    (out / "README").write_text("ours\n")
    r = _render(serve, out)
    assert r.exit_code == 0, r.output
    assert "removed" in r.output and not (out / "rayjob.yaml").exists()
    assert sorted(p.name for p in out.iterdir()) == sorted([*render_files(serve), "kustomization.yaml", "README"])
    assert "kustomization.yaml" in r.output                                  # noted: --check reports it
    (out / "kustomization.yaml").unlink()
    assert _render(serve, out, "--check").exit_code == 0


def test_file_names_are_every_manifest_the_renderer_writes():
    serve, job = inputs("cpu-small")
    assert sorted(render_files(serve, job)) == sorted(FILE_NAMES)


def test_one_file_drives_serve_and_deploy():
    for setup in SETUPS:
        serve_path = inputs(setup)[0]
        assert isinstance(ServeConfig.from_yaml(serve_path), ServeConfig)
        assert ServeConfig.from_yaml(serve_path) == DeployConfig.from_yaml(serve_path).serve


# ---- sizing ----------------------------------------------------------------------------------------------
def _cfg(serve: dict, kube: dict | None = None) -> DeployConfig:
    return DeployConfig.model_validate({"serve": serve, "kubernetes": kube or {}})


GPU = {"device": "cuda", "dtype": "bfloat16", "resources_per_rank": {"gpu": 1}}


def _group(manifest):
    spec = manifest["spec"].get("rayClusterConfig") or manifest["spec"].get("rayClusterSpec") or manifest["spec"]
    return spec["workerGroupSpecs"][0]


def test_tp2_on_2_gpu_nodes_is_one_replica_per_node():
    cfg = _cfg({**GPU, "tp_size": 2, "placement_strategy": "STRICT_PACK",
                "autoscaling": {"min_replicas": 1, "max_replicas": 4}}, {"workers": {"gpus_per_node": 2}})
    svc = render(cfg)["rayservice.yaml"]
    g = _group(svc)
    assert (g["minReplicas"], g["maxReplicas"], g["replicas"]) == (1, 4, 1)
    res = g["template"]["spec"]["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == "2"
    assert svc["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    assert svc["spec"]["rayClusterConfig"]["autoscalerOptions"]["version"] == "v2"
    head = svc["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"]["limits"]


def test_tp2_on_8_gpu_nodes_packs_four_replicas_a_node():
    cfg = _cfg({**GPU, "tp_size": 2, "placement_strategy": "STRICT_PACK",
                "autoscaling": {"min_replicas": 1, "max_replicas": 6}},
               {"workers": {"gpus_per_node": 8, "gpu_product": "NVIDIA-H100-80GB-HBM3"}})
    g = _group(render(cfg)["rayservice.yaml"])
    assert (g["minReplicas"], g["maxReplicas"]) == (1, 2)
    assert g["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}


def test_cpu_scale_to_zero_keeps_one_worker_for_the_ingress():
    g = _group(render(_cfg({"autoscaling": {"min_replicas": 0, "max_replicas": 2}}))["rayservice.yaml"])
    assert (g["minReplicas"], g["maxReplicas"]) == (1, 2)


def test_cpu_cluster_has_no_gpus_and_no_gpu_tolerations():
    cfg = _cfg({"autoscaling": {"min_replicas": 1, "max_replicas": 3}})
    for name, m in render(cfg).items():
        assert "nvidia.com/gpu" not in yaml.safe_dump(m), name
    assert _group(render(cfg)["raycluster.yaml"])["maxReplicas"] == 3


SPOT = {"key": "cloud.google.com/gke-spot", "value": "true", "effect": "NoSchedule"}


def test_worker_tolerations_join_the_gpu_one_and_pass_the_crd():
    """A spot GPU pool: its taint tolerated beside nvidia.com/gpu's, in the form the API server takes."""
    from tests.deploy import kube_schema as ks

    cfg = _cfg(GPU, {"workers": {"gpus_per_node": 1, "node_selector": {"cloud.google.com/gke-spot": "true"},
                                 "tolerations": [SPOT, {"key": "dedicated", "operator": "Exists",
                                                        "effect": "NoExecute", "toleration_seconds": 30}]}})
    for name, m in render(cfg).items():
        if m["kind"] not in ("RayService", "RayCluster", "RayJob"):
            continue
        assert ks.errors(m) == [], name
        pod = _group(m)["template"]["spec"]
        assert pod["tolerations"] == [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"},
            {"key": "dedicated", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30}], name
        assert pod["nodeSelector"] == {"cloud.google.com/gke-spot": "true"}
    own = _cfg(GPU, {"workers": {"gpus_per_node": 1, "tolerations": [
        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]}})
    assert _group(render(own)["rayservice.yaml"])["template"]["spec"]["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Equal", "value": "present", "effect": "NoSchedule"}]  # theirs only
    cpu = _group(render(_cfg({}, {"workers": {"tolerations": [SPOT]}}))["rayservice.yaml"])["template"]["spec"]
    assert [t["key"] for t in cpu["tolerations"]] == ["cloud.google.com/gke-spot"]


def test_node_bounds_can_be_overridden():
    cfg = _cfg({"num_replicas": 2}, {"workers": {"min_nodes": 0, "max_nodes": 5}})
    g = _group(render(cfg)["rayservice.yaml"])
    assert (g["minReplicas"], g["maxReplicas"]) == (0, 5)


@pytest.mark.parametrize("serve,kube,message", [
    ({**GPU, "tp_size": 2, "placement_strategy": "STRICT_PACK"}, {"workers": {"gpus_per_node": 3}}, "multiple of"),
    ({**GPU, "tp_size": 4, "placement_strategy": "STRICT_PACK"}, {"workers": {"gpus_per_node": 2}}, "multiple of"),
    ({**GPU, "tp_size": 2}, {"workers": {"gpus_per_node": 2}}, "STRICT_PACK"),
    ({**GPU, "autoscaling": {"min_replicas": 0, "max_replicas": 2}}, {"workers": {"gpus_per_node": 1}}, "frees no GPU"),
    ({}, {"workers": {"gpus_per_node": 1}}, "must not ask for GPUs"),
    ({"api_keys": ["sk-secret"]}, {}, "plain text"),
    ({"api_keys_env": "EAGLE_API_KEYS"}, {}, "go together"),
    ({}, {"image": "eagle-serve:latest"}, "pin a tag"),
    ({}, {"image": "registry:5000/eagle-serve"}, "pin a tag"),
    ({}, {"name": "Eagle"}, "kubernetes.name"),
    ({"resources_per_rank": {"cpu": 4}}, {"workers": {"resources": {"cpu": "2", "memory": "4Gi"}}}, "never schedule"),
    ({}, {"workers": {"resources": {"cpu": "2 cores", "memory": "4Gi"}}}, "resources.cpu"),
    ({}, {"workers": {"min_nodes": 3, "max_nodes": 2}}, "min_nodes"),
    ({"resources_per_rank": {"cpu": 1, "threads": 8}}, {"workers": {"resources": {"cpu": "4", "memory": "4Gi"}}},
     "throttle"),
    ({}, {"ray_auth_secret": "Bad_Name"}, "ray_auth_secret"),
    ({}, {"workers": {"node_selector": {"": "x"}}}, "kubernetes.workers.node_selector"),
    ({}, {"workers": {"node_selector": {"pool": "not a label"}}}, "kubernetes.workers.node_selector.pool"),
    ({}, {"workers": {"tolerations": [{"key": "a", "operator": "Exists", "value": "x"}]}}, "takes no value"),
    ({}, {"workers": {"tolerations": [{"value": "x"}]}}, "needs a key"),
    ({}, {"workers": {"tolerations": [{"key": "a", "effect": "NoSchedule", "toleration_seconds": 5}]}},
     "NoExecute only"),
    ({}, {"workers": {"tolerations": [{"key": "a", "effect": "Sometimes"}]}}, "tolerations.0.effect"),
    ({}, {"workers": {"tolerations": [{"key": "a", "tolerationSeconds": 5}]}}, "tolerationSeconds"),
    ({}, {"storage": {"models_path": "models"}}, "models_path: .*absolute path"),
    ({}, {"storage": {"models_path": "/a/../etc"}}, "models_path: .*without '..'"),
    ({}, {"ray_version": "../../etc"}, "kubernetes.ray_version"),
    ({}, {"image": "eagle-serve:1.0\nx"}, "kubernetes.image"),
    ({}, {"env": {"NOT AN ENV": "1"}}, "kubernetes.env.NOT AN ENV"),
    ({}, {"workers": {"max_nodes": 2**40}}, "at most 2147483647"),
])
def test_bad_deploy_configs_are_refused(tmp_path, serve, kube, message):
    p = tmp_path / "serve.yaml"
    p.write_text(yaml.safe_dump({"serve": serve, "kubernetes": kube}))
    with pytest.raises(ConfigError, match=message):
        DeployConfig.from_yaml(p)


def test_api_keys_come_from_the_secret():
    cfg = _cfg({"api_keys_env": "EAGLE_API_KEYS"}, {"api_keys_secret": {"name": "keys", "key": "k"}})
    env = _group(render(cfg)["rayservice.yaml"])["template"]["spec"]["containers"][0]["env"]
    assert {"name": "EAGLE_API_KEYS", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "k"}}} in env
    assert "sk-" not in yaml.safe_dump(render(cfg))


def test_serve_pods_take_the_streaming_fast_path_unless_told_otherwise():
    """The Serve proxy on every pod runs its router on its own loop (cluster/cpu_threads.serve_env)."""
    head = render(_cfg({}, {}))["rayservice.yaml"]["spec"]["rayClusterConfig"]["headGroupSpec"]
    env = {e["name"]: e.get("value") for e in head["template"]["spec"]["containers"][0]["env"]}
    assert env["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "0" and env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    mine = render(_cfg({}, {"env": {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1"}}))["rayservice.yaml"]
    env = {e["name"]: e.get("value") for e in _group(mine)["template"]["spec"]["containers"][0]["env"]}
    assert env["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "1"


# ---- objects fit together ----------------------------------------------------------------------------------
@pytest.mark.parametrize("setup", SETUPS)
def test_pdb_selects_serving_workers_only(setup):
    files = {n: yaml.safe_load(t) for n, t in fresh(setup).items()}
    sel = files["pdb.yaml"]["spec"]["selector"]["matchLabels"]
    cluster = files["rayservice.yaml"]["spec"]["rayClusterConfig"]
    worker_labels = _group(files["rayservice.yaml"])["template"]["metadata"]["labels"]
    head_labels = cluster["headGroupSpec"]["template"]["metadata"]["labels"]
    assert sel.items() <= worker_labels.items()
    assert not sel.items() <= head_labels.items()
    for other in ("raycluster.yaml", "rayjob.yaml"):
        if other in files:
            spec = files[other]["spec"].get("rayClusterSpec") or files[other]["spec"]
            for group in spec.get("workerGroupSpecs") or []:   # a fleet job's cluster has none
                assert not sel.items() <= group["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("setup", SETUPS)
def test_http_service_points_at_the_interactive_head(setup):
    files = {n: yaml.safe_load(t) for n, t in fresh(setup).items()}
    svc, rc = files["raycluster-http.yaml"], files["raycluster.yaml"]
    assert svc["spec"]["selector"] == {"ray.io/cluster": rc["metadata"]["name"], "ray.io/node-type": "head"}
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert svc["spec"]["ports"][0]["targetPort"] in {p["containerPort"] for p in head["ports"]}
    assert svc["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("setup", SETUPS)
def test_every_pod_runs_non_root_with_probes_and_limits(setup):
    for name, text in fresh(setup).items():
        m = yaml.safe_load(text)
        spec = m["spec"].get("rayClusterConfig") or m["spec"].get("rayClusterSpec") or m["spec"]
        if "headGroupSpec" not in spec:
            continue
        for group in [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]:
            pod = group["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
            c = pod["containers"][0]
            assert c["readinessProbe"] and c["livenessProbe"], name
            assert c["resources"]["limits"] == c["resources"]["requests"], name
            assert c["image"].rsplit(":", 1)[-1] not in ("", "latest")
            assert {v["name"] for v in pod["volumes"]} >= {"dshm", "cache"}


# ---- the batch job ---------------------------------------------------------------------------------------
VOL = {"claim": "eagle-data", "path": "/data"}


def test_rayjob_runs_submit_job_and_shuts_down():
    cfg = _cfg({**GPU, "tp_size": 2, "placement_strategy": "STRICT_PACK", "draft": "/models/head"},
               {"workers": {"gpus_per_node": 4}, "storage": {"models_claim": "eagle-models"}})
    job = RayJobConfig(input="/data/in/", output="/data/out", data_volume=VOL, replicas=3, max_tokens=64)
    m = render(cfg, job)["rayjob.yaml"]
    assert m["spec"]["shutdownAfterJobFinishes"] is True
    ep = m["spec"]["entrypoint"]
    assert ep == job_entrypoint(cfg, job)
    assert ep.startswith("eaglectl submit-job /data/in/ --output /data/out")
    for part in ("--draft /models/head", "--tp-size 2", "--device cuda", "--dtype bfloat16", "--replicas 3", "--wait"):
        assert part in ep
    g = _group({"spec": m["spec"]["rayClusterSpec"]})
    assert g["minReplicas"] == g["maxReplicas"] == g["replicas"] == 2  # 3 replicas, 2 per 4-GPU node
    assert "enableInTreeAutoscaling" not in m["spec"]["rayClusterSpec"]
    for pod in (g["template"]["spec"], m["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]):
        assert {"name": "data", "mountPath": "/data"} in pod["containers"][0]["volumeMounts"]


def test_rayjob_tp_must_fit_the_nodes():
    cfg = _cfg({**GPU, "tp_size": 2, "placement_strategy": "STRICT_PACK"}, {"workers": {"gpus_per_node": 2}})
    with pytest.raises(ConfigError, match="must divide"):
        render(cfg, RayJobConfig(input="/data/in.parquet", output="/data/out", data_volume=VOL, tp_size=4))


@pytest.mark.parametrize("path,message", [
    ("/elsewhere/in.parquet", "under data_volume.path"), ("relative/in.parquet", "under data_volume.path"),
    ("http://host/in.parquet", "only s3://BUCKET"), ("hdfs://nn/in/", "only s3://BUCKET"), ("s3:///no-bucket", "only s3://"),
])
def test_job_data_must_be_on_the_volume_or_in_a_bucket(tmp_path, path, message):
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump({"input": path, "output": "/data/out", "data_volume": VOL}))
    with pytest.raises(ConfigError, match=message):
        RayJobConfig.from_yaml(p)


def test_a_job_output_that_is_its_input_is_refused_at_render_time(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump({"input": "/data/in.parquet", "output": "/data/./in.parquet", "data_volume": VOL}))
    with pytest.raises(ConfigError, match="is the input itself"):
        RayJobConfig.from_yaml(p)


def test_job_entrypoint_quotes_paths_and_the_draft_choice_is_explicit():
    job = RayJobConfig(input="/data/my prompts.parquet", output="/data/out", data_volume=VOL)
    ep = job_entrypoint(_cfg({}), job)
    assert "'/data/my prompts.parquet'" in ep and "--draft auto" in ep     # the serve default travels as is
    assert "--draft none" in job_entrypoint(_cfg({"draft": None}), job)


def test_bad_extra_args_are_refused_at_render_time():
    pytest.importorskip("eaglectl.jobs")
    job = RayJobConfig(input="/data/in.parquet", output="/data/out", data_volume=VOL, extra_args=["--no-such-flag"])
    with pytest.raises(ConfigError, match="would refuse"):
        job_entrypoint(_cfg({}), job)


# ---- the GPU example fits its nodes ---------------------------------------------------------------------
# GKE g2-standard-24 (2 x L4, 24 vCPU, 96 GB), the node the gpu-tp2 example targets: allocatable is
# capacity minus the kubelet/system reservation (GKE's published formula) minus the eviction threshold.
G2_STANDARD_24_ALLOCATABLE = {"cpu": 24 - 0.06 - 0.01 - 2 * 0.005 - 20 * 0.0025,
                              "memory_gib": (96e9 - (0.25 * 4e9 + 0.2 * 4e9 + 0.1 * 8e9 + 0.06 * 80e9) - 100 * 2**20) / 2**30}
DAEMONSET_HEADROOM = {"cpu": 1.0, "memory_gib": 4.0}   # device plugin, logging, kube-proxy, DCGM, ...


def _gib(q: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    for u in sorted(units, key=len, reverse=True):
        if q.endswith(u):
            return float(q[: -len(u)]) * units[u] / 2**30
    return float(q) / 2**30


def test_gpu_tp2_worker_pods_fit_a_2xl4_node_with_headroom():
    assert 81 < G2_STANDARD_24_ALLOCATABLE["memory_gib"] < 83     # "about 82 GiB allocatable"
    cfg = DeployConfig.from_yaml(inputs("gpu-tp2")[0])
    assert cfg.kubernetes.workers.gpu_product == "NVIDIA-L4" and cfg.kubernetes.workers.gpus_per_node == 2
    r = cfg.worker_resources
    assert float(r.cpu) + DAEMONSET_HEADROOM["cpu"] <= G2_STANDARD_24_ALLOCATABLE["cpu"], r
    assert _gib(r.memory) + DAEMONSET_HEADROOM["memory_gib"] <= G2_STANDARD_24_ALLOCATABLE["memory_gib"], r
    # and the pod still holds what one TP-2 replica and the ingress reserve
    assert float(r.cpu) >= cfg.serve.tp_size * cfg.serve.resources_per_rank.cpu + cfg.serve.ingress.num_cpus
