"""Jobs through a running Serve app (`submit-job --serve-app`): real Ray (`ray start`, token auth), a
real Serve app deployed as `eaglectl serve` deploys it, real Parquet, the openai client over HTTP.

The tiny app's KV cache is tight on purpose (9 blocks of 16 tokens, 4 sequences): a job's rows
alone (one block each) never run out of it, so they are never preempted; an online request that
grows to 8 blocks next to them must preempt offline rows (priority 1) to go on. The row metrics
(`num_preemptions`, summed in the manifest's run entry) show it, and the app's /metrics count the
offline rows that waited in the engine while an online request got its first token (deferred):
no timing involved.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request

import pyarrow.parquet as pq
import pytest

from jobs.job_config import JobConfig, JobConfigError
from tests.ray_cluster import LocalCluster, free_ports

from .conftest import REPO, cli, cli_env, read_manifest, read_rows, write_parquet

BLOCK_BYTES = 16 * 2 * 4 * 2 * 16 * 4      # tiny llama: block of 16 tokens x K,V x 4 layers x 2 heads x 16 dims x fp32


def _prompt(i: int) -> str:
    return f"fox {i}"


@pytest.fixture(scope="module")
def cluster():
    """A `ray start` cluster (4 logical CPUs) with Serve's HTTP proxy; this process is connected to it.
    Token auth is off in every process (RAY_AUTH_MODE=disabled, explicitly): Ray reads the mode when it
    is imported, and pytest's process imported it long before this fixture."""
    import ray
    from ray import serve

    c = LocalCluster(node_cpus=(4,), dashboard=True)   # the dashboard: the Jobs API for submit-job --address
    c.env["RAY_AUTH_MODE"] = "disabled"
    with c:
        ray.init(address=c.gcs, namespace="eagle-serve", logging_level="WARNING", log_to_driver=False)
        port = free_ports(1)[0]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield {"gcs": c.gcs, "env": c.env, "port": port, "dashboard": c.dashboard_address}
        serve.shutdown()
        ray.shutdown()


def _deploy(cfg) -> str:
    from cluster.serve_app import deploy_app

    deploy_app(cfg, route_prefix=f"/{cfg.app_name}")
    return cfg.app_name


@pytest.fixture(scope="module")
def tiny_app(cluster, tiny_model):
    from cluster.config import ServeConfig

    cfg = ServeConfig(model=tiny_model, draft=None, app_name="tiny", num_replicas=1,
                      resources_per_rank={"cpu": 1}, kv_cache_gb=9.5 * BLOCK_BYTES / 2**30,
                      limits={"max_model_len": 128, "max_tokens": 100, "max_num_seqs": 4})
    return {"name": _deploy(cfg), "url": f"http://127.0.0.1:{cluster['port']}/tiny/v1"}


def _driver_args(cluster, cfg: JobConfig) -> list[str]:
    """The job driver as a Ray job runs it (`python -m jobs.driver`), joining the cluster."""
    return [sys.executable, "-m", "jobs.driver", "--config-json", cfg.model_dump_json(), "--address", cluster["gcs"]]


def _drive(cluster, cfg: JobConfig) -> subprocess.CompletedProcess:
    return subprocess.run(_driver_args(cluster, cfg), cwd=REPO, env=cluster["env"], capture_output=True, text=True,
                          timeout=600)


def _committed(out):
    return sorted(out.glob("part-*.parquet")) if out.exists() else []


def test_serve_app_refuses_own_replica_options():
    with pytest.raises(JobConfigError) as e:
        JobConfig.from_options(input="x.parquet", serve_app="eagle", replicas=2, dtype="bfloat16")
    assert "--replicas" in str(e.value) and "--dtype" in str(e.value) and "--serve-app eagle" in str(e.value)
    JobConfig.from_options(input="x.parquet", serve_app="eagle", max_tokens=8, max_in_flight=4)   # job settings: fine


