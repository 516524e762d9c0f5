"""Configs that rendered manifests the CRD or Kubernetes would refuse, or that lost a setting on the
way, are refused at render time naming the field; their valid neighbours render CRD-valid manifests."""
from __future__ import annotations

import pytest
import yaml

from cluster.config_base import ConfigError
from deploy.deploy_config import DeployConfig, RayJobConfig, quantity_value
from deploy.kuberay import job_entrypoint, render, render_files
from tests.deploy.kube_schema import errors

KEYS = {"serve": {"api_keys_env": "EAGLE_API_KEYS"}, "kubernetes": {"api_keys_secret": {"name": "keys", "key": "k"}}}
VOL = {"claim": "eagle-data", "path": "/data"}


def _load(tmp_path, data: dict) -> DeployConfig:
    p = tmp_path / "serve.yaml"
    p.write_text(yaml.safe_dump(data))
    return DeployConfig.from_yaml(p)


def _job(tmp_path, data: dict) -> RayJobConfig:
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(data))
    return RayJobConfig.from_yaml(p)


def _crd_valid(manifests: dict[str, dict]) -> None:
    for name, m in manifests.items():
        assert not list(errors(m)), (name, list(errors(m)))


def _merge(a: dict, b: dict) -> dict:
    return {k: {**a.get(k, {}), **b.get(k, {})} for k in a.keys() | b.keys()}


# ---- the serve port is not one of Ray's ---------------------------------------------------------------
@pytest.mark.parametrize("port,what", [(8265, "dashboard"), (6379, "gcs"), (8080, "metrics"), (10001, "client"),
                                       (52365, "dashboard agent")])
def test_a_serve_port_that_ray_uses_is_refused(tmp_path, port, what):
    with pytest.raises(ConfigError, match=rf"serve.port \({port}\) is .*{what} port"):
        _load(tmp_path, {"serve": {"port": port}})


def test_another_serve_port_renders(tmp_path):
    _crd_valid(render(_load(tmp_path, {"serve": {"port": 9000}})))


# ---- each environment variable is set once ------------------------------------------------------------
@pytest.mark.parametrize("data,fields", [
    ({"kubernetes": {"env": {"HF_HOME": "/x"}}}, "kubernetes.env: .*HF_HOME .*renderer"),
    (_merge(KEYS, {"serve": {"api_keys_env": "HF_HOME"}}), "serve.api_keys_env: .*HF_HOME .*renderer"),
    (_merge(KEYS, {"serve": {"api_keys_env": "EAGLE_KEYS"}, "kubernetes": {"env": {"EAGLE_KEYS": "x"}}}),
     "kubernetes.env: .*EAGLE_KEYS .*serve.api_keys_env"),
    ({"kubernetes": {"env": {"HF_TOKEN": "x"}, "storage": {"hf_token_secret": {"name": "hf", "key": "t"}}}},
     "kubernetes.env: .*HF_TOKEN .*kubernetes.storage.hf_token_secret"),
    ({"kubernetes": {"job_data": {"object_store": {"env": {"HF_HOME": "/x"}}}}},
     "kubernetes.job_data.object_store.env: .*HF_HOME .*renderer"),
    ({"kubernetes": {"env": {"AWS_REGION": "a"}, "job_data": {"object_store": {"env": {"AWS_REGION": "b"}}}}},
     "kubernetes.job_data.object_store.env: .*AWS_REGION .*kubernetes.env"),
])
def test_an_env_name_set_twice_is_refused(tmp_path, data, fields):
    with pytest.raises(ConfigError, match=fields):
        render(_load(tmp_path, data))


def test_a_jobs_env_may_not_repeat_the_serve_configs(tmp_path):
    cfg = _load(tmp_path, {"kubernetes": {"env": {"AWS_REGION": "a"}}})
    job = _job(tmp_path, {"input": "s3://b/in/", "output": "s3://b/out/", "object_store": {"env": {"AWS_REGION": "b"}}})
    with pytest.raises(ConfigError, match="job.object_store.env: .*AWS_REGION .*kubernetes.env"):
        render(cfg, job)


