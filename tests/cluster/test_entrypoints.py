"""Entry points: `run_serve` (what `eaglectl serve` calls) in its own process and Ray cluster, and the
built-in default model served over HTTP (slow: loads the real Gemma 3 270M)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import openai
import pytest
import requests

from cluster.config import ServeConfig
from tests.cluster.conftest import FAKE, REPO, _free_port, wait_for


@pytest.mark.slow  # a Ray cluster and a Serve app in a subprocess
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_run_serve_blocking_until_interrupted(tmp_path, stop):
    """SIGINT (Ctrl-C) and SIGTERM (what Kubernetes sends) stop the server cleanly, even in a process
    started with SIGINT ignored, as a shell starts background jobs."""
    port = _free_port()
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: fake\nengine: {FAKE}\nport: {port}\nresources_per_rank: {{cpu: 0.25}}\n"
                   "limits: {max_model_len: 256, max_tokens: 32}\n")
    script = textwrap.dedent(f"""
        import ray
        from cluster.config import ServeConfig
        from cluster.serve_app import run_serve
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        run_serve(ServeConfig.from_yaml({str(cfg)!r}), address=None, blocking=True)
        print("CLEAN EXIT", flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        def up():
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            try:
                return requests.get(f"http://127.0.0.1:{port}/health", timeout=15).status_code == 200
            except requests.RequestException:
                return False
        assert wait_for(up, timeout=180, interval=1), "server did not come up"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert client.completions.create(model="fake", prompt="hi", max_tokens=3).usage.completion_tokens == 3
        proc.send_signal(stop)
        out, _ = proc.communicate(timeout=120)
        assert "CLEAN EXIT" in out, out[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_default_model_over_http(deploy):
    cfg = ServeConfig(app_name="default-model", num_replicas=1, resources_per_rank={"cpu": 1}, kv_cache_gb=0.1,
                      limits={"max_model_len": 256, "max_tokens": 16, "max_num_seqs": 2})
    app = deploy(cfg, "/default")
    r = app.client.chat.completions.create(model="gemma-3-270m", max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert r.usage.prompt_tokens > 10 and 1 <= r.usage.completion_tokens <= 4
    kw = dict(model="gemma-3-270m", prompt="The capital of France is", max_tokens=4, temperature=0)
    full = app.client.completions.create(**kw)
    streamed = "".join(c.choices[0].text for c in app.client.completions.create(**kw, stream=True))
    assert streamed == full.choices[0].text and full.choices[0].text.strip()
