"""Configs that render but could never run (or would misbehave) on the cluster: refused at render
time naming the setting (PDBs KubeRay pods can use, secrets in plain env, ports, pod sizes, weights
the pods cannot reach, job settings the cluster would refuse); and their valid neighbours, which
still render CRD-valid manifests."""
from __future__ import annotations

import shlex

import pytest
import yaml
from click.testing import CliRunner

from cluster.config_base import ConfigError
from deploy.deploy_config import DeployConfig, RayJobConfig
from deploy.kuberay import job_entrypoint, render, render_files
from eaglectl.deploy import deploy
from tests.deploy.examples import SETUPS, fresh
from tests.deploy.kube_schema import errors

VOL = {"claim": "eagle-data", "path": "/data"}
GPU = {"device": "cuda", "dtype": "bfloat16", "resources_per_rank": {"gpu": 1}}
JOB = {"input": "/data/in.parquet", "output": "/data/out", "data_volume": VOL}


def _write(tmp_path, name: str, data) -> str:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(p)


def _load(tmp_path, data) -> DeployConfig:
    return DeployConfig.from_yaml(_write(tmp_path, "serve.yaml", data))


def _job(tmp_path, data: dict) -> RayJobConfig:
    return RayJobConfig.from_yaml(_write(tmp_path, "job.yaml", data))


def _crd_valid(manifests: dict[str, dict]) -> None:
    for name, m in manifests.items():
        assert not list(errors(m)), (name, list(errors(m)))


def _cli(tmp_path, serve: dict | str, job: dict | None = None):
    args = ["render", "--config", _write(tmp_path, "serve.yaml", serve), "--out", str(tmp_path / "out")]
    if job is not None:
        args += ["--job", _write(tmp_path, "job.yaml", job)]
    return CliRunner().invoke(deploy, args)


# ---- 1. the PodDisruptionBudget: an integer minAvailable, never maxUnavailable --------------------------
@pytest.mark.parametrize("setup", SETUPS)
def test_committed_pdbs_use_an_integer_min_available(setup):
    """A RayCluster has no scale subresource: with maxUnavailable (or a percentage) Kubernetes allows no
    eviction of its pods at all (kuberay#2662) and node drains hang."""
    spec = yaml.safe_load(fresh(setup)["pdb.yaml"])["spec"]
    assert "maxUnavailable" not in spec
    assert isinstance(spec["minAvailable"], int) and not isinstance(spec["minAvailable"], bool)


@pytest.mark.parametrize("serve,kube,expected", [
    ({"autoscaling": {"min_replicas": 1, "max_replicas": 4}}, {}, 0),
    ({"autoscaling": {"min_replicas": 3, "max_replicas": 6}}, {}, 2),
    ({"autoscaling": {"min_replicas": 3, "max_replicas": 6}}, {"pdb_max_unavailable": 2}, 1),
    ({"autoscaling": {"min_replicas": 3, "max_replicas": 6}}, {"pdb_max_unavailable": 5}, 0),
    ({"num_replicas": 4}, {"workers": {"min_nodes": 5, "max_nodes": 8}}, 4),
    ({**GPU, "tp_size": 2, "placement_strategy": "STRICT_PACK", "autoscaling": {"min_replicas": 4, "max_replicas": 8}},
     {"workers": {"gpus_per_node": 4}}, 1),                   # 2 replicas a node: 2 workers at least, less 1
])
def test_pdb_min_available_is_the_minimum_workers_less_max_unavailable(tmp_path, serve, kube, expected):
    m = render(_load(tmp_path, {"serve": serve, "kubernetes": kube}))
    spec = m["pdb.yaml"]["spec"]
    assert spec["minAvailable"] == expected and "maxUnavailable" not in spec
    lo = m["rayservice.yaml"]["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplicas"]
    assert spec["minAvailable"] == max(0, lo - kube.get("pdb_max_unavailable", 1))
    _crd_valid(m)


