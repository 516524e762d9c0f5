"""Cluster fixtures: one local Ray cluster and one Serve HTTP proxy per session, apps per module.

Workers import `tests.cluster.fake_engine` and `cluster`, so the repo root goes on PYTHONPATH before
Ray starts (workers inherit the driver's environment). Serve's HTTP options are fixed per cluster,
hence one proxy port for the session; each module deploys its apps and deletes them afterwards.
"""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from cluster.local_ray import StartedRay

REPO = Path(__file__).resolve().parents[2]
FAKE = "tests.cluster.fake_engine"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # logical CPUs: test replicas reserve fractions of the 2 real cores
    _RAY.start(num_cpus=8, include_dashboard=False, namespace="eagle-tests", log_to_driver=False)
    yield ray
    _shutdown()


_RAY = StartedRay()


def _shutdown() -> None:
    """Stop the cluster we started (other test folders start their own Ray with other settings)."""
    _RAY.shutdown()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    here = Path(__file__).parent
    if nextitem is None or here not in Path(str(nextitem.path)).parents:
        _shutdown()  # the last cluster test: module fixtures are gone, now the cluster goes too
    return result


@pytest.fixture(scope="session")
def serve_port(ray_cluster) -> int:
    from ray import serve

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


class Deployed:
    """A running app: its base URL and an OpenAI client pointed at it."""

    def __init__(self, config, port: int, prefix: str):
        import openai

        self.config = config
        self.url = f"http://127.0.0.1:{port}{prefix.rstrip('/')}"
        key = config.api_keys[0] if config.api_keys else "unused"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def deploy(serve_port):
    """deploy(config, prefix="/") -> Deployed; every app is deleted when the module ends."""
    from ray import serve

    from cluster.serve_app import deploy_app

    names: list[str] = []

    def _deploy(config, prefix: str = "/") -> Deployed:
        deploy_app(config, prefix)
        names.append(config.app_name)
        return Deployed(config, serve_port, prefix)

    yield _deploy
    for name in names:          # all at once, then one short poll: a blocking delete each waits ~3 s
        serve.delete(name, _blocking=False)
    assert wait_for(lambda: not set(names) & set(serve.status().applications), timeout=120), f"{names} not deleted"


def wait_for(pred, timeout: float = 60.0, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return False


def server_up(proc, url: str, timeout: float) -> bool:
    """Wait until the server subprocess `proc` answers `url`/health with 200; its output if it exits first."""
    import requests

    def up():
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        try:
            return requests.get(f"{url}/health", timeout=15).status_code == 200
        except requests.RequestException:
            return False
    return wait_for(up, timeout=timeout, interval=1)


def pytest_configure(config):
    # Ray Serve's own pydantic models trip pydantic's deprecation warnings; not ours to fix.
    config.addinivalue_line("filterwarnings", "ignore:Using extra keyword arguments on `Field`")
