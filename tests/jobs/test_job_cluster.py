"""A job submitted with --address to a local two-node Ray cluster (token auth, one CPU per node),
followed with `job status --follow` to completion, then `job list` and `job logs`.

The cluster is `tests.ray_cluster.LocalCluster` (started with `ray start` in its own temp dir, torn
down by process id)."""
from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from tests.ray_cluster import LocalCluster

from .conftest import cli, read_manifest, write_parquet


@pytest.fixture
def two_node_cluster():
    with LocalCluster(node_cpus=(1, 1), dashboard=True) as c:
        yield {"address": c.dashboard_address, "env": c.env}


@pytest.mark.slow  # a two-node `ray start` cluster and CLI subprocesses
def test_job_on_a_two_node_cluster_followed_to_completion(tmp_path, tiny_model, two_node_cluster):
    address, env = two_node_cluster["address"], two_node_cluster["env"]
    n = 300
    inp = write_parquet(tmp_path / "in.parquet", prompt=[f"the quick brown fox {i}" for i in range(n)])
    res = cli("submit-job", inp, "--model", tiny_model, "--draft", "none", "--max-tokens", "16", "--replicas", "2",
              "--cpus-per-replica", "1", "--max-num-seqs", "8", "--min-ready-replicas", "2", "--address", address,
              "--job-id", "two-node-job", "--no-wait", env=env, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "submitted job two-node-job" in res.stdout

    res = cli("job", "status", "two-node-job", "--address", address, "--follow", env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "two-node-job: SUCCEEDED" in res.stdout and "job completed: 300/300 rows" in res.stdout

    ids = pq.read_table(tmp_path / "in.out", columns=["id"]).column("id").to_pylist()
    assert len(ids) == n and set(ids) == {f"in.parquet:{i}" for i in range(n)}
    run = read_manifest(tmp_path / "in.out")["runs"][-1]
    assert len(run["rows_by_node"]) == 2 and sum(run["rows_by_node"].values()) == n, run   # a replica per node

    listed = cli("job", "list", "--address", address, env=env, timeout=60)
    assert listed.returncode == 0 and "two-node-job\tSUCCEEDED" in listed.stdout
    logs = cli("job", "logs", "two-node-job", "--address", address, env=env, timeout=60)
    assert logs.returncode == 0 and "job completed: 300/300 rows" in logs.stdout
    missing = cli("job", "status", "no-such-job", "--address", address, env=env, timeout=60)
    assert missing.returncode == 1 and "no-such-job" in missing.stderr

    # error rows: the Ray job SUCCEEDS (Ray would call exit 3 a failure), and the client exits 3
    bad = write_parquet(tmp_path / "bad.parquet", prompt=["", "  "])
    res = cli("submit-job", bad, "--model", tiny_model, "--draft", "none", "--address", address,
              "--job-id", "error-rows-job", env=env, timeout=300)
    assert res.returncode == 3, res.stdout + res.stderr
    assert "error-rows-job: SUCCEEDED" in res.stdout and "(2 error rows" in res.stdout
