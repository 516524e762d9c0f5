"""Jobs on a Ray cluster through the Ray Jobs API: submit, follow, list, logs, cancel.

Why the Jobs API: the driver then runs on the cluster (head node), so the job survives the client
closing its laptop, and Ray keeps its logs and status. The entrypoint is
`python -m jobs.driver --config-json ...` (jobs/driver.py: the cluster needs no CLI) with the fully
resolved JobConfig (absolute paths, which must be valid on the cluster: a shared filesystem or paths
on the head node); it connects to the cluster with `RAY_ADDRESS`, which Ray sets for job drivers.

Addresses: whatever Ray accepts, resolved by Ray's own `JobSubmissionClient` (no guessing here): a
GCS address `head:6379` (any port: Ray asks the GCS where the dashboard is), the dashboard
`http://head:8265`, a Ray Client address `ray://head:10001`, or `auto` (RAY_ADDRESS, else the
cluster started on this machine). An explicit address wins over `RAY_ADDRESS` (Ray itself would
let the variable override it). One exception kept from before, checked rather than guessed:
`host:port` without a scheme that answers as a Ray dashboard is used as one (Ray would take it for
a GCS address and time out). Every failure to reach or authenticate with the cluster is a
`ConnectionError` whose message is one line saying what to set (eaglectl prints it as is).
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import threading
import time
import uuid
from contextlib import contextmanager

from cluster.ray_address import check_listening, check_speaks_grpc
from jobs.job_config import JobConfig

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
JOB_PYTHON_ENV = "EAGLE_JOB_PYTHON"   # interpreter for the entrypoint on the cluster (default: python)
ADDRESS_FORMS = "host:GCS-port (head:6379), the dashboard http://head:8265, ray://head:10001 or auto"
_ADDRESS_ENV = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")  # Ray lets these override an explicit address
_clients: dict[str, object] = {}
_lock = threading.Lock()


def client(address: str):
    """Ray's JobSubmissionClient for `address` (one per address and process: resolving a GCS address
    asks the cluster, so `wait`'s polling must not redo it)."""
    address = address.strip()
    with _lock:
        if address not in _clients:
            _clients[address] = _connect(address)
        return _clients[address]


def jobs_address(address: str) -> str:
    """The Jobs API (dashboard) URL Ray resolved for `address` (connects to the cluster)."""
    return client(address).get_address()


@contextmanager
def _explicit(address: str):
    saved = {} if address == "auto" else {k: os.environ.pop(k) for k in _ADDRESS_ENV if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _connect(address: str):
    from ray.exceptions import AuthenticationError, RayError
    from ray.job_submission import JobSubmissionClient

    try:
        check_listening(address)
        url = _dashboard_url(address)
        if url is None:
            check_speaks_grpc(address)
        with _explicit(address):
            return JobSubmissionClient(url or address)
    except AuthenticationError as e:
        raise ConnectionError(auth_message(address, str(e))) from None
    except (ConnectionError, RayError, RuntimeError, ValueError, OSError) as e:
        raise ConnectionError(reach_message(address, e)) from None


def _dashboard_url(address: str) -> str | None:
    """`http://host:port` when `host:port` (no scheme) is a Ray dashboard: it answers Ray's public
    `/api/authentication_mode` (a GCS port does not speak HTTP/1.1 and fails at once). A port that
    answers HTTP but not as a dashboard (Serve's, a web server) is no GCS either: ConnectionError now,
    not after Ray's 40 s wait for a GCS there."""
    import requests

    if "://" in address or ":" not in address:
        return None
    url = f"http://{address}"
    try:
        r = requests.get(f"{url}/api/authentication_mode", timeout=2)
    except requests.RequestException:
        return None
    if r.status_code == 200 and "authentication_mode" in r.text:
        return url
    raise ConnectionError(f"{address} answers HTTP (status {r.status_code}) but is neither a Ray dashboard nor a "
                          "GCS port (Serve's HTTP port? the dashboard is usually :8265, the GCS :6379)")


def _first_line(text: str) -> str:
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), "").rstrip(".")


def auth_message(address: str, detail: str = "") -> str:
    """One line: what to set when the cluster refuses this client (Ray token authentication)."""
    mode = os.environ.get("RAY_AUTH_MODE", "").strip().lower()
    if mode != "token":
        return (f"the Ray cluster at {address} requires token authentication and this client has "
                f"RAY_AUTH_MODE={mode or '(unset)'}: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN to the cluster's token "
                "(or RAY_AUTH_TOKEN_PATH to a file holding it; `ray get-auth-token` on the head prints it)")
    why = "it has no token" if "missing" in detail.lower() and "incorrect" not in detail.lower() else "it refused the token"
    return (f"the Ray cluster at {address} requires token authentication and {why}: set RAY_AUTH_TOKEN to the "
            "cluster's token (or RAY_AUTH_TOKEN_PATH to a file holding it, default ~/.ray/auth_token; "
            "`ray get-auth-token` on the head prints it)")


def reach_message(address: str, err: BaseException) -> str:
    """One line: the address could not be resolved or reached, and which forms Ray accepts."""
    detail = _first_line(str(err)) or type(err).__name__
    return (f"cannot reach the Ray cluster at {address!r}: {detail}; --address / RAY_ADDRESS takes "
            f"{ADDRESS_FORMS}, and the cluster must be running")


