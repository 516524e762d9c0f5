"""A job submitted with --address to a local two-node Ray cluster (token auth, one CPU per node),
followed with `job status --follow` to completion, then `job list` and `job logs`; and a job that
loses a replica with its node (three nodes, one drained and shut down mid-job).

The cluster is `tests.ray_cluster.LocalCluster` (started with `ray start` in its own temp dir, torn
down by process id)."""
from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from tests.cluster.conftest import wait_for
from tests.ray_cluster import REPO, LocalCluster, kill_node

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
    bad = write_parquet(tmp_path / "bad.parquet", prompt=["", None])
    res = cli("submit-job", bad, "--model", tiny_model, "--draft", "none", "--address", address,
              "--job-id", "error-rows-job", env=env, timeout=300)
    assert res.returncode == 3, res.stdout + res.stderr
    assert "error-rows-job: SUCCEEDED" in res.stdout and "(2 error rows" in res.stdout


JOB_DRIVER = """
import json, sys
from jobs.job_config import JobConfig
from jobs.progress import summary
from jobs.runner import run_job
print(summary(run_job(JobConfig(**json.loads(sys.argv[2])), ray_address=sys.argv[1])))
"""


@pytest.mark.slow  # a three-node `ray start` cluster and a job driver subprocess
def test_a_job_loses_a_replica_with_its_node_and_finishes_without_a_restart_or_an_error_row(tmp_path):
    """A node drained for preemption and shut down like a deleted pod (SIGTERM to its raylet) mid-job:
    with no replica restarts and no row retries allowed (`max_replica_restarts=0`,
    `max_row_retries=0`), the replica is still replaced on the spare node and its rows sent again,
    since a lost node is no replica's or row's doing: every row once, no error row. A tensor-parallel
    rank on that node is judged lost with it too (a TP replica's failed step then counts no death)."""
    n = 80                                   # 10 rounds of 1.6 s a replica: outlasts the preemption by seconds
    inp = write_parquet(tmp_path / "in.parquet", prompt=[f"row {i} [slow:0.1]" for i in range(n)])
    cfg = dict(input=str(inp), engine="tests.cluster.fake_engine", model="fake", draft="none", max_tokens=16,
               max_num_seqs=4, replicas=2, cpus_per_replica=1, max_replica_restarts=0, max_row_retries=0,
               rows_per_file=4, commit_interval_s=0.5)
    with LocalCluster(node_cpus=(1, 1, 1)) as cluster:
        driver = subprocess.Popen([sys.executable, "-c", JOB_DRIVER, cluster.gcs, json.dumps(cfg)], cwd=REPO,
                                  env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        # a tensor-parallel rank on the node taken away below, in a group whose rank 0 is elsewhere:
        # its loss is the cluster's doing too (cluster/tp_group.py's node_loss, which the replica asks)
        rank = subprocess.Popen([sys.executable, "-m", "tests.cluster.multinode", cluster.gcs, "rank-verdict"],
                                cwd=REPO, env=cluster.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            out = tmp_path / "in.out"

            def rows_done() -> int:
                try:
                    return read_manifest(out)["runs"][-1]["rows"]
                except (OSError, ValueError, KeyError, IndexError):
                    return 0
            assert wait_for(lambda: rows_done() >= 8 or driver.poll() is not None, timeout=180), "no row finished"
            assert driver.poll() is None, driver.communicate()[0][-3000:]
            replicas = cluster.driver("actors", "JobReplica")["actors"]
            assert len(replicas) == 2, replicas
            lost = next(r for r in replicas if not r["on_head"])
            assert rank.stdout.readline().strip() == "connected"
            rank.stdin.write(lost["node_id"] + "\n")
            rank.stdin.flush()
            assert rank.stdout.readline().strip() == "ready"
            cluster.drain_for_preemption(lost["node_id"])
            kill_node(lost["node_id"], graceful=True)
            verdict = json.loads(rank.communicate("go\n", timeout=120)[0].splitlines()[-1])
            log = driver.communicate(timeout=300)[0]
        finally:
            for proc in (driver, rank):
                if proc.poll() is None:
                    proc.kill()
    assert verdict["before"] is None and verdict["verdict"] == "node_lost", verdict
    assert driver.returncode == 0, log[-3000:]
    assert "was lost with its node" in log and "1 replica(s) lost with their node" in log, log[-3000:]
    m = read_manifest(out)
    ids = pq.read_table(out, columns=["id"]).column("id").to_pylist()
    assert sorted(ids) == sorted(f"in.parquet:{i}" for i in range(n))
    assert m["complete"] and m["error_rows"] == 0, m
    assert m["runs"][-1]["replicas_lost_with_node"] == 1, m["runs"][-1]
