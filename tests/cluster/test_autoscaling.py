"""Autoscaling in both directions under live traffic, with no failed request during either change.

Min 1 / max 2 replicas, target 1 ongoing request per replica, no upscale delay and short downscale
delay / look-back / metrics interval (the test config; production keeps Serve's defaults). A load of
4 concurrent requests (above the target) must grow the app to 2 replicas and both must serve; a
light load of 1 request at a time (at the target) must then shrink it back to 1 while requests keep
flowing. Uses the fake engine (slow steps on cue, no CPU burnt); Serve, the router, HTTP and the
openai client are real.
"""
from __future__ import annotations

import re
import threading
import time

import pytest
import requests

from cluster.config import ServeConfig
from tests.cluster.conftest import FAKE, wait_for

MODEL = "fake"
APP = "autoscaled"
# Serve deprecates metrics_interval_s in favour of env vars read at cluster start; the session's
# shared cluster is not ours to configure, so the test config keeps the field.
pytestmark = pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")


class Load:
    """`concurrency` client threads sending requests back to back until stopped; every outcome recorded."""

    def __init__(self, client, concurrency: int, prompt: str, max_tokens: int):
        self.client, self.prompt, self.max_tokens = client, prompt, max_tokens
        self.stop_event = threading.Event()
        self.ok = 0
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(concurrency)]
        for t in self.threads:
            t.start()

    def _loop(self, worker: int) -> None:
        n = 0
        while not self.stop_event.is_set():
            n += 1
            try:
                # distinct leading text: prefix-aware routing would keep one shared prefix on its replica
                r = self.client.completions.create(model=MODEL, prompt=f"{worker}.{n} {self.prompt}",
                                                   max_tokens=self.max_tokens)
                assert r.usage.completion_tokens == self.max_tokens, r
                with self._lock:
                    self.ok += 1
            except Exception as e:  # noqa: BLE001 - every failure counts, whatever it is
                with self._lock:
                    self.failures.append(f"{type(e).__name__}: {e}")

    def stop(self, timeout: float = 60) -> "Load":
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "a request hung"
        return self


def _replicas() -> int:
    from ray import serve

    return serve.status().applications[APP].deployments["LLMServer"].replica_states.get("RUNNING", 0)


def _served_by(url: str) -> dict[str, float]:
    text = requests.get(f"{url}/metrics", timeout=30).text
    return {rid: float(v) for rid, v in
            re.findall(r'^eagle_replica_requests_total{[^}]*replica="([^"]+)"[^}]*} (\S+)$', text, re.M)}


def test_scales_out_under_load_and_back_in_after_it_without_failures(deploy):
    cfg = ServeConfig(model=MODEL, engine=FAKE, app_name=APP, resources_per_rank={"cpu": 0.25},
                      limits={"max_model_len": 256, "max_tokens": 64},
                      autoscaling={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                                   "upscale_delay_s": 0, "downscale_delay_s": 2,
                                   "look_back_period_s": 2, "metrics_interval_s": 0.5})
    app = deploy(cfg, "/autoscaled")
    assert _replicas() == 1

    heavy = Load(app.client, concurrency=4, prompt="[slow:0.05] heavy", max_tokens=20)  # ~1 s each, 4 ongoing
    try:
        t0 = time.monotonic()
        assert wait_for(lambda: _replicas() == 2, timeout=60), "no scale-out under load"
        scaled_out_s = time.monotonic() - t0
        # keep the load on until the new replica has served some of it
        assert wait_for(lambda: len(_served_by(app.url)) == 2, timeout=30), _served_by(app.url)
    finally:
        heavy.stop()
    during_out = _served_by(app.url)

    light = Load(app.client, concurrency=1, prompt="[slow:0.02] light", max_tokens=5)  # at the target: 1 ongoing
    try:
        t0 = time.monotonic()
        assert wait_for(lambda: _replicas() == 1, timeout=60), "no scale-in after the load"
        scaled_in_s = time.monotonic() - t0
        ok_at_scale_in = light.ok
        assert wait_for(lambda: light.ok >= ok_at_scale_in + 5, timeout=30)  # and keeps serving on one replica
    finally:
        light.stop()

    print(f"scale-out after {scaled_out_s:.1f}s, scale-in after {scaled_in_s:.1f}s; heavy {heavy.ok} ok, "
          f"light {light.ok} ok; served by {during_out}")
    assert heavy.failures == [] and light.failures == [], heavy.failures + light.failures
    assert heavy.ok >= 4 and light.ok >= 5
    assert min(during_out.values()) >= 1 and len(during_out) == 2, during_out