def test_an_app_being_deleted_is_not_listed_as_running(monkeypatch):
    """Serve lists an app it is deleting: the job fails on it, and says so, each app with its state."""
    from jobs.app_pool import AppPool
    from jobs.replica_pool import JobFailed

    monkeypatch.setattr("cluster.app_client.running_apps", lambda: {"tiny": "DELETING", "eagle": "RUNNING"})
    pool = AppPool(JobConfig(input="x.parquet", serve_app="tiny"), client=None, engine={}, run_id="r")
    with pytest.raises(JobFailed) as e:
        pool._check_app()
    assert "'tiny' is gone (being deleted; apps on the cluster: eagle (RUNNING), tiny (DELETING))" in str(e.value)
    monkeypatch.setattr("cluster.app_client.running_apps", lambda: {})
    pool = AppPool(JobConfig(input="x.parquet", serve_app="tiny"), client=None, engine={}, run_id="r")
    pool._check_app()                                  # missing once may be a controller hiccup
    with pytest.raises(JobFailed, match=r"'tiny' is gone \(apps on the cluster: none\)"):
        pool._check_app()


def test_joining_the_apps_cluster_does_not_stream_its_replica_logs_into_the_job(monkeypatch):
    """Serve's replicas log a line per call: a job of a million rows through the app must not print them."""
    import ray

    from jobs.app_link import AppLink

    seen = {}

    class Joined(Exception):
        pass

    def fake_init(**kw):
        seen.update(kw)
        raise Joined

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fake_init)
    with pytest.raises(Joined):
        AppLink.connect(JobConfig(input="x.parquet", serve_app="tiny"), None)
    assert seen["address"] == "auto" and seen["log_to_driver"] is False


def test_bare_serve_app_means_the_app_eaglectl_serve_deploys():
    from click.testing import CliRunner

    from cluster.config import ServeConfig
    from eaglectl.jobs import DEFAULT_APP, submit_job

    assert DEFAULT_APP == ServeConfig().app_name
    res = CliRunner().invoke(submit_job, ["x.parquet", "--serve-app", "--replicas", "2"])
    assert res.exit_code == 2 and f"--serve-app {DEFAULT_APP}: --replicas" in res.output, res.output


@pytest.mark.slow   # CLI subprocesses (no Ray)
def test_submit_job_serve_app_refusals_are_one_line(tmp_path):
    res = cli("submit-job", "x.parquet", "--serve-app", "eagle", "--tp-size", "2")
    assert res.returncode == 2 and "--tp-size" in res.stderr and "Traceback" not in res.stderr, res.stderr
    # an app that does not run here: no cluster to join (RAY_TMPDIR: an empty Ray temp dir), or, when
    # `auto` finds a cluster on this machine anyway (Ray also looks for running GCS processes), no such app
    inp = write_parquet(tmp_path / "in.parquet", prompt=["a"])
    res = cli("submit-job", inp, "--serve-app", "no-such-app", env=cli_env(RAY_TMPDIR=str(tmp_path)), timeout=120)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1 and "Traceback" not in res.stderr, res.stderr
    assert ("--serve-app no-such-app: no Ray cluster to join here" in errors[0]
            or "no Serve app 'no-such-app' runs on this Ray cluster; running apps:" in errors[0]), errors
    assert not (tmp_path / "in.out").exists()                                              # nothing written