# ---- 2. credentials in plain env ------------------------------------------------------------------------
@pytest.mark.parametrize("name,points_to", [
    ("HF_TOKEN", "kubernetes.storage.hf_token_secret"), ("HUGGING_FACE_HUB_TOKEN", "kubernetes.storage.hf_token_secret"),
    ("RAY_AUTH_TOKEN", "kubernetes.ray_auth_secret"), ("AWS_SESSION_TOKEN", "object_store.credentials_secret"),
    ("OPENAI_API_KEY", "object_store.credentials_secret"), ("my_api_keys", "object_store.credentials_secret"),
    ("DB_PASSWORD", "object_store.credentials_secret"), ("db.password", "object_store.credentials_secret"),
    ("Client-Secret", "object_store.credentials_secret"), ("GITHUB_TOKEN_2", "object_store.credentials_secret"),
    ("APIKEY", "object_store.credentials_secret"), ("SECRET", "object_store.credentials_secret"),
])
def test_credential_names_in_plain_env_are_refused_pointing_to_the_secret_option(tmp_path, name, points_to):
    with pytest.raises(ConfigError, match=rf"kubernetes.env: {name} would be written .*plain text.*{points_to}"):
        _load(tmp_path, {"kubernetes": {"env": {name: "x"}}})
    with pytest.raises(ConfigError, match=rf"object_store.env: {name} .*plain text"):
        _job(tmp_path, {"input": "s3://b/in/", "output": "s3://b/out/", "object_store": {"env": {name: "x"}}})


@pytest.mark.parametrize("name", ["TOKENIZERS_PARALLELISM", "MAX_TOKENS", "AWS_REGION", "HF_HUB_OFFLINE",
                                  "SECRETARY", "KEYSTONE_URL", "PASSWORDLESS"])
def test_names_that_only_look_like_credentials_pass(tmp_path, name):
    _crd_valid(render(_load(tmp_path, {"kubernetes": {"env": {name: "x"}}})))


# ---- 4. seeds: the job config's range -------------------------------------------------------------------
@pytest.mark.parametrize("seed", [-1, 2**63])
def test_a_seed_outside_the_engines_range_is_refused(tmp_path, seed):
    with pytest.raises(ConfigError, match="seed"):
        _job(tmp_path, {**JOB, "seed": seed})


@pytest.mark.parametrize("seed", [0, 2**31, 2**32, 2**63 - 1])
def test_a_seed_past_32_bits_renders(tmp_path, seed):
    job = _job(tmp_path, {**JOB, "seed": seed})
    assert f"--seed {seed}" in job_entrypoint(DeployConfig(), job)


# ---- 5. max_tokens against the serve section's context ----------------------------------------------------
@pytest.mark.parametrize("job,needle", [
    ({**JOB, "max_tokens": 2048}, r"max_tokens \(2048\) must be < max_model_len \(2048"),
    ({**JOB, "max_tokens": 4096}, r"max_tokens \(4096\) must be < max_model_len \(2048"),
    ({"input": "/data/in.parquet", "output": "/data/out", "serve_app": True, "max_tokens": 100000},
     r"max_tokens \(100000\) must be < max_model_len \(2048"),
])
def test_a_job_max_tokens_the_context_cannot_hold_is_refused(tmp_path, job, needle):
    kube = {"ray_auth_secret": "tok", "job_data": {"data_volume": VOL}}
    cfg = _load(tmp_path, {"serve": {"limits": {"max_model_len": 2048}}, "kubernetes": kube})
    with pytest.raises(ConfigError, match=needle):
        render(cfg, _job(tmp_path, job))


def test_submit_jobs_default_max_tokens_counts_too(tmp_path):
    cfg = _load(tmp_path, {"serve": {"limits": {"max_model_len": 128}}})
    with pytest.raises(ConfigError, match=r"max_tokens \(256, submit-job's default\) must be < max_model_len \(128"):
        render(cfg, _job(tmp_path, JOB))
    _crd_valid(render(cfg, _job(tmp_path, {**JOB, "max_tokens": 127})))


