"""`ingress.direct`: Ray Serve's direct ingress, where the ingress replica serves HTTP on the config's
port itself (Serve's proxy, which Ray 2.60 still starts on the head node, listens elsewhere).
`eaglectl serve` runs it in its own process and its own local Ray (Serve reads the switch when its
controller starts); every place it cannot work refuses it by name."""
from __future__ import annotations

import signal
import subprocess
import sys

import openai
import psutil
import pytest
from pydantic import ValidationError

from cluster.config import ServeConfig
from cluster.config_base import ConfigError
from tests.cluster.conftest import FAKE, REPO, _free_port, server_up
from tests.cluster.test_serve_cores import _env

BASE = dict(model="fake", engine=FAKE, limits={"max_model_len": 256, "max_tokens": 32})


def _listener(root: psutil.Process, port: int) -> str:
    """The command line of the process under `root` that listens on `port`."""
    for p in root.children(recursive=True):
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in p.net_connections("tcp")):
                return " ".join(p.cmdline())
        except psutil.Error:
            pass
    return ""


@pytest.mark.slow
@pytest.mark.parametrize("colocate,listening", [("null", "LLMServer"), ("false", "OpenAIIngress")])
def test_eaglectl_serve_with_direct_ingress_answers_from_the_ingress_replica_on_its_port(tmp_path, colocate, listening):
    """One engine replica: the engine's own process serves the port (colocated, the default), or the
    separate ingress replica does."""
    port = _free_port()
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: fake\nengine: {FAKE}\nport: {port}\nresources_per_rank: {{cpu: 0.5}}\n"
                   f"ingress: {{direct: true, colocate: {colocate}}}\nlimits: {{max_model_len: 256, max_tokens: 32}}\n")
    proc = subprocess.Popen([sys.executable, "-m", "eaglectl.main", "serve", "--config", str(cfg)], cwd=REPO,
                            env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        assert server_up(proc, url, timeout=240), "server did not come up"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        streamed = [c.choices[0].text for c in client.completions.create(model="fake", prompt="hello", max_tokens=5,
                                                                         stream=True, temperature=0)]
        whole = client.completions.create(model="fake", prompt="hello", max_tokens=5, temperature=0)
        assert "".join(streamed) == whole.choices[0].text and whole.usage.completion_tokens == 5
        assert [m.id for m in client.models.list().data] == ["fake"]
        listener = _listener(psutil.Process(proc.pid), port)
        assert f"ServeReplica:eagle:{listening}" in listener, listener     # no proxy hop: the ingress serves
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out[-3000:]


@pytest.mark.slow   # a CLI subprocess (no Ray: it is refused first)
def test_direct_ingress_on_a_cluster_this_command_did_not_start_is_refused_at_once(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: fake\nengine: {FAKE}\ningress: {{direct: true}}\n")
    done = subprocess.run([sys.executable, "-m", "eaglectl.main", "serve", "--config", str(cfg),
                           "--address", "127.0.0.1:1"], cwd=REPO, env=_env(), text=True, capture_output=True,
                          timeout=120)
    assert done.returncode == 2, (done.stdout + done.stderr)[-3000:]
    assert "error: ingress.direct needs a Ray that `eaglectl serve` starts" in done.stderr


def test_direct_ingress_takes_one_ingress_replica():
    with pytest.raises(ValidationError, match="ingress.direct: one ingress replica"):
        ServeConfig(**BASE, ingress={"direct": True, "num_replicas": 2})
    assert ServeConfig(**BASE, ingress={"direct": True}).ingress.direct


def test_direct_ingress_without_the_switch_on_the_cluster_or_under_a_prefix_is_refused(monkeypatch):
    from cluster.serve_app import DIRECT_INGRESS, build_app, deploy_app, direct_ingress_env

    cfg = ServeConfig(**BASE, ingress={"direct": True})
    monkeypatch.delenv(DIRECT_INGRESS, raising=False)
    with pytest.raises(ConfigError, match=f"controller must start with {DIRECT_INGRESS}=1"):
        build_app(cfg)
    with pytest.raises(ConfigError, match="serves the app at / on its own port, not at '/eagle'"):
        deploy_app(cfg, route_prefix="/eagle")
    env = direct_ingress_env(8123)    # one port: Ray's range excludes its maximum
    assert (env[DIRECT_INGRESS], env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"],
            env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == ("1", "8123", "8124")
