"""cluster/metrics.py without a cluster: every request counted by final status (the ASGI middleware),
Retry-After on 503s, client disconnects as 499, per-replica gauges exactly for the live replicas."""
from __future__ import annotations

import asyncio
import re

import pytest
from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.testclient import TestClient

from cluster import metrics as m


def _counts(metrics: m.ServeMetrics) -> dict[tuple[str, str], float]:
    text = metrics.render().decode()
    return {(e, s): float(v) for e, s, v in
            re.findall(r'eagle_requests_total\{endpoint="(\w+)",model="\w+",status="(\d+)"\} ([\d.]+)', text)}


@pytest.fixture
def metrics():
    metrics = m.ServeMetrics("tiny")
    m.set_active(metrics)
    yield metrics
    m.set_active(None)


def _app() -> FastAPI:
    app = FastAPI()

    @app.exception_handler(Exception)
    async def unexpected(request, exc):
        return JSONResponse({"error": {"message": str(exc)}}, status_code=500)

    @app.post("/v1/completions")
    async def completions(body: dict):
        if body.get("key") != "k":
            raise HTTPException(401, "bad key")
        if body.get("boom"):
            raise RuntimeError("boom")
        if body.get("busy"):
            return JSONResponse({"error": {"code": "overloaded"}}, status_code=503)
        return {"ok": True}

    @app.post("/v1/chat/completions")
    async def chat():
        async def events():
            yield "data: {}\n\n"
            m.note_status(503)   # e.g. the replica died after tokens went out: an error event
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    app.add_middleware(m.StatusCounter)
    return app


def test_every_request_is_counted_by_final_status(metrics):
    client = TestClient(_app(), raise_server_exceptions=False)
    assert client.post("/v1/completions", json={"key": "k"}).status_code == 200
    assert client.post("/v1/completions", json={"key": "x"}).status_code == 401
    assert client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
                       ).status_code == 422   # FastAPI's own refusal, before any handler code
    assert client.post("/v1/completions", json={"key": "k", "boom": True}).status_code == 500
    assert client.get("/v1/nowhere").status_code == 404
    assert client.get("/v1/completions").status_code == 405
    busy = client.post("/v1/completions", json={"key": "k", "busy": True})
    assert busy.status_code == 503 and busy.headers["retry-after"] == str(m.RETRY_AFTER_S)
    assert client.post("/v1/chat/completions").status_code == 200
    assert _counts(metrics) == {("completions", "200"): 1, ("completions", "401"): 1, ("completions", "422"): 1,
                                ("completions", "500"): 1, ("other", "404"): 1, ("completions", "405"): 1,
                                ("completions", "503"): 1, ("chat", "503"): 1}


@pytest.mark.parametrize("how", ["cancelled", "body cut off"])
def test_a_client_disconnect_is_499(metrics, how):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        if how == "cancelled":   # Serve cancels the request when the client goes away
            raise asyncio.CancelledError()
        # Starlette's StreamingResponse just returns when it sees http.disconnect

    async def run():
        async def receive():
            return {"type": "http.disconnect"}

        async def send(message):
            pass

        await m.StatusCounter(app)({"type": "http", "path": "/v1/completions"}, receive, send)

    if how == "cancelled":
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(run())
    else:
        asyncio.run(run())
    assert _counts(metrics) == {("completions", str(m.CLIENT_CLOSED)): 1}


@pytest.mark.parametrize("where", ["receive", "send"])
def test_a_dead_proxy_is_a_disconnect_not_a_server_error(metrics, where):
    """With Serve's proxy killed mid-stream, its `receive`/`send` raise ActorDiedError: counted 500."""
    from ray.exceptions import ActorDiedError
    from starlette.requests import ClientDisconnect

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if where == "receive":                         # StreamingResponse listens for the disconnect
            assert await receive() == {"type": "http.disconnect"}
            return
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})

    async def run():
        async def receive():
            if where == "receive":
                raise ActorDiedError()
            return {"type": "http.request", "body": b"", "more_body": True}

        async def send(message):
            if where == "send" and message["type"] == "http.response.body":
                raise ActorDiedError()

        await m.StatusCounter(app)({"type": "http", "path": "/v1/completions"}, receive, send)

    if where == "send":
        with pytest.raises(ClientDisconnect):
            asyncio.run(run())
    else:
        asyncio.run(run())
    assert _counts(metrics) == {("completions", str(m.CLIENT_CLOSED)): 1}