@pytest.mark.slow
def test_kill_9_mid_job_through_the_app_then_rerun_has_every_id_once(tmp_path, cluster, tiny_app):
    n = 160
    inp = write_parquet(tmp_path / "in.parquet", prompt=[_prompt(i) for i in range(n)])
    out = tmp_path / "in.out"
    cfg = JobConfig(input=str(inp), serve_app=tiny_app["name"], max_tokens=8, rows_per_file=20)
    proc = subprocess.Popen(_driver_args(cluster, cfg), cwd=REPO, env=cluster["env"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    t0 = time.monotonic()
    while len(_committed(out)) < 3:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() - t0 < 300, "no progress"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    proc.stdout.close()
    before = pq.read_table(out, columns=["id"]).column("id").to_pylist()
    assert 0 < len(before) < n and len(set(before)) == len(before)

    res = _drive(cluster, cfg)
    assert res.returncode == 0, res.stdout + res.stderr
    ids = pq.read_table(out, columns=["id"]).column("id").to_pylist()
    assert len(ids) == n and set(ids) == {f"in.parquet:{i}" for i in range(n)}       # every id exactly once
    m = read_manifest(out)
    assert m["complete"] and m["runs"][0]["status"] == "running" and m["runs"][-1]["status"] == "completed"
    assert m["serve_app"]["name"] == "tiny" and m["config"]["serve_app"] == "tiny"
    assert m["serve_app"]["engine"]["model"] == m["config"]["model"] == m["fingerprint"]["model"]   # the app's model
    assert all(r["preempted_rows"] == 0 for r in m["runs"][1:])    # rows alone fit the KV cache: never preempted
    assert m["prefix_cache"]["prompt_tokens"] > 0                  # from the rows' metrics, as on own replicas

    # a resume through another app (here: one that is not running) is refused, naming the running ones
    other = cfg.model_copy(update={"serve_app": "nightly"})
    res = _drive(cluster, other)
    assert res.returncode == 2 and "no Serve app 'nightly'" in res.stderr and "tiny" in res.stderr, res.stderr
    # ... and so is one through an app that now serves another model (the manifest says what wrote it)
    mf = out / "_manifest.json"
    doc = json.loads(mf.read_text())
    doc["fingerprint"]["model"] = "another-model"
    mf.write_text(json.dumps(doc))
    res = _drive(cluster, cfg)
    assert res.returncode == 2 and "model='another-model'" in res.stderr and "serve app 'tiny' serves" in res.stderr


@pytest.fixture(scope="module")
def fake_app(cluster):
    """The fake engine (tests/cluster/fake_engine.py): `[slow:S]` prompts make rows take their time.
    Returns a function: rows in its engine (Serve's ongoing calls of its one replica)."""
    import ray

    from cluster.config import ServeConfig
    from tests.cluster.conftest import FAKE

    _deploy(ServeConfig(model="fake", engine=FAKE, app_name="orphan-rows", resources_per_rank={"cpu": 0.25},
                        limits={"max_model_len": 256, "max_tokens": 64}))
    engines = [ray.get_actor(a["Name"], namespace="serve") for a in ray._private.state.actors().values()
               if a["ActorClassName"] == "ServeReplica:orphan-rows:LLMServer" and a["State"] == "ALIVE"]
    return lambda: sum(ray.get([h.get_num_ongoing_requests.remote() for h in engines]))


@pytest.mark.slow   # a `ray start` cluster and the job driver in a subprocess
def test_the_rows_of_a_killed_driver_end_in_the_app(tmp_path, cluster, fake_app):
    """Ray does not cancel a call when its caller's process dies: the rows of a driver killed mid-job
    ran on in the app to max_tokens (here 60 steps of 0.5 s). The driver's stand-in actor dies
    with it, and the replica's caller watch ends its rows."""
    from tests.cluster.conftest import wait_for

    inp = write_parquet(tmp_path / "in.parquet", prompt=[f"[slow:0.5] row {i}" for i in range(3)])
    proc = _start(cluster, JobConfig(input=str(inp), serve_app="orphan-rows", max_tokens=60))
    assert wait_for(lambda: fake_app() == 3 or proc.poll() is not None, timeout=120), fake_app()
    assert proc.poll() is None, _finish(proc, 30)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    killed = time.monotonic()
    assert wait_for(lambda: fake_app() == 0, timeout=20), fake_app()     # the watch looks every 2 s
    assert time.monotonic() - killed < 20                                # not the 30 s to max_tokens
    assert not _committed(tmp_path / "in.out")                           # nothing finished: a rerun does all 3


@pytest.mark.slow   # a `ray start` cluster and the job driver in a subprocess
def test_a_stand_in_killed_under_a_live_driver_costs_a_resend_not_a_cut_row(tmp_path, cluster, fake_app):
    """The replicas end the rows of a driver whose stand-in is gone. Under a live driver (its
    stand-in killed by hand, or OOM) those rows came back as if finished: written with the tokens so
    far. Now the cut stream is a lost row: the driver starts another stand-in and sends it again."""
    import ray

    from tests.cluster.conftest import wait_for

    inp = write_parquet(tmp_path / "in.parquet", prompt=[f"[slow:0.2] row {i}" for i in range(4)])
    proc = _start(cluster, JobConfig(input=str(inp), serve_app="orphan-rows", max_tokens=30))

    def stand_ins():
        return [a["Name"] for a in ray._private.state.actors().values()
                if a["Name"].startswith("driver-job-") and a["State"] == "ALIVE"]
    assert wait_for(lambda: (fake_app() == 4 and stand_ins()) or proc.poll() is not None, timeout=120), fake_app()
    assert proc.poll() is None, _finish(proc, 30)
    (first,) = stand_ins()
    ray.kill(ray.get_actor(first, namespace="eagle-serve"))     # the driver's namespace (jobs/app_link.py)
    code, log = _finish(proc, 300)
    assert code == 0, log
    assert "stand-in actor" in log and "is gone: starting another" in log, log
    rows = read_rows(tmp_path / "in.out")
    assert len(rows) == 4 and all(r["completion_tokens"] == 30 and r["finish_reason"] == "length" for r in rows), rows
    assert read_manifest(tmp_path / "in.out")["error_rows"] == 0


def _start(cluster, cfg: JobConfig) -> subprocess.Popen:
    return subprocess.Popen(_driver_args(cluster, cfg), cwd=REPO, env=cluster["env"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err


def _wait_rows(proc: subprocess.Popen, out, parts: int, timeout: float = 300) -> None:
    t0 = time.monotonic()
    while len(_committed(out)) < parts:
        assert proc.poll() is None, _finish(proc, 30)
        assert time.monotonic() - t0 < timeout, "the job does not progress"
        time.sleep(0.05)


# The drivers below run as processes (`python -m jobs.driver`, as `eaglectl submit-job` runs them), not
# in pytest's process: Serve's handles in a process that already talked to another Ray cluster (the
# cluster tests' one) can hang (Ray Serve keeps its router state per process).
@pytest.mark.slow
def test_job_through_the_app_equals_own_replicas_and_online_requests_preempt_it(tmp_path, cluster, tiny_app,
                                                                                 tiny_model):
    import openai
    import ray

    from cluster import backlog
    from jobs.app_link import backlog_key

    n = 40
    inp = write_parquet(tmp_path / "in.parquet", prompt=[_prompt(i) for i in range(n)],
                        max_tokens=[4 + i % 5 for i in range(n)])
    for cfg in (JobConfig(input=str(inp), output=str(tmp_path / "app.out"), serve_app="tiny", max_tokens=8),
                JobConfig(input=str(inp), output=str(tmp_path / "own.out"), model=tiny_model, draft="none",
                          max_model_len=128, max_num_seqs=4, cpus_per_replica=1, max_tokens=8)):
        res = _drive(cluster, cfg)
        assert res.returncode == 0, res.stdout + res.stderr
    via_app, own = read_manifest(tmp_path / "app.out"), read_manifest(tmp_path / "own.out")
    assert via_app["complete"] and own["complete"] and via_app["error_rows"] == own["error_rows"] == 0
    a = {r["id"]: (r["text"], r["completion_tokens"], r["finish_reason"]) for r in read_rows(tmp_path / "app.out")}
    b = {r["id"]: (r["text"], r["completion_tokens"], r["finish_reason"]) for r in read_rows(tmp_path / "own.out")}
    assert len(a) == n and a == b                                    # greedy: the same rows, token for token

    # a long job runs through the app while online requests come over HTTP
    big = write_parquet(tmp_path / "big.parquet", prompt=[_prompt(i) for i in range(5000)])
    out = tmp_path / "big.out"
    proc = _start(cluster, JobConfig(input=str(big), output=str(out), serve_app="tiny", max_tokens=8,
                                     rows_per_file=20, commit_interval_s=1))
    _wait_rows(proc, out, 1)
    client = openai.OpenAI(base_url=tiny_app["url"], api_key="unused", max_retries=0, timeout=300)
    done = []
    for i in range(4):      # each grows to 8 KV blocks (24 + 100 tokens) next to the job's rows: they make room
        r = client.completions.create(model=tiny_model, prompt="the quick brown fox jumps over the dog " + str(i),
                                      max_tokens=100, temperature=0, extra_body={"ignore_eos": True})
        done.append((r.choices[0].finish_reason, r.usage.completion_tokens))
    during = len(pq.read_table(out, columns=["id"]))
    board = backlog.board("tiny", create=False)                      # the job's rows to send, for autoscaling
    assert 0 < ray.get(board.snapshot.remote())[backlog_key(str(out))] <= 5000
    proc.send_signal(signal.SIGTERM)                                 # what `job cancel` does
    code, log = _finish(proc, 120)
    m = read_manifest(out)
    assert backlog_key(str(out)) not in ray.get(board.snapshot.remote())   # cleared when the driver ends
    assert done == [("length", 100)] * 4                             # every online request finished, whole
    assert m["status"] == "cancelled" and m["rows"] >= during >= 20 and m["error_rows"] == 0, (code, log)
    assert m["runs"][-1]["stopped_by"] == "SIGTERM"
    # offline rows gave way: preempted for online requests (row metrics, summed in the manifest; the
    # same job alone never is, see the kill -9 test), or deferred in the engine while an online request
    # got its first token (the app's /metrics)
    metrics = urllib.request.urlopen(tiny_app["url"].removesuffix("/v1") + "/metrics", timeout=60).read().decode()
    preempted, deferred = m["runs"][-1]["preempted_rows"], _metric(metrics, "eagle_replica_offline_deferred_total")
    assert preempted + deferred > 0, (m["runs"][-1], metrics)
    assert "eagle_replica_offline_held_total{" in metrics     # the offline cap's count (background_cap.py)


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in " {")


@pytest.mark.slow
def test_default_model_job_through_the_app_equals_own_replicas(tmp_path, cluster, default_model_dir):
    """gemma-3-270m (its built-in EAGLE head, as `eaglectl serve` runs it by default), greedy: prompt and
    chat rows through the app come out as on the job's own replica, while an online chat request completes."""
    import openai

    from cluster.config import ServeConfig

    app = _deploy(ServeConfig(app_name="gemma", num_replicas=1, resources_per_rank={"cpu": 1},
                              limits={"max_num_seqs": 4}))
    prompts = ["The capital of France is", "def fibonacci(n):", None, "Speculative decoding is", None]
    messages = [None, None, [{"role": "user", "content": "Name three colors."}], None,
                [{"role": "user", "content": "What is 2+2?"}]]
    inp = write_parquet(tmp_path / "in.parquet", id=list(range(len(prompts))), prompt=prompts, messages=messages)
    proc = _start(cluster, JobConfig(input=str(inp), output=str(tmp_path / "app.out"), serve_app=app, max_tokens=12))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster['port']}/gemma/v1", api_key="unused", max_retries=0,
                           timeout=300)
    online = client.chat.completions.create(model="gemma-3-270m", messages=[{"role": "user", "content": "Hi!"}],
                                            max_tokens=8, temperature=0)
    code, log = _finish(proc, 600)
    assert code == 0, log
    res = _drive(cluster, JobConfig(input=str(inp), output=str(tmp_path / "own.out"), max_num_seqs=4,
                                    cpus_per_replica=1, max_tokens=12))
    assert res.returncode == 0, res.stdout + res.stderr
    via_app, own = read_manifest(tmp_path / "app.out"), read_manifest(tmp_path / "own.out")
    assert online.choices[0].finish_reason in ("stop", "length") and online.usage.completion_tokens > 0
    assert via_app["complete"] and own["complete"] and via_app["error_rows"] == own["error_rows"] == 0
    assert via_app["serve_app"]["engine"]["model"] == "gemma-3-270m" and via_app["fingerprint"]["draft"] == "default"
    a = {r["id"]: (r["text"], r["finish_reason"]) for r in read_rows(tmp_path / "app.out")}
    b = {r["id"]: (r["text"], r["finish_reason"]) for r in read_rows(tmp_path / "own.out")}
    assert len(a) == len(prompts) and a == b and all(t for t, _ in a.values())


@pytest.mark.slow
def test_an_app_deleted_mid_job_fails_it_and_a_rerun_resumes_once_it_is_back(tmp_path, cluster, tiny_model):
    from ray import serve

    from cluster.config import ServeConfig

    app_cfg = ServeConfig(model=tiny_model, draft=None, app_name="doomed", num_replicas=1,
                          resources_per_rank={"cpu": 0.5}, limits={"max_model_len": 128, "max_num_seqs": 8})
    _deploy(app_cfg)
    n = 200
    inp = write_parquet(tmp_path / "in.parquet", prompt=[_prompt(i) for i in range(n)])
    out = tmp_path / "in.out"
    cfg = JobConfig(input=str(inp), output=str(out), serve_app="doomed", max_tokens=8, rows_per_file=25,
                    commit_interval_s=1)
    proc = _start(cluster, cfg)
    _wait_rows(proc, out, 2)
    serve.delete("doomed")
    code, log = _finish(proc, 300)
    assert code == 1 and "job failed" in log and "'doomed' is gone" in log, (code, log)
    m = read_manifest(out)
    assert m["status"] == "failed" and 0 < m["rows"] < n and m["error_rows"] == 0, m   # no row became an error

    _deploy(app_cfg)                                                 # the app is back: the same job resumes
    res = _drive(cluster, cfg)
    assert res.returncode == 0, res.stdout + res.stderr
    m = read_manifest(out)
    ids = [r["id"] for r in read_rows(out)]
    assert m["complete"] and m["error_rows"] == 0 and len(ids) == n and len(set(ids)) == n
    serve.delete("doomed")


@pytest.mark.slow
def test_submit_job_serve_app_on_the_cluster_cancel_status_and_resume(tmp_path, cluster, tiny_app):
    """`eaglectl submit-job --serve-app --address`: the driver is a Ray job on the app's cluster;
    `job cancel` stops it (committed rows kept, backlog cleared), submitting again finishes it."""
    import ray

    from cluster import backlog
    from jobs.app_link import backlog_key

    n = 240
    inp = write_parquet(tmp_path / "in.parquet", prompt=[_prompt(i) for i in range(n)])
    out = tmp_path / "in.out"
    args = ["submit-job", inp, "--serve-app", "tiny", "--max-tokens", "8", "--rows-per-file", "25",
            "--address", cluster["dashboard"]]
    res = cli(*args, "--job-id", "app-job-1", "--no-wait", env=cluster["env"], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    t0 = time.monotonic()
    while len(_committed(out)) < 2:
        assert time.monotonic() - t0 < 300, "no progress"
        time.sleep(0.1)
    res = cli("job", "cancel", "app-job-1", "--address", cluster["dashboard"], env=cluster["env"], timeout=60)
    assert res.returncode == 0 and "stopping" in res.stdout, res.stdout + res.stderr
    res = cli("job", "status", "app-job-1", "--address", cluster["dashboard"], "--follow", env=cluster["env"],
              timeout=300)
    assert "app-job-1: STOPPED" in res.stdout, res.stdout + res.stderr
    m = read_manifest(out)
    assert m["status"] == "cancelled" and 0 < m["rows"] < n and m["config"]["serve_app"] == "tiny", m["status"]
    board = backlog.board("tiny", create=False)
    assert backlog_key(str(out)) not in ray.get(board.snapshot.remote())   # the driver cleared its backlog

    res = cli(*args, "--job-id", "app-job-2", env=cluster["env"], timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"job completed: {n}/{n} rows" in res.stdout and "app-job-2: SUCCEEDED" in res.stdout
    ids = pq.read_table(out, columns=["id"]).column("id").to_pylist()
    assert len(ids) == n and set(ids) == {f"in.parquet:{i}" for i in range(n)}
    status = cli("job", "status", "app-job-2", "--address", cluster["dashboard"], env=cluster["env"], timeout=60)
    assert "app-job-2: SUCCEEDED" in status.stdout and f"{n}/{n} rows" in status.stdout, status.stdout
