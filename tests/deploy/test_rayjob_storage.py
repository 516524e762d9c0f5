"""The RayJob reads from and writes to a bucket (s3://, gs://) with credentials from Kubernetes Secrets,
or uses a ReadWriteMany volume (the alternative), or both (issue 25, item 7)."""
from __future__ import annotations

import pytest
import yaml

from cluster.config_base import ConfigError
from deploy.deploy_config import DeployConfig, RayJobConfig
from deploy.kuberay import GCP_KEY_DIR, render
from tests.deploy.examples import inputs

VOL = {"claim": "eagle-data", "path": "/data"}
CPU = DeployConfig()


def _pods(m):
    c = m["spec"]["rayClusterSpec"]
    return [c["headGroupSpec"]["template"]["spec"], *(g["template"]["spec"] for g in c["workerGroupSpecs"])]


def test_s3_in_gs_out_with_secrets_in_every_ray_pod():
    job = RayJobConfig(input="s3://in-bucket/prompts/", output="gs://out-bucket/run-1", replicas=2,
                       object_store={"credentials_secret": "eagle-s3", "env": {"AWS_REGION": "eu-west-1"},
                                     "gcp_key_secret": {"name": "gcs-key", "key": "sa.json"}})
    m = render(CPU, job)["rayjob.yaml"]
    assert m["spec"]["entrypoint"].startswith("eaglectl submit-job s3://in-bucket/prompts/ --output gs://out-bucket/run-1 ")
    for pod in _pods(m):
        c = pod["containers"][0]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["AWS_REGION"] == "eu-west-1" and env["GOOGLE_APPLICATION_CREDENTIALS"] == f"{GCP_KEY_DIR}/key.json"
        assert c["envFrom"] == [{"secretRef": {"name": "eagle-s3"}}]
        vols = {v["name"]: v for v in pod["volumes"]}
        assert "data" not in vols                                                   # no volume needed
        assert vols["gcp-key"]["secret"] == {"secretName": "gcs-key", "items": [{"key": "sa.json", "path": "key.json"}]}
        assert {"name": "gcp-key", "mountPath": GCP_KEY_DIR, "readOnly": True} in c["volumeMounts"]
    submitter = m["spec"]["submitterPodTemplate"]["spec"]["containers"][0]
    assert "envFrom" not in submitter and "env" not in submitter                 # it only runs `ray job submit`


def test_serving_pods_get_no_job_credentials():
    job = RayJobConfig(input="s3://b/in/", output="s3://b/out", object_store={"credentials_secret": "eagle-s3"})
    files = render(CPU, job)
    for name in ("rayservice.yaml", "raycluster.yaml"):
        assert "eagle-s3" not in yaml.safe_dump(files[name])


def test_bucket_in_volume_out():
    job = RayJobConfig(input="s3://b/in/", output="/data/out/run-1", data_volume=VOL)
    m = render(CPU, job)["rayjob.yaml"]
    for pod in _pods(m):
        assert {"name": "data", "mountPath": "/data"} in pod["containers"][0]["volumeMounts"]
        assert "envFrom" not in pod["containers"][0]     # no credentials given: the pods' own identity (IRSA, ...)


@pytest.mark.parametrize("data,message", [
    ({"input": "s3://b/in/", "output": "/data/out"}, "set data_volume"),
    ({"input": "s3://b/in/", "output": "s3://b/out", "object_store": {"env": {"AWS_SECRET_ACCESS_KEY": "x"}}},
     "plain text"),
    ({"input": "s3://b/in/", "output": "s3://b/out", "object_store": {"env": {"AWS_ACCESS_KEY_ID": "x"}}}, "plain text"),
    ({"input": "/data/in/", "output": "/data/out", "data_volume": VOL, "object_store": {"credentials_secret": "s"}},
     "drop object_store"),
    ({"input": "s3://b/in/", "output": "s3://b/out", "object_store": {"credentials_secret": "Not_A_Name"}},
     "credentials_secret"),
    ({"input": "S3://b/in/", "output": "ftp://b/out"}, "only s3://"),
])
def test_bad_object_store_jobs_are_refused(tmp_path, data, message):
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=message):
        RayJobConfig.from_yaml(p)


def test_the_gpu_example_uses_a_bucket_and_the_cpu_example_the_volume():
    gpu = RayJobConfig.from_yaml(inputs("gpu-tp2")[1])
    assert gpu.input.startswith("s3://") and gpu.output.startswith("s3://") and gpu.data_volume is None
    assert gpu.object_store and gpu.object_store.credentials_secret
    cpu = RayJobConfig.from_yaml(inputs("cpu-small")[1])
    assert cpu.data_volume is not None and cpu.input.startswith(cpu.data_volume.path)