# ---- 6. extra_args: parsed and validated by submit-job itself ------------------------------------------------
@pytest.mark.parametrize("extra,needle", [
    (["--top-k", "-5"], "top_k: Input should be greater than or equal to -1"),
    (["--format", "csv"], "Invalid value for '--format'"),
    (["--max-in-flight", "x"], "Invalid value for '--max-in-flight'"),
    (["--speculation", "{bad"], "--speculation: not JSON"),
    (["--rows-per-file", "0"], "rows_per_file"),
])
def test_extra_args_submit_job_would_refuse_are_refused_by_deploy_render(tmp_path, extra, needle):
    r = _cli(tmp_path, {}, {**JOB, "extra_args": extra})
    assert r.exit_code == 2, r.output
    assert "submit-job would refuse" in r.output and needle in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_a_fleet_jobs_extra_args_are_checked_the_same_way(tmp_path):
    serve = {"kubernetes": {"ray_auth_secret": "tok", "job_data": {"data_volume": VOL}}}
    job = {"input": "/data/in.parquet", "output": "/data/out", "serve_app": True}
    r = _cli(tmp_path, serve, {**job, "extra_args": ["--top-k", "-5"]})
    assert r.exit_code == 2 and "top_k" in r.output, r.output
    assert _cli(tmp_path, serve, {**job, "extra_args": ["--top-k", "5"]}).exit_code == 0


def test_valid_extra_args_render_through_the_cli(tmp_path):
    r = _cli(tmp_path, {}, {**JOB, "extra_args": ["--top-k", "5", "--keep-columns", "--stop", "\n\n"]})
    assert r.exit_code == 0, r.output
    argv = shlex.split(yaml.safe_load((tmp_path / "out" / "rayjob.yaml").read_text())["spec"]["entrypoint"])
    assert argv[argv.index("--top-k") + 1] == "5"


# ---- 7. a CPU job's TP ranks fit a job worker ----------------------------------------------------------------
CPU3 = {"kubernetes": {"workers": {"resources": {"cpu": "3", "memory": "6Gi"}}}}


@pytest.mark.parametrize("job", [{"tp_size": 4}, {"tp_size": 4, "replicas": 2},
                                 {"tp_size": 2, "extra_args": ["--cpus-per-replica", "2"]}])
def test_a_cpu_job_whose_ranks_a_worker_cannot_hold_is_refused(tmp_path, job):
    with pytest.raises(ConfigError, match=r"job tp_size \(\d\): a worker pod would run .* no replica could ever be placed"):
        render(_load(tmp_path, CPU3), _job(tmp_path, {**JOB, **job}))


@pytest.mark.parametrize("job", [{"tp_size": 3}, {"tp_size": 2, "replicas": 3},
                                 {"tp_size": 4, "extra_args": ["--cpus-per-replica=0.5"]}])
def test_a_cpu_job_whose_ranks_fit_renders(tmp_path, job):
    _crd_valid(render(_load(tmp_path, CPU3), _job(tmp_path, {**JOB, **job})))


def test_gpu_job_workers_hold_a_cpu_a_rank(tmp_path):
    cfg = _load(tmp_path, {"serve": {**GPU, "resources_per_rank": {"gpu": 1, "cpu": 0.5}},
                           "kubernetes": {"workers": {"gpus_per_node": 4, "resources": {"cpu": "2", "memory": "16Gi"}}}})
    with pytest.raises(ConfigError, match="4 ranks reserving 1 CPU each"):
        render(cfg, _job(tmp_path, {**JOB, "replicas": 4}))
    _crd_valid(render(cfg, _job(tmp_path, {**JOB, "replicas": 2})))


# ---- 8. resource quantities that fail in the pods ------------------------------------------------------------
@pytest.mark.parametrize("resources,field", [
    ({"cpu": "2", "memory": "8"}, "kubernetes.workers.resources.memory: .*less than 512Mi"),
    ({"cpu": "2", "memory": "0"}, "kubernetes.workers.resources.memory"),
    ({"cpu": "2", "memory": "511Mi"}, "kubernetes.workers.resources.memory"),
    ({"cpu": "0", "memory": "8Gi"}, "kubernetes.workers.resources.cpu: .*more than 0"),
    ({"cpu": 0, "memory": "8Gi"}, "kubernetes.workers.resources.cpu: .*more than 0"),
    ({"cpu": "0m", "memory": "8Gi"}, "kubernetes.workers.resources.cpu"),
    ({"cpu": True, "memory": "8Gi"}, "kubernetes.workers.resources.cpu: .*got true"),
    ({"cpu": ".inf", "memory": "8Gi"}, "kubernetes.workers.resources.cpu"),
    ({"cpu": "2", "memory": "8Gi", "ephemeral_storage": "0"}, "kubernetes.workers.resources.ephemeral_storage"),
])
def test_resource_sizes_no_pod_runs_with_are_refused(tmp_path, resources, field):
    with pytest.raises(ConfigError, match=field):
        _load(tmp_path, {"kubernetes": {"workers": {"resources": resources}}})