def _call(address: str, fn, *args, **kwargs):
    """A Jobs API call; losing the cluster or its authentication mid-way is a ConnectionError too."""
    import aiohttp
    import requests
    from ray.exceptions import AuthenticationError

    try:
        return fn(*args, **kwargs)
    except AuthenticationError as e:
        raise ConnectionError(auth_message(address, str(e))) from None
    except (requests.exceptions.ConnectionError, aiohttp.ClientConnectionError) as e:
        raise ConnectionError(reach_message(address, e)) from None


JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_job_id(job_id: str) -> None:
    """ValueError unless `job_id` can be a submission id: it travels in the Jobs API's URL paths and
    names the driver's log file (`a/b` made a job no call could reach, `..` another route)."""
    if not JOB_ID.fullmatch(job_id):
        raise ValueError(f"{job_id[:80]!r} is not a job id: letters, digits, '.', '_' and '-', starting "
                         "with a letter or digit, at most 128 characters")


def entrypoint(cfg: JobConfig) -> str:
    python = os.environ.get(JOB_PYTHON_ENV, "python")
    return f"{python} -m jobs.driver --config-json {shlex.quote(cfg.model_dump_json(exclude_none=True))}"


def submit(address: str, cfg: JobConfig, job_id: str | None = None) -> str:
    """Submit the job; returns its submission id."""
    if job_id is not None:
        check_job_id(job_id)
    c = client(address)
    name = os.path.basename(cfg.input.rstrip("/")) or "job"
    job_id = job_id or f"eagle-{_slug(name)}-{uuid.uuid4().hex[:6]}"
    env = {k: os.environ[k] for k in ("RAY_AUTH_MODE", JOB_PYTHON_ENV) if k in os.environ}
    try:
        return _call(address, c.submit_job,
            entrypoint=entrypoint(cfg), submission_id=job_id, entrypoint_num_cpus=0,
            metadata={"eagle_job": "1", "input": cfg.input, "output": cfg.output or "",
                      **({"serve_app": cfg.serve_app} if cfg.serve_app else {"model": cfg.model})},
            runtime_env={"env_vars": env} if env else None,
        )
    except RuntimeError as e:     # the Jobs API's 500 wraps the reason deep in a traceback
        if "already exists" in str(e):
            raise ValueError(f"a job with id {job_id} already exists on the cluster; choose another --job-id "
                             "(or none for a generated one)") from None
        raise


def _slug(s: str) -> str:
    keep = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in s)
    return keep.strip("-")[:40] or "job"


def info(address: str, job_id: str) -> dict:
    d = _call(address, client(address).get_job_info, job_id)
    return {"job_id": d.submission_id or d.job_id, "status": str(getattr(d.status, "value", d.status)),
            "message": d.message, "entrypoint": d.entrypoint, "start_time": d.start_time,
            "end_time": d.end_time, "metadata": d.metadata or {}, "driver_exit_code": d.driver_exit_code}


def list_jobs(address: str) -> list[dict]:
    out = []
    for d in _call(address, client(address).list_jobs):
        out.append({"job_id": d.submission_id or d.job_id, "status": str(getattr(d.status, "value", d.status)),
                    "start_time": d.start_time, "end_time": d.end_time, "metadata": d.metadata or {},
                    "entrypoint": d.entrypoint})
    return sorted(out, key=lambda j: j["start_time"] or 0)


def logs(address: str, job_id: str) -> str:
    return _call(address, client(address).get_job_logs, job_id)


def tail_logs(address: str, job_id: str, echo) -> None:
    """Stream the job's logs to `echo` until the job ends."""
    c = client(address)

    async def run():
        async for chunk in c.tail_job_logs(job_id):
            echo(chunk)
    _call(address, asyncio.run, run())


def wait(address: str, job_id: str, poll_s: float = 2.0, on_change=None, timeout_s: float | None = None) -> dict:
    """Poll until the job is in a terminal state; `on_change(info)` on each status change."""
    last, t0 = None, time.monotonic()
    while True:
        st = info(address, job_id)
        if st["status"] != last:
            last = st["status"]
            if on_change:
                on_change(st)
        if st["status"] in TERMINAL:
            return st
        if timeout_s is not None and time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"job {job_id} still {st['status']} after {timeout_s:.0f}s")
        time.sleep(poll_s)


def exit_code(st: dict) -> int:
    """The exit code (jobs/driver.py's table) of a finished job, from its `info`: STOPPED (`job cancel`)
    is 130; FAILED is the driver's own code where Ray knows it (2: bad input or settings, nothing
    generated; 130: cancelled), else 1. SUCCEEDED is 0 (3 when its log holds RESULT_MARKER: the caller
    reads the log)."""
    from jobs.driver import EXIT_CANCELLED, EXIT_FAILED, EXIT_OK, EXIT_USAGE

    if st["status"] == "SUCCEEDED":
        return EXIT_OK
    if st["status"] == "STOPPED":
        return EXIT_CANCELLED
    code = st.get("driver_exit_code")
    return code if code in (EXIT_USAGE, EXIT_CANCELLED) else EXIT_FAILED


def stop(address: str, job_id: str) -> bool:
    return _call(address, client(address).stop_job, job_id)


def dumps(obj) -> str:
    return json.dumps(obj, indent=2, default=str)
