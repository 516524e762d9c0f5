"""`--address` takes what Ray takes (resolved by Ray's JobSubmissionClient) and every failure to reach
or authenticate answers one line that says what to set (issue 25, item 5).

The cluster is `tests.ray_cluster.LocalCluster`: `ray start` with token auth and random (non-default)
GCS and dashboard ports, so nothing can work by guessing port 8265 or 6379."""
from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest

from jobs import ray_jobs
from tests.ray_cluster import LocalCluster, free_ports

from .conftest import cli, write_parquet


def _one_line_answer(res) -> str:
    """The CLI's answer to a connection failure: exit 1, one line, no traceback (Ray's own C++
    warnings may precede it on stderr)."""
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") or "Ray cluster" in last, res.stderr
    return last


def test_unreachable_dashboard_is_one_line_connection_error():
    port = free_ports(1)[0]
    with pytest.raises(ConnectionError) as e:
        ray_jobs.list_jobs(f"http://127.0.0.1:{port}")
    msg = str(e.value)
    assert "\n" not in msg and f"127.0.0.1:{port}" in msg and "head:6379" in msg and "http://head:8265" in msg


def test_a_gcs_address_where_nothing_listens_fails_at_once():
    """Ray's client would wait ~40 s for a GCS that is not there; a refused connect answers now."""
    import time

    port = free_ports(1)[0]
    t0 = time.monotonic()
    with pytest.raises(ConnectionError) as e:
        ray_jobs.client(f"127.0.0.1:{port}")
    assert time.monotonic() - t0 < 10 and f"Connection refused at 127.0.0.1:{port}" in str(e.value)


def test_a_ray_client_address_where_nothing_listens_fails_at_once():
    import time

    port = free_ports(1)[0]
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"Connection refused at ray://127.0.0.1:{port}"):
        ray_jobs.client(f"ray://127.0.0.1:{port}")
    assert time.monotonic() - t0 < 10


def test_a_port_that_answers_http_but_is_no_dashboard_fails_at_once():
    """Serve's HTTP port given by mistake: Ray would wait ~40 s for a GCS there."""
    import http.server
    import threading
    import time

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError) as e:
            ray_jobs.client(f"127.0.0.1:{server.server_port}")
        assert time.monotonic() - t0 < 10 and "answers HTTP (status 404) but is neither a Ray dashboard" in str(e.value)
        assert "\n" not in str(e.value)
    finally:
        server.shutdown()


class _RawServer:
    """A TCP port that answers each connection with fixed bytes (then closes): an SSH banner, a
    database, or a gRPC server's first SETTINGS frame."""

    def __init__(self, answer: bytes):
        import socket
        import threading

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.answer = answer
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.sendall(self.answer)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.sock.close()


@pytest.mark.parametrize("answer, said", [(b"SSH-2.0-OpenSSH_9.6\r\n", "it said b'SSH-2.0-OpenSSH_9.6"),
                                          (b"", "closed the connection without a word")])
def test_a_port_that_answers_but_speaks_no_grpc_fails_at_once(answer, said):
    """An SSH or database port given by mistake: a TCP connect succeeds, and Ray would then wait ~40 s
    (the Jobs client) or minutes (ray.init) for a GCS there."""
    import time

    with _RawServer(answer) as server:
        for address in (f"127.0.0.1:{server.port}", f"ray://127.0.0.1:{server.port}"):
            t0 = time.monotonic()
            with pytest.raises(ConnectionError) as e:
                ray_jobs.client(address)
            assert time.monotonic() - t0 < 10 and f"{address} answers, but not as a Ray cluster" in str(e.value)
            assert said in str(e.value) and "\n" not in str(e.value)


def test_a_port_that_answers_as_grpc_passes_the_probe():
    """The first bytes a gRPC server (Ray's GCS) sends: a SETTINGS frame on stream 0."""
    from cluster.ray_address import check_speaks_grpc

    settings = b"\x00\x00\x06\x04\x00\x00\x00\x00\x00" + b"\x00\x04\x00\x40\x00\x00"
    with _RawServer(settings) as server:
        check_speaks_grpc(f"127.0.0.1:{server.port}")
    with _RawServer(b"\x00\x00\x06\x04\x00\x00\x00\x00\x01" + b"\x00" * 6) as server:   # not stream 0
        with pytest.raises(ConnectionError):
            check_speaks_grpc(f"127.0.0.1:{server.port}")