def test_a_zero_cache_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="kubernetes.storage.cache_size"):
        _load(tmp_path, {"kubernetes": {"storage": {"cache_size": "0"}}})


@pytest.mark.parametrize("cpu,rendered", [(2, "2"), (0.5, "0.5"), ("1500m", "1500m"), (3.0, "3.0")])
def test_a_number_of_cpus_is_taken_as_a_quantity(tmp_path, cpu, rendered):
    m = render(_load(tmp_path, {"kubernetes": {"head": {"resources": {"cpu": cpu, "memory": "8Gi"}}}}))
    _crd_valid(m)
    head = m["raycluster.yaml"]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["resources"]["limits"]["cpu"] == rendered


def test_a_number_of_worker_cpus_sizes_the_workers(tmp_path):
    m = render(_load(tmp_path, {"kubernetes": {"workers": {"resources": {"cpu": 4, "memory": "8Gi"}}}}))
    worker = m["rayservice.yaml"]["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["cpu"] == "4"
    with pytest.raises(ConfigError, match="would never schedule"):
        _load(tmp_path, {"serve": {"resources_per_rank": {"cpu": 4}},
                         "kubernetes": {"workers": {"resources": {"cpu": 2, "memory": "8Gi"}}}})


# ---- 9. serve ports a pod cannot bind, or that Ray's workers take ---------------------------------------------
@pytest.mark.parametrize("port,needle", [(10002, "worker port range"), (10500, "worker port range"),
                                         (19999, "worker port range"), (80, "below 1024"), (1023, "below 1024")])
def test_a_serve_port_ray_workers_use_or_below_1024_is_refused(tmp_path, port, needle):
    with pytest.raises(ConfigError, match=rf"serve.port \({port}\) .*{needle}"):
        _load(tmp_path, {"serve": {"port": port}})


@pytest.mark.parametrize("port", [1024, 8000, 9000, 20000, 65535])
def test_other_serve_ports_render(tmp_path, port):
    _crd_valid(render(_load(tmp_path, {"serve": {"port": port}})))


# ---- 10. weights the pods can reach ---------------------------------------------------------------------------
CLAIM = {"storage": {"models_claim": "eagle-models"}}


@pytest.mark.parametrize("serve,kube,needle", [
    ({"model": "/models/llama"}, {}, r"serve.model '/models/llama' is not on a volume .*models_claim"),
    ({"model": "/elsewhere/llama"}, CLAIM, r"serve.model .* kubernetes.storage.models_path \(/models\)"),
    ({"model": "/models/../etc/llama"}, CLAIM, "serve.model"),
    ({"model": "./llama"}, CLAIM, "serve.model './llama' is a path on this machine"),
    ({"model": "~/llama"}, CLAIM, "serve.model '~/llama' is a path on this machine"),
    ({"model": "llama.gguf"}, CLAIM, "serve.model 'llama.gguf' is a path on this machine"),
    ({"model": "meta-llama/Llama-3.1-8B-Instruct"}, CLAIM, "Hugging Face Hub id, but kubernetes.storage.download is off"),
    ({"draft": "/models/head"}, {}, "serve.draft '/models/head' is not on a volume"),
    ({"draft": "heads/eagle"}, CLAIM, "serve.draft 'heads/eagle' is not a head folder the pods have"),
    ({"draft": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"}, {"storage": {"download": True}},
     "serve.draft .* heads are never downloaded"),
])
def test_weights_the_pods_cannot_load_are_refused(tmp_path, serve, kube, needle):
    with pytest.raises(ConfigError, match=needle):
        _load(tmp_path, {"serve": serve, "kubernetes": kube})


@pytest.mark.parametrize("serve,kube", [
    ({"model": "gemma-3-270m", "draft": "default"}, {}),
    ({"model": "/models/llama", "draft": "/models/head"}, CLAIM),
    ({"model": "/models", "draft": None}, CLAIM),
    ({"model": "meta-llama/Llama-3.1-8B-Instruct", "draft": "none"}, {"storage": {"download": True}}),
    ({"model": "/data/models/llama", "draft": "auto"}, {"job_data": {"data_volume": VOL}}),
])
def test_weights_on_a_mounted_volume_or_downloaded_render(tmp_path, serve, kube):
    _crd_valid(render(_load(tmp_path, {"serve": serve, "kubernetes": kube})))


@pytest.mark.parametrize("job,needle", [
    ({"model": "org/model"}, "job.model 'org/model' is a Hugging Face Hub id"),
    ({"model": "/elsewhere/m"}, r"job.model '/elsewhere/m' is not on a volume .*job data_volume.path \(/data\)"),
    ({"draft": "/nope/head"}, "job.draft '/nope/head' is not on a volume"),
    ({"draft": "head"}, "job.draft 'head' is not a head folder"),
    ({"model": "/models/m", "draft": "./head"}, "job.draft './head' is not a head folder"),
])
def test_a_jobs_own_weights_the_pods_cannot_load_are_refused(tmp_path, job, needle):
    with pytest.raises(ConfigError, match=needle):
        render(_load(tmp_path, {"kubernetes": CLAIM}), _job(tmp_path, {**JOB, **job}))


def test_a_jobs_weights_on_its_volumes_render(tmp_path):
    cfg = _load(tmp_path, {"kubernetes": CLAIM})
    for job in ({"model": "/data/m", "draft": "/models/head"}, {"model": "/models/m", "draft": "none"}):
        _crd_valid(render(cfg, _job(tmp_path, {**JOB, **job})))


def test_a_serve_model_on_job_data_is_not_on_a_jobs_own_cluster(tmp_path):
    """The RayService mounts kubernetes.job_data; a job's own cluster mounts its own data_volume only."""
    cfg = _load(tmp_path, {"serve": {"model": "/shared/m"}, "kubernetes": {"job_data": {"data_volume": {
        "claim": "shared", "path": "/shared"}}}})
    with pytest.raises(ConfigError, match="job.model '/shared/m' .*the serve section's, which the job uses"):
        render(cfg, _job(tmp_path, JOB))
    _crd_valid(render(cfg, _job(tmp_path, {**JOB, "model": "/data/m"})))     # its own volume: fine


# ---- 11. gpu_product and a node_selector for the same label ---------------------------------------------------
def test_gpu_product_and_a_different_node_selector_gpu_are_refused(tmp_path):
    workers = {"gpus_per_node": 1, "gpu_product": "NVIDIA-L4",
               "node_selector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}}
    with pytest.raises(ConfigError, match="kubernetes.workers: .*gpu_product .*NVIDIA-L4.*NVIDIA-A100-SXM4-80GB"):
        _load(tmp_path, {"serve": GPU, "kubernetes": {"workers": workers}})
    workers["node_selector"]["nvidia.com/gpu.product"] = "NVIDIA-L4"     # the same GPU twice: no conflict
    m = render(_load(tmp_path, {"serve": GPU, "kubernetes": {"workers": workers}}))
    pod = m["rayservice.yaml"]["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4"}


# ---- 16. an empty file or section: the defaults, as `eaglectl serve --config` reads it --------------------------
@pytest.mark.parametrize("text", ["", "\n# nothing yet\n", "serve:\n", "serve:\nkubernetes:\n", "kubernetes:\n",
                                  "serve: {}\nkubernetes: {}\n"])
def test_an_empty_serve_file_or_section_renders_the_defaults(tmp_path, text):
    from cluster.config import ServeConfig

    path = _write(tmp_path, "serve.yaml", text)
    assert ServeConfig.from_yaml(path) == ServeConfig()
    defaults = _write(tmp_path, "defaults.yaml", "{}\n")
    assert DeployConfig.from_yaml(path) == DeployConfig.from_yaml(defaults)
    assert render_files(path) == {n: t.replace("defaults.yaml", "serve.yaml") for n, t in render_files(defaults).items()}
    r = _cli(tmp_path, text)
    assert r.exit_code == 0, r.output
