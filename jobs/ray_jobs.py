"""Jobs on a Ray cluster through the Ray Jobs API: submit, follow, list, logs, cancel.

Why the Jobs API: the driver then runs on the cluster (head node), so the job survives the client
closing its laptop, and Ray keeps its logs and status. The entrypoint is
`python -m jobs.driver --config-json ...` (jobs/driver.py: the cluster needs no CLI) with the fully
resolved JobConfig (absolute paths, which must be valid on the cluster: a shared filesystem or paths
on the head node); it connects to the cluster with `RAY_ADDRESS`, which Ray sets for job drivers.

Addresses: the Jobs API talks to the dashboard (`http://head:8265`). A GCS address
(`head:6379`) or a Ray Client address (`ray://head:10001`) is mapped to the dashboard on the same
host, the way users tend to pass whatever address they have at hand.
"""
from __future__ import annotations

import asyncio
import json
import os
import shlex
import time
import uuid
from urllib.parse import urlsplit

from jobs.job_config import JobConfig

DASHBOARD_PORT = 8265
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
JOB_PYTHON_ENV = "EAGLE_JOB_PYTHON"   # interpreter for the entrypoint on the cluster (default: python)


def jobs_address(address: str) -> str:
    """The Jobs API (dashboard) URL for whatever Ray address the user gave."""
    address = address.strip()
    if address == "auto":
        return f"http://127.0.0.1:{DASHBOARD_PORT}"
    if address.startswith(("http://", "https://")):
        return address.rstrip("/")
    if address.startswith("ray://"):
        return f"http://{urlsplit(address).hostname}:{DASHBOARD_PORT}"
    host, _, port = address.rpartition(":")
    if not host:
        return f"http://{address}:{DASHBOARD_PORT}"
    if port in ("6379", "10001"):   # GCS / Ray Client port: the dashboard is on the same host
        return f"http://{host}:{DASHBOARD_PORT}"
    return f"http://{address}"


def client(address: str):
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(jobs_address(address))
    except (ConnectionError, RuntimeError) as e:
        raise ConnectionError(f"cannot reach the Ray Jobs API at {jobs_address(address)} "
                              f"(from address {address!r}): {e}") from None


def entrypoint(cfg: JobConfig) -> str:
    python = os.environ.get(JOB_PYTHON_ENV, "python")
    return f"{python} -m jobs.driver --config-json {shlex.quote(cfg.model_dump_json(exclude_none=True))}"


def submit(address: str, cfg: JobConfig, job_id: str | None = None) -> str:
    """Submit the job; returns its submission id."""
    c = client(address)
    name = os.path.basename(cfg.input.rstrip("/")) or "job"
    job_id = job_id or f"eagle-{_slug(name)}-{uuid.uuid4().hex[:6]}"
    env = {k: os.environ[k] for k in ("RAY_AUTH_MODE", JOB_PYTHON_ENV) if k in os.environ}
    return c.submit_job(
        entrypoint=entrypoint(cfg), submission_id=job_id, entrypoint_num_cpus=0,
        metadata={"eagle_job": "1", "input": cfg.input, "output": cfg.output or "", "model": cfg.model},
        runtime_env={"env_vars": env} if env else None,
    )


def _slug(s: str) -> str:
    keep = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in s)
    return keep.strip("-")[:40] or "job"


def info(address: str, job_id: str) -> dict:
    d = client(address).get_job_info(job_id)
    return {"job_id": d.submission_id or d.job_id, "status": str(getattr(d.status, "value", d.status)),
            "message": d.message, "entrypoint": d.entrypoint, "start_time": d.start_time,
            "end_time": d.end_time, "metadata": d.metadata or {}, "driver_exit_code": d.driver_exit_code}


def list_jobs(address: str) -> list[dict]:
    out = []
    for d in client(address).list_jobs():
        out.append({"job_id": d.submission_id or d.job_id, "status": str(getattr(d.status, "value", d.status)),
                    "start_time": d.start_time, "end_time": d.end_time, "metadata": d.metadata or {},
                    "entrypoint": d.entrypoint})
    return sorted(out, key=lambda j: j["start_time"] or 0)


def logs(address: str, job_id: str) -> str:
    return client(address).get_job_logs(job_id)


def tail_logs(address: str, job_id: str, echo) -> None:
    """Stream the job's logs to `echo` until the job ends."""
    c = client(address)

    async def run():
        async for chunk in c.tail_job_logs(job_id):
            echo(chunk)
    asyncio.run(run())


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


def stop(address: str, job_id: str) -> bool:
    return client(address).stop_job(job_id)


def dumps(obj) -> str:
    return json.dumps(obj, indent=2, default=str)