def test_replica_gauges_are_exactly_the_live_replicas():
    metrics = m.ServeMetrics("tiny")
    stats = dict(num_running=2, num_waiting=1, kv_usage=0.25, num_free_blocks=7)
    text = metrics.render({"r1": stats, "r2": {**stats, "num_running": 5}}).decode()
    assert 'eagle_replica_num_running{model="tiny",replica="r1"} 2.0' in text
    assert 'eagle_replica_num_running{model="tiny",replica="r2"} 5.0' in text
    text = metrics.render({"r2": stats}).decode()          # r1 died: its series are gone at once
    assert 'replica="r1"' not in text.replace("eagle_replica_requests_total", "")
    assert 'eagle_replica_kv_usage{model="tiny",replica="r2"} 0.25' in text
    assert 'replica="r2"' in metrics.render().decode()     # None keeps the last view


def test_what_the_ingress_keeps_is_bounded_scraped_or_not(monkeypatch):
    """The throughput window forgets old chunks as they come (a server nobody scrapes kept every
    chunk), and a replica gone for GONE_REPLICA_SERIES_S loses its requests_total series (an
    autoscaled fleet's replica ids come and go)."""
    metrics = m.ServeMetrics("tiny", window_s=10.0)
    now = [1000.0]
    monkeypatch.setattr(m.time, "monotonic", lambda: now[0])
    for _ in range(5000):
        metrics.tokens(1)
        now[0] += 0.01
    assert len(metrics._recent) <= 1001
    out = type("Out", (), {"metrics": {"replica_id": "old"}, "token_ids": [1], "prompt_token_ids": [1]})()
    metrics.finished(out, 0.1, 0.05)
    metrics.render({"old": {}})
    now[0] += m.GONE_REPLICA_SERIES_S / 2
    assert 'replica="old"' in metrics.render({"new": {}}).decode()        # gone a little while: kept
    now[0] += m.GONE_REPLICA_SERIES_S
    text = metrics.render({"new": {}}).decode()
    assert 'replica="old"' not in text and "old" not in metrics._replica_seen


def test_prefix_cache_series_come_from_each_replica_stats():
    """The engine's cumulative prefix-cache totals become per-replica counters, with cached blocks and hit
    rates as gauges; replicas whose engine has no prefix cache get no series; a gone replica's vanish."""
    from prometheus_client.parser import text_string_to_metric_families

    metrics = m.ServeMetrics("tiny")
    hot = dict(num_running=1, prefix_cache_queried_tokens=1000, prefix_cache_hit_tokens=750,
               prefix_cache_queried_requests=8, prefix_cache_hit_requests=6, prefix_cache_blocks=40,
               prefix_cache_evictions=3)
    cold = {**hot, "prefix_cache_hit_tokens": 0, "prefix_cache_hit_requests": 0, "prefix_cache_queried_tokens": 0,
            "prefix_cache_queried_requests": 0}

    def samples(text):
        return {(s.name, s.labels.get("replica")): s.value for fam in text_string_to_metric_families(text.decode())
                for s in fam.samples if "prefix_cache" in s.name}

    got = samples(metrics.render({"r1": hot, "r2": cold, "old-engine": {"num_running": 0}}))
    assert got[("eagle_prefix_cache_hit_tokens_total", "r1")] == 750
    assert got[("eagle_prefix_cache_queried_tokens_total", "r1")] == 1000
    assert got[("eagle_prefix_cache_hit_requests_total", "r1")] == 6
    assert got[("eagle_prefix_cache_queried_requests_total", "r1")] == 8
    assert got[("eagle_prefix_cache_evictions_total", "r1")] == 3
    assert got[("eagle_replica_prefix_cache_blocks", "r1")] == 40
    assert got[("eagle_replica_prefix_cache_token_hit_rate", "r1")] == 0.75
    assert got[("eagle_replica_prefix_cache_request_hit_rate", "r1")] == 0.75
    assert got[("eagle_replica_prefix_cache_token_hit_rate", "r2")] == 0.0       # nothing looked up yet: 0, not NaN
    assert not [k for k in got if k[1] == "old-engine"]
    got = samples(metrics.render({"r2": cold}))                                  # r1 gone
    assert not [k for k in got if k[1] == "r1"] and ("eagle_prefix_cache_hit_tokens_total", "r2") in got
    assert samples(metrics.render()) == got                                      # None keeps the last view


@pytest.mark.parametrize("path,label", [("/v1/completions", "completions"), ("/app/v1/chat/completions", "chat"),
                                        ("/v1/models", "models"), ("/health", "health"), ("/metrics", "metrics"),
                                        ("/v1/embeddings", "other"), ("/", "other")])
def test_endpoint_labels_are_bounded(path, label):
    assert m.endpoint_label(path) == label
