"""One engine replica: the ingress runs in the engine's process (`ServeConfig.colocated`), one
deployment, no Ray message per streamed chunk; what clients get is what the two-deployment layout
gives them. The fake engine; Serve, HTTP and the openai client are real."""
from __future__ import annotations

import requests
from ray import serve

from cluster.config import ServeConfig
from tests.cluster.conftest import FAKE, wait_for

MODEL = "fake"


def _cfg(name: str, **kw) -> ServeConfig:
    return ServeConfig(model=MODEL, engine=FAKE, app_name=name, resources_per_rank={"cpu": 0.25},
                       limits={"max_model_len": 256, "max_tokens": 64}, **kw)


def _answers(app) -> list:
    c = app.client
    whole = c.completions.create(model=MODEL, prompt="colocated or not", max_tokens=7, temperature=0, n=2, logprobs=2)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(    # chunking depends on timing
        model=MODEL, prompt="stream me", max_tokens=5, temperature=0, stream=True) if ch.choices)
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                     temperature=0)
    return [[(ch.text, ch.logprobs.tokens, ch.logprobs.top_logprobs) for ch in whole.choices],
            whole.usage.model_dump(), streamed, chat.choices[0].message.content, chat.usage.completion_tokens]


def test_one_replica_is_one_deployment_that_answers_as_the_two_deployment_layout(deploy):
    colocated = deploy(_cfg("colo"), "/colo")
    separate = deploy(_cfg("sep", ingress={"colocate": False}), "/sep")
    apps = serve.status().applications
    assert set(apps["colo"].deployments) == {"LLMServer"}
    assert set(apps["sep"].deployments) == {"LLMServer", "OpenAIIngress"}
    got = _answers(colocated)
    assert got == _answers(separate)
    assert len(got[0]) == 2 and got[1]["completion_tokens"] == 14 and len(got[2]) == 5

    # what Serve and a job's rows call on an engine replica, the colocated one answers too
    handle = serve.get_deployment_handle("LLMServer", app_name="colo")
    stats = handle.stats.remote().result(timeout_s=60)
    assert stats["engine_alive"] and stats["num_running"] == 0
    outs = list(handle.options(stream=True).submit.remote("direct-row", "a job row", {"max_tokens": 3},
                                                          priority=1, stream_interval=0))
    assert outs[-1].finished and len(outs[-1].token_ids) == 3

    # a stream the client abandons is aborted in the engine (the in-process stream's cancel)
    with requests.post(f"{colocated.url}/v1/completions", stream=True, timeout=60,
                       json={"model": MODEL, "prompt": "[slow:0.5] long", "max_tokens": 60, "stream": True}) as r:
        next(r.iter_lines())    # 60 steps of 0.5 s: left alone it runs 30 s, well past the wait below
        assert handle.stats.remote().result(timeout_s=60)["num_running"] == 1
    assert wait_for(lambda: handle.stats.remote().result(timeout_s=60)["num_running"] == 0, timeout=10)


def test_a_crashed_engine_is_a_503_naming_it_then_serve_restarts_the_replica(deploy):
    """The colocated engine is the app's only one: a request its crash ends is answered 503 at once
    (no retry that would find the same dead engine and blame two replicas), and Serve replaces the
    replica, HTTP server and engine together."""
    app = deploy(_cfg("crashy"), "/crashy")
    r = requests.post(f"{app.url}/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": "[crash-always:2] poison", "max_tokens": 8})
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "replica_lost" and "1 attempt failed" in err["message"], err
    assert "injected engine crash" in err["message"], err

    def serves() -> bool:
        try:
            return app.client.completions.create(model=MODEL, prompt="after", max_tokens=2).usage.completion_tokens == 2
        except Exception:   # the replica is being replaced
            return False
    assert wait_for(serves, timeout=120, interval=1)