def test_malformed_address_is_one_line_connection_error():
    with pytest.raises(ConnectionError) as e:
        ray_jobs.client("no-port-here")
    assert "\n" not in str(e.value) and "'no-port-here'" in str(e.value) and "ray://head:10001" in str(e.value)


def test_auth_messages_say_what_to_set(monkeypatch):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    msg = ray_jobs.auth_message("h:1", "Authentication token is missing or incorrect")
    assert "RAY_AUTH_MODE=(unset)" in msg and "set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN" in msg and "\n" not in msg
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    msg = ray_jobs.auth_message("h:1", "Forbidden: Invalid authentication token")
    assert "refused the token" in msg and "set RAY_AUTH_TOKEN" in msg and "RAY_AUTH_MODE=" not in msg


@pytest.fixture(scope="module")
def token_cluster():
    with LocalCluster(node_cpus=(2,), dashboard=True) as c:
        yield c


@pytest.mark.slow  # a `ray start` cluster and CLI subprocesses
def test_submit_with_a_gcs_address_on_non_default_ports(tmp_path, tiny_model, token_cluster):
    c = token_cluster
    gcs_port, dash_port = int(c.gcs.rpartition(":")[2]), int(c.dashboard_address.rpartition(":")[2])
    assert {gcs_port, dash_port}.isdisjoint({6379, 8265})
    inp = write_parquet(tmp_path / "in.parquet", prompt=[f"hello {i}" for i in range(6)])
    env = {**c.env, "RAY_ADDRESS": "127.0.0.1:1"}   # an explicit --address wins over RAY_ADDRESS
    res = cli("submit-job", inp, "--model", tiny_model, "--draft", "none", "--max-tokens", "4", "--replicas", "1",
              "--cpus-per-replica", "1", "--address", c.gcs, "--job-id", "gcs-address-job", "--wait",
              env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert c.dashboard_address in res.stdout        # Ray found the dashboard through the GCS
    assert len(pq.read_table(tmp_path / "in.out", columns=["id"])) == 6

    # the GCS, the dashboard URL, and the dashboard's host:port without a scheme (worked before: kept)
    for address in (c.gcs, c.dashboard_address, c.dashboard_address + "/", c.dashboard_address.removeprefix("http://")):
        listed = cli("job", "list", "--address", address, env=c.env, timeout=120)
        assert listed.returncode == 0 and "gcs-address-job\tSUCCEEDED" in listed.stdout, listed.stderr


@pytest.mark.slow
@pytest.mark.parametrize("how", ["gcs", "dashboard"])
@pytest.mark.parametrize("mode", ["disabled", None])   # None: RAY_AUTH_MODE not set at all (the case)
def test_client_without_token_auth_gets_one_line_saying_what_to_set(token_cluster, how, mode):
    c = token_cluster
    address = c.gcs if how == "gcs" else c.dashboard_address
    env = {k: v for k, v in c.env.items() if k != "RAY_AUTH_MODE"}
    if mode:
        env["RAY_AUTH_MODE"] = mode
    last = _one_line_answer(cli("job", "list", "--address", address, env=env, timeout=120))
    assert f"RAY_AUTH_MODE={mode or '(unset)'}" in last and "set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN" in last, last


@pytest.mark.slow
@pytest.mark.parametrize("how", ["gcs", "dashboard"])
def test_client_with_a_wrong_token_gets_one_line_saying_what_to_set(token_cluster, how):
    c = token_cluster
    address = c.gcs if how == "gcs" else c.dashboard_address
    env = {**c.env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 32}
    last = _one_line_answer(cli("job", "list", "--address", address, env=env, timeout=120))
    assert "refused the token" in last and "set RAY_AUTH_TOKEN" in last, last


def test_explicit_address_is_not_overridden_by_ray_address(monkeypatch):
    """Ray's resolver lets RAY_ADDRESS override its argument; ours restores the variable after."""
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    port = free_ports(1)[0]
    with pytest.raises(ConnectionError) as e:
        ray_jobs.client(f"http://127.0.0.1:{port}")
    assert f"Failed to connect to Ray at address: http://127.0.0.1:{port}" in str(e.value)   # not the GCS at :1
    assert os.environ["RAY_ADDRESS"] == "127.0.0.1:1"


@pytest.mark.parametrize("status, driver_code, log, code", [
    ("SUCCEEDED", 0, "job completed: 10/10 rows", 0),
    ("SUCCEEDED", 0, "eagle-job: completed with error rows (exit code 3; ...)", 3),
    ("FAILED", 2, "error: no Serve app 'tiny' runs on this Ray cluster", 2),   # bad input or settings
    ("FAILED", 1, "error: job failed: ...", 1),
    ("FAILED", None, "", 1),                          # the driver never ran (Ray could not start it)
    ("FAILED", -9, "", 1),                            # killed: no code of the table
    ("STOPPED", None, "", 130),                       # `eaglectl job cancel`
    ("STOPPED", 130, "", 130),
])
def test_submit_wait_exits_with_the_drivers_code(monkeypatch, tmp_path, status, driver_code, log, code):
    """`submit-job --address ... --wait` follows the exit-code table of a job run here: the Ray job's
    status and the driver's exit code decide it, not SUCCEEDED-or-1."""
    from click.testing import CliRunner

    from eaglectl.jobs import submit_job

    monkeypatch.setattr(ray_jobs, "submit", lambda address, cfg, job_id: "eagle-x-1")
    monkeypatch.setattr(ray_jobs, "jobs_address", lambda address: address)
    monkeypatch.setattr(ray_jobs, "tail_logs", lambda address, jid, echo: echo(log + "\n"))
    monkeypatch.setattr(ray_jobs, "wait", lambda address, jid, poll_s: {
        "job_id": jid, "status": status, "message": "", "driver_exit_code": driver_code})
    monkeypatch.setattr(ray_jobs, "logs", lambda address, jid: log)
    res = CliRunner().invoke(submit_job, [str(tmp_path / "in.parquet"), "--address", "http://127.0.0.1:9"])
    assert res.exit_code == code, res.output
    assert f"job eagle-x-1: {status}" in res.output


@pytest.mark.parametrize("args", [["status", "a/b"], ["status", ""], ["logs", "../version"], ["cancel", "x#frag"],
                                  ["status", "a" * 300], ["logs", "x?y=1"]])
def test_job_ids_that_cannot_be_submission_ids_are_refused_before_any_call(args):
    """They travel in the Jobs API's URL paths: `..` or `?` reached other routes or another job, a
    300-character name was an OSError traceback."""
    from click.testing import CliRunner

    from eaglectl.jobs import job

    res = CliRunner().invoke(job, [*args, "--address", "http://127.0.0.1:9"])
    assert res.exit_code == 2 and "is not a job id" in res.output and "Traceback" not in res.output, res.output


@pytest.mark.parametrize("job_id, needle", [("a/b", "is not a job id"), ("", "is not a job id"),
                                            ("taken", "a job with id taken already exists on the cluster")])
def test_submit_refuses_a_bad_or_taken_job_id_in_one_line(monkeypatch, tmp_path, job_id, needle):
    from click.testing import CliRunner

    from eaglectl.jobs import submit_job

    class Client:
        def submit_job(self, **kw):      # what the Jobs API's 500 carries for a taken id
            raise RuntimeError("Request failed with status code 500: Traceback ... ValueError: Job with "
                               f"submission_id {kw['submission_id']} already exists. Please use a different submission_id.")

    monkeypatch.setattr(ray_jobs, "client", lambda address: Client())
    inp = write_parquet(tmp_path / "in.parquet", prompt=["a"])
    res = CliRunner().invoke(submit_job, [str(inp), "--address", "http://127.0.0.1:9", "--job-id", job_id])
    assert res.exit_code == 2 and needle in res.output and "Traceback" not in res.output, res.output
    res = CliRunner().invoke(submit_job, [str(inp), "--job-id", "x"], env={"RAY_ADDRESS": ""})
    assert res.exit_code == 2 and "--job-id names a job submitted to a cluster" in res.output


@pytest.mark.parametrize("args", [["status", "j-1", "--follow"], ["logs", "j-1", "--follow"]])
def test_ctrl_c_while_following_exits_130_and_the_job_goes_on(monkeypatch, args):
    from click.testing import CliRunner

    from eaglectl.jobs import job

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(ray_jobs, "wait", interrupted)
    monkeypatch.setattr(ray_jobs, "tail_logs", interrupted)
    res = CliRunner().invoke(job, [*args, "--address", "http://127.0.0.1:9"])
    assert res.exit_code == 130 and "stopped following; job j-1 keeps running" in res.output, res.output
