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

from cluster.config import ServeConfig
from tests.cluster.conftest import FAKE, REPO, _free_port, server_up


@pytest.mark.slow  # a Ray cluster and a Serve app in a subprocess
def test_run_serve_blocking_until_interrupted(tmp_path):
    """SIGTERM (what Kubernetes sends) stops the server cleanly (SIGINT, Ctrl-C: the api-key test
    below, through `eaglectl serve`)."""
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
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert server_up(proc, f"http://127.0.0.1:{port}", timeout=180), "server did not come up"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert client.completions.create(model="fake", prompt="hi", max_tokens=3).usage.completion_tokens == 3
        proc.send_signal(signal.SIGTERM)
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


# ---- `eaglectl serve --config`: every key form cluster/config.py documents ------------------------
_BASE_YAML = f"model: fake\nengine: {FAKE}\nresources_per_rank: {{cpu: 0.25}}\nlimits: {{max_model_len: 256, max_tokens: 32}}\n"


@pytest.mark.parametrize("form", ["api_keys", "api_keys_env", "api_keys_file", "deploy file"])
def test_serve_cli_accepts_every_api_key_form(tmp_path, monkeypatch, form):
    """The CLI reads the file as a serve config (a deploy file: its `serve:` section), not as a deploy
    config (which refuses literal keys and wants a Kubernetes secret for api_keys_env)."""
    from click.testing import CliRunner

    import cluster.serve_app
    from eaglectl.main import main

    (tmp_path / "keys.txt").write_text("# ops\nfile-key\n")
    monkeypatch.setenv("FLEET_TEST_KEYS", "env-key-1,env-key-2")
    keys = {"api_keys": ("api_keys: [inline-key]\n", {"inline-key"}),
            "api_keys_env": ("api_keys_env: FLEET_TEST_KEYS\n", {"env-key-1", "env-key-2"}),
            "api_keys_file": (f"api_keys_file: {tmp_path / 'keys.txt'}\n", {"file-key"})}
    if form == "deploy file":
        serve = "".join("  " + line + "\n" for line in (_BASE_YAML + "api_keys: [inline-key]\n"
                                                       "api_keys_env: FLEET_TEST_KEYS\n").splitlines())
        text, expected = f"serve:\n{serve}kubernetes: {{}}\n", {"inline-key", "env-key-1", "env-key-2"}
    else:
        text, expected = _BASE_YAML + keys[form][0], keys[form][1]
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    served = []
    monkeypatch.setattr(cluster.serve_app, "run_serve", lambda cfg, address=None, blocking=True: served.append(cfg))
    result = CliRunner().invoke(main, ["serve", "--config", str(path), "--port", "8123"])
    assert result.exit_code == 0, result.output
    assert served[0].resolve_api_keys() == expected and served[0].port == 8123


def test_serve_cli_names_the_config_file_of_a_missing_key_file(tmp_path, monkeypatch):
    """Checked before Ray starts; the error names the file and the field, as the config's other errors do."""
    from click.testing import CliRunner

    from eaglectl.serve import serve

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(_BASE_YAML + f"api_keys_file: {tmp_path / 'nowhere'}\n")
    r = CliRunner().invoke(serve, ["--config", str(cfg)])
    assert r.exit_code == 2, r.output
    assert f"{cfg}: api_keys_file: {tmp_path / 'nowhere'} does not exist" in r.output, r.output


@pytest.mark.slow  # `eaglectl serve` in a subprocess: its own Ray and Serve app
def test_serve_cli_with_every_api_key_form_authenticates_each_key(tmp_path):
    port = _free_port()
    (tmp_path / "keys.txt").write_text("file-key\n")
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(_BASE_YAML + f"port: {port}\napi_keys: [inline-key]\napi_keys_env: FLEET_TEST_KEYS\n"
                   f"api_keys_file: {tmp_path / 'keys.txt'}\n")
    env = dict(os.environ, FLEET_TEST_KEYS="env-key",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    env.pop("RAY_ADDRESS", None)   # a Ray of its own, as on an operator's machine
    # started with SIGINT ignored, as a shell starts background jobs: Ctrl-C still stops it, cleanly
    proc = subprocess.Popen([sys.executable, "-m", "eaglectl.main", "serve", "--config", str(cfg)], cwd=tmp_path,
                            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    base = f"http://127.0.0.1:{port}"
    try:
        assert server_up(proc, base, timeout=180), "server did not come up"
        for key in ("inline-key", "env-key", "file-key"):
            client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
            assert client.completions.create(model="fake", prompt="hi", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