def test_a_clash_between_files_names_both_files(tmp_path):
    """`deploy render` reads two files; the message says which ones hold the clashing settings."""
    _load(tmp_path, {"kubernetes": {"env": {"AWS_REGION": "a"}}})
    _job(tmp_path, {"input": "s3://b/in/", "output": "s3://b/out/", "object_store": {"env": {"AWS_REGION": "b"}}})
    serve, job = tmp_path / "serve.yaml", tmp_path / "job.yaml"
    with pytest.raises(ConfigError, match=f"^{serve} \\+ {job}: job.object_store.env: .*AWS_REGION"):
        render_files(serve, job)


def test_distinct_env_names_render(tmp_path):
    env = {"AWS_REGION": "a", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1"}
    store = {"object_store": {"env": {"AWS_ENDPOINT_URL": "u"}}}
    cfg = _load(tmp_path, _merge(KEYS, {"kubernetes": {"env": env, "job_data": store}}))
    m = render(cfg)
    _crd_valid(m)
    env = m["rayservice.yaml"]["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "value": "1"} in env   # kubernetes.env wins


@pytest.mark.parametrize("name", ["AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "GOOGLE_APPLICATION_CREDENTIALS"])
def test_credentials_in_kubernetes_env_are_refused(tmp_path, name):
    with pytest.raises(ConfigError, match=f"kubernetes.env: .*{name}.*plain text"):
        _load(tmp_path, {"kubernetes": {"env": {name: "x"}}})


# ---- each mount path is used once ---------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/dev/shm", "/home/ray/.cache", "/home/ray/.cache/", "/dev//shm"])
def test_a_models_path_on_a_renderer_mount_is_refused(tmp_path, path):
    with pytest.raises(ConfigError, match="kubernetes.storage.models_path: .*renderer"):
        render(_load(tmp_path, {"kubernetes": {"storage": {"models_claim": "m", "models_path": path}}}))


def test_job_data_on_the_models_path_is_refused(tmp_path):
    cfg = {"kubernetes": {"storage": {"models_claim": "m", "models_path": "/data"},
                          "job_data": {"data_volume": VOL}}}
    with pytest.raises(ConfigError, match="kubernetes.job_data.data_volume.path: .*kubernetes.storage.models_path"):
        render(_load(tmp_path, cfg))


@pytest.mark.parametrize("path", ["/home/ray/.cache", "/dev/shm"])
def test_a_job_volume_on_a_renderer_mount_is_refused(tmp_path, path):
    job = _job(tmp_path, {"input": f"{path}/in.parquet", "output": f"{path}/out",
                          "data_volume": {"claim": "d", "path": path}})
    with pytest.raises(ConfigError, match="job.data_volume.path: .*renderer"):
        render(_load(tmp_path, {}), job)


def test_distinct_mount_paths_render(tmp_path):
    cfg = _load(tmp_path, {"kubernetes": {"storage": {"models_claim": "m", "models_path": "/models"},
                                          "job_data": {"data_volume": VOL}}})
    job = _job(tmp_path, {"input": "/data/in.parquet", "output": "/data/out", "data_volume": VOL})
    _crd_valid(render(cfg, job))


# ---- resource quantities: Kubernetes' grammar ---------------------------------------------------------
@pytest.mark.parametrize("q,value", [("1k", 1e3), ("2e3", 2e3), ("1E", 1e18), ("1Ki", 1024), ("500m", 0.5),
                                     ("1.", 1.0), (".5", 0.5), ("+2", 2.0), ("1M", 1e6), ("3Ki", 3072), ("2E-1", 0.2)])
def test_kubernetes_quantities_are_read(q, value):
    assert quantity_value(q) == pytest.approx(value)


@pytest.mark.parametrize("memory", ["1000000k", "2e9", "1.5Gi", "2E9", "600M", "512Mi"])
def test_valid_memory_quantities_render(tmp_path, memory):
    _crd_valid(render(_load(tmp_path, {"kubernetes": {"head": {"resources": {"cpu": "1", "memory": memory}}}})))


@pytest.mark.parametrize("memory", ["1K", "1KI", "1e", "1ki", "Gi", "-1Gi", "1 Gi", "1e99999", "1.2.3"])
def test_invalid_quantities_are_refused_naming_the_field(tmp_path, memory):
    with pytest.raises(ConfigError, match="kubernetes.head.resources.memory"):
        _load(tmp_path, {"kubernetes": {"head": {"resources": {"cpu": "1", "memory": memory}}}})


@pytest.mark.parametrize("cpu", ["1M", "3Ki", "2e3"])
def test_worker_cpu_in_any_unit_is_sized(tmp_path, cpu):
    cfg = _load(tmp_path, {"kubernetes": {"workers": {"resources": {"cpu": cpu, "memory": "8Gi"}}}})
    _crd_valid(render(cfg))


def test_a_bad_worker_cpu_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match="kubernetes.workers.resources.cpu"):
        _load(tmp_path, {"kubernetes": {"workers": {"resources": {"cpu": "1x", "memory": "8Gi"}}}})


# ---- strings that go into pod specs -------------------------------------------------------------------
@pytest.mark.parametrize("data,field", [
    ({"serve": {"device": "cuda", "resources_per_rank": {"gpu": 1}},
      "kubernetes": {"workers": {"gpus_per_node": 1, "gpu_product": "NVIDIA L4"}}}, "kubernetes.workers.gpu_product"),
    (_merge(KEYS, {"serve": {"api_keys_env": "EAGLE KEYS"}}), "serve.api_keys_env"),
    (_merge(KEYS, {"kubernetes": {"api_keys_secret": {"name": "keys", "key": "my key"}}}), "kubernetes.api_keys_secret.key"),
    ({"kubernetes": {"storage": {"hf_token_secret": {"name": "hf", "key": "a/b"}}}}, "kubernetes.storage.hf_token_secret.key"),
])
def test_pod_spec_strings_are_checked(tmp_path, data, field):
    with pytest.raises(ConfigError, match=field):
        _load(tmp_path, data)


# ---- serve settings no rendered cluster can honour ----------------------------------------------------
def test_direct_ingress_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="serve.ingress.direct: .*RAY_SERVE_ENABLE_DIRECT_INGRESS=1"):
        _load(tmp_path, {"serve": {"ingress": {"direct": True}}})


def test_an_api_keys_file_is_refused_pointing_to_the_secret(tmp_path):
    with pytest.raises(ConfigError, match="serve.api_keys_file: .*kubernetes.api_keys_secret"):
        _load(tmp_path, {"serve": {"api_keys_file": "/etc/eagle/keys"}})


# ---- extra_args never override what the renderer sets ---------------------------------------------------
@pytest.mark.parametrize("args,flag", [
    (["--output", "/local/out"], "--output"), (["-o", "/local/out"], "-o"), (["-o/local/out"], "-o"),
    (["--replicas", "50"], "--replicas"), (["--tp-size=2"], "--tp-size"), (["--model", "x"], "--model"),
    (["--device", "cpu"], "--device"), (["--max-tokens", "5"], "--max-tokens"), (["--no-wait"], "--no-wait"),
    (["--address", "http://x:8265"], "--address"), (["--serve-app", "eagle"], "--serve-app"),
])
def test_extra_args_naming_a_rendered_flag_are_refused(tmp_path, args, flag):
    with pytest.raises(ConfigError, match=f"extra_args: .*{flag}"):
        _job(tmp_path, {"input": "s3://b/in/", "output": "s3://b/out/", "extra_args": args})


def test_other_extra_args_and_flag_like_values_pass(tmp_path):
    job = _job(tmp_path, {"input": "s3://b/in/", "output": "s3://b/out/",
                          "extra_args": ["--stop", "--output", "--keep-columns", "--engine", "eagle"]})
    assert "--keep-columns" in job_entrypoint(DeployConfig(), job)


# ---- image references the kubelet can pull --------------------------------------------------------------
@pytest.mark.parametrize("image", ["foo:", "FOO:bar", "ml/Eagle:1", "foo:-1", "foo@sha256:abc", "foo:bar baz",
                                   "foo:" + "a" * 129, "foo:latest", "registry:5000/foo", "foo..bar:1"])
def test_bad_image_references_are_refused(tmp_path, image):
    with pytest.raises(ConfigError, match="kubernetes.image"):
        _load(tmp_path, {"kubernetes": {"image": image}})


@pytest.mark.parametrize("image", ["foo:1", "registry.example.com:5000/ml/eagle-serve:0.1.0-cuda",
                                   "localhost/a_b/c__d/e-f:V1.2_x", "REG.example.com/foo:1",
                                   "foo@sha256:" + "0" * 64, "foo:1@sha256:" + "a" * 64])
def test_good_image_references_render(tmp_path, image):
    m = render(_load(tmp_path, {"kubernetes": {"image": image}}))
    _crd_valid(m)
    assert m["raycluster.yaml"]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] == image
