"""Admission and metrics of a real Serve app over real HTTP (fake engine, real Ray Serve and router).

- A burst within the configured capacity (replicas x (max_num_seqs + max_queued_requests), plus the
  ingress queue `max_router_queue`) is never refused, however fast it arrives; beyond it, 503 with
  Retry-After at once.
- /metrics counts every request by final status, refused ones too, a client disconnect as 499;
  per-replica gauges cover every live replica and drop a dead one.
"""
from __future__ import annotations

import re
import threading

import pytest
import requests

from cluster.config import ServeConfig
from tests.cluster.conftest import FAKE, wait_for

MODEL = "fake"
LIMITS = {"max_model_len": 256, "max_tokens": 64, "max_num_seqs": 2, "max_queued_requests": 2, "max_router_queue": 1}


def _cfg(name: str, **kw) -> ServeConfig:
    base = dict(model=MODEL, engine=FAKE, app_name=name, num_replicas=2, resources_per_rank={"cpu": 0.25},
                limits=LIMITS)
    return ServeConfig(**(base | kw))


@pytest.fixture(scope="module")
def admit(deploy):
    return deploy(_cfg("admit"), "/admit")


@pytest.fixture(scope="module")
def counted(deploy):
    return deploy(_cfg("counted", api_keys=["key-1"], limits={**LIMITS, "max_request_body_bytes": 4096}), "/counted")


def _burst(n: int, send) -> list:
    """n requests released at the same instant, one thread each."""
    gate = threading.Barrier(n)
    results: list = [None] * n

    def one(i):
        gate.wait()
        try:
            results[i] = send(i)
        except Exception as e:  # noqa: BLE001 - reported by the caller's assertion
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    return results


def test_a_burst_within_capacity_is_never_refused(admit):
    cfg = admit.config
    assert cfg.capacity == 8 and cfg.admission_limit == 9
    for rnd in range(4):   # an idle app each round: the previous burst has been answered
        results = _burst(cfg.capacity, lambda i: admit.client.completions.create(
            model=MODEL, prompt=f"[slow:0.02] round {rnd} #{i}", max_tokens=4))
        errors = [r for r in results if isinstance(r, Exception)]
        assert not errors, (rnd, errors)
        assert all(r.usage.completion_tokens == 4 for r in results)


def test_a_burst_beyond_capacity_gets_503_with_retry_after(admit):
    n = admit.config.admission_limit + 5
    results = _burst(n, lambda i: requests.post(
        f"{admit.url}/v1/completions", timeout=120,
        json={"model": MODEL, "prompt": f"[slow:0.05] over #{i}", "max_tokens": 20}))
    assert not [r for r in results if isinstance(r, Exception)], results
    codes = sorted(r.status_code for r in results)
    assert set(codes) == {200, 503}, codes
    assert codes.count(200) >= admit.config.admission_limit   # refused only once the limit is in flight
    for r in results:
        if r.status_code == 503:
            assert r.headers["Retry-After"] == "1"
            assert r.json()["error"]["code"] == "overloaded"
        else:
            assert r.json()["usage"]["completion_tokens"] == 20
    ok = admit.client.completions.create(model=MODEL, prompt="after the burst", max_tokens=3)
    assert ok.usage.completion_tokens == 3


def test_a_streamed_requests_samples_are_admitted_together_before_its_headers(admit):
    """A stream of n samples was admitted one sample at a time, its first before the headers: a second
    such stream got 200, one chunk, then an `overloaded` error event mid-stream. Now all n or a 503."""
    import json

    limit, n = admit.config.admission_limit, 6
    assert n <= limit < 2 * n
    body = {"model": MODEL, "prompt": "[slow:0.05] sampled", "max_tokens": 12, "n": n, "stream": True}
    with requests.post(f"{admit.url}/v1/completions", json=body, stream=True, timeout=120) as first:
        assert first.status_code == 200
        lines = first.iter_lines()
        assert next(line for line in lines if line.startswith(b"data: "))    # its samples are running
        second = requests.post(f"{admit.url}/v1/completions", json=body, timeout=120)
        assert second.status_code == 503 and second.headers["Retry-After"] == "1", second.text
        assert second.json()["error"]["code"] == "overloaded" and f"n asks for {n}" in second.json()["error"]["message"]
        events = [line[6:] for line in lines if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]" and not any(b'"error"' in e for e in events), events[-3:]
    finished = [c for e in events[:-1] for c in json.loads(e)["choices"] if c.get("finish_reason")]
    assert sorted(c["index"] for c in finished) == list(range(n))
    again = requests.post(f"{admit.url}/v1/completions", json=body, timeout=120)   # its slots were given back
    assert again.status_code == 200 and again.text.rstrip().endswith("data: [DONE]")


