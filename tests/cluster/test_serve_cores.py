"""Replicas use their cores, and a config the cluster cannot hold fails at once: `run_serve` / `eaglectl
serve` in their own process and their own small local Ray cluster (every wait bounded by a timeout,
so a server that waits forever for resources fails the test instead of hanging it)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest
import requests

from cluster.cpu_threads import usable_cores
from tests.cluster.conftest import FAKE, REPO, _free_port, server_up, wait_for

pytestmark = pytest.mark.slow


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    env.pop("RAY_ADDRESS", None)
    return env


def test_cpu_2_on_a_2_cpu_cluster_starts_and_asking_for_more_fails_at_once(tmp_path):
    """...and a second server on the same cluster (same app name, another app on route /, another port)
    is refused without touching the first."""
    port = _free_port()
    script = textwrap.dedent(f"""
        import ray
        from ray import serve
        from cluster.config import ServeConfig
        from cluster.placement import InsufficientResourcesError
        from cluster.serve_app import run_serve
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        base = dict(model="fake", engine={FAKE!r}, port={port}, limits={{"max_model_len": 256, "max_tokens": 32}})
        for too_much in (dict(resources_per_rank={{"cpu": 3}}),
                         dict(resources_per_rank={{"cpu": 2}}, ingress={{"num_cpus": 0.5}}),
                         dict(num_replicas=3)):
            try:
                run_serve(ServeConfig(**base, **too_much), blocking=False)
                print("STARTED ANYWAY", too_much, flush=True)
            except InsufficientResourcesError as e:
                print("REFUSED:", e, flush=True)
        url = run_serve(ServeConfig(**base, resources_per_rank={{"cpu": 2}}), blocking=False)
        stats = serve.get_deployment_handle("LLMServer", app_name="eagle").stats.remote().result(timeout_s=120)
        print("THREADS", stats["torch_threads"], "CPU", stats["cpu_reserved"], flush=True)
        import requests
        r = requests.post(url + "/v1/completions", json={{"model": "fake", "prompt": "hi", "max_tokens": 3}}, timeout=120)
        print("HTTP", r.status_code, r.json()["usage"]["completion_tokens"], flush=True)
        from cluster.config_base import ConfigError
        for other in (dict(), dict(app_name="other")):          # a second server never takes this one over
            try:
                run_serve(ServeConfig(**base, resources_per_rank={{"cpu": 2}}, **other), blocking=False)
                print("TOOK OVER", other, flush=True)
            except ConfigError as e:
                print("REFUSED SECOND:", e, flush=True)
        r = requests.post(url + "/v1/completions", json={{"model": "fake", "prompt": "hi", "max_tokens": 3}}, timeout=120)
        print("STILL SERVING", r.status_code, flush=True)
        serve.delete("eagle")
        try:
            run_serve(ServeConfig(**{{**base, "port": {port} + 1}}), blocking=False)
            print("TOOK OVER port", flush=True)
        except ConfigError as e:
            print("REFUSED SECOND:", e, flush=True)
        serve.shutdown()
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=_env(), text=True, capture_output=True,
                         timeout=400).stdout
    refused = [line for line in out.splitlines() if line.startswith("REFUSED:")]
    assert "STARTED ANYWAY" not in out and len(refused) == 3, out[-4000:]
    assert "missing CPU 1 overall" in refused[0] and "resources_per_rank.threads" in refused[0]
    assert "CPU 2.5" in refused[1] and "missing CPU 0.5" in refused[1]
    assert "starts 3 replica(s)" in refused[2]
    assert f"THREADS {usable_cores()} CPU 2.0" in out and "HTTP 200 3" in out, out[-4000:]
    second = [line for line in out.splitlines() if line.startswith("REFUSED SECOND:")]
    assert "TOOK OVER" not in out and len(second) == 3 and "STILL SERVING 200" in out, out[-4000:]
    assert "an app named 'eagle' is already running" in second[0]
    assert "app 'eagle' already serves route /" in second[1]
    assert f"already listens on port {port}" in second[2] and f"not {port + 1}" in second[2]


def test_eaglectl_serve_without_a_config_runs_one_replica_on_every_core(tmp_path):
    """The laptop case: `eaglectl serve` alone (the real default model), asked through /metrics."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "eaglectl.main", "serve", "--port", str(port)], cwd=REPO,
                            env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        assert server_up(proc, url, timeout=400), "server did not come up"
        r = requests.post(f"{url}/v1/completions", json={"model": "gemma-3-270m", "prompt": "Hi", "max_tokens": 2},
                          timeout=300)
        assert r.status_code == 200, r.text
        threads: list[str] = []

        def scraped():
            threads[:] = re.findall(r"^eagle_replica_torch_threads{[^}]*} (\S+)$",
                                    requests.get(f"{url}/metrics", timeout=30).text, re.M)
            return bool(threads)
        assert wait_for(scraped, timeout=60)
        assert [float(t) for t in threads] == [float(usable_cores())]     # one replica, every core
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def test_eaglectl_serve_says_what_is_missing_and_exits(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: fake\nengine: {FAKE}\nport: {_free_port()}\nresources_per_rank: {{cpu: 1000}}\n"
                   "limits: {max_model_len: 256, max_tokens: 32}\n")
    done = subprocess.run([sys.executable, "-m", "eaglectl.main", "serve", "--config", str(cfg)], cwd=REPO, env=_env(),
                          text=True, capture_output=True, timeout=300)
    assert done.returncode == 2, (done.stdout + done.stderr)[-3000:]
    assert "error: serve app 'eagle' cannot be scheduled" in done.stderr and "missing CPU " in done.stderr