def test_the_openai_client_honours_retry_after(admit):
    """The official client retries a 503 after its Retry-After: an over-capacity burst all gets served."""
    import openai

    client = openai.OpenAI(base_url=f"{admit.url}/v1", api_key="unused", max_retries=8, timeout=120)
    results = _burst(admit.config.admission_limit + 4, lambda i: client.completions.create(
        model=MODEL, prompt=f"[slow:0.02] patient #{i}", max_tokens=10))
    assert all(not isinstance(r, Exception) and r.usage.completion_tokens == 10 for r in results), results


def _metrics(app) -> str:
    return requests.get(f"{app.url}/metrics", timeout=30).text


def _count(text: str, endpoint: str, status: int) -> float:
    m = re.search(rf'eagle_requests_total\{{endpoint="{endpoint}",model="{MODEL}",status="{status}"\}} ([\d.]+)',
                  text)
    return float(m.group(1)) if m else 0.0


def _replicas(text: str) -> set[str]:
    return set(re.findall(r'eagle_replica_kv_usage\{model="\w+",replica="(\w+)"\}', text))


def test_every_request_is_counted_by_final_status(counted):
    url, key = f"{counted.url}/v1/completions", {"Authorization": "Bearer key-1"}
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    assert requests.post(url, json=body).status_code == 401
    assert requests.post(url, data=b"{not json", headers={**key, "Content-Type": "application/json"}
                         ).status_code == 400
    assert requests.post(url, json={**body, "model": "other"}, headers=key).status_code == 404
    assert requests.post(url, json={**body, "prompt": "x" * 5000}, headers=key).status_code == 413
    assert requests.get(f"{counted.url}/v1/nowhere", headers=key).status_code == 404
    assert requests.get(url, headers=key).status_code == 405
    assert counted.client.completions.create(**body).usage.completion_tokens == 2
    with requests.post(url, stream=True, timeout=60, headers=key,   # a client that leaves mid-stream
                       json={**body, "prompt": "[slow:0.05] long", "max_tokens": 60, "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    expected = {("completions", 401): 1, ("completions", 400): 1, ("completions", 404): 1, ("completions", 413): 1,
                ("other", 404): 1,
                ("completions", 405): 1, ("completions", 200): 1, ("completions", 499): 1}
    assert wait_for(lambda: all(_count(_metrics(counted), e, s) == n for (e, s), n in expected.items()), 30), \
        _metrics(counted)
    assert _count(_metrics(counted), "completions", 500) == 0   # the disconnect is not a server error


def test_replica_gauges_cover_every_live_replica_and_drop_a_dead_one(counted, tmp_path):
    assert wait_for(lambda: len(_replicas(_metrics(counted))) == 2, 60), _metrics(counted)
    before = _replicas(_metrics(counted))
    marker = tmp_path / "fired"   # the replica serving this dies; the request is retried elsewhere
    r = counted.client.completions.create(model=MODEL, prompt=f"[die-once:{marker}:1] bye", max_tokens=4)
    assert marker.exists() and r.usage.completion_tokens == 4
    assert wait_for(lambda: len(before - _replicas(_metrics(counted))) == 1, 60), (before, _metrics(counted))
    dead = before - _replicas(_metrics(counted))
    assert wait_for(lambda: len(_replicas(_metrics(counted))) == 2, 90)   # its replacement reports
    assert not dead & _replicas(_metrics(counted))
