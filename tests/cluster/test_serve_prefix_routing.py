"""Prefix-aware routing through the real stack (Serve, the router in the ingress, HTTP, two replicas of
the fake engine, whose emulated prefix cache reports the real engine's stats keys): requests sharing a
long system prompt all go to one replica, which then serves their prefix from its cache; prompts with
distinct prefixes spread over both replicas; /metrics shows the prefix-cache counters."""
from __future__ import annotations

import re

import pytest
import requests

from cluster.config import ServeConfig
from tests.cluster.conftest import FAKE, wait_for

pytestmark = pytest.mark.slow   # starts Ray and Serve

SYSTEM = "system: you are a careful assistant who answers in one short sentence. " * 8   # 568 byte-tokens


@pytest.fixture(scope="module")
def app(deploy):
    cfg = ServeConfig(model="fake", engine=FAKE, app_name="prefix", num_replicas=2, resources_per_rank={"cpu": 0.25},
                      limits={"max_model_len": 2048, "max_tokens": 8})
    deployed = deploy(cfg, "/prefix")
    # Serve starts the ingress's router at its first request and tells it the replicas as they come:
    # until it knows both, everything goes to one (a CI run on a slow machine sent all 16 there)
    deployed.client.completions.create(model="fake", prompt="hi", max_tokens=1, temperature=0)
    assert wait_for(lambda: len(_series(deployed, "eagle_replica_prefix_cache_blocks")) == 2, timeout=60)
    return deployed


def _series(app, name: str) -> dict[str, float]:
    text = requests.get(f"{app.url}/metrics", timeout=30).text
    return {rep: float(v) for rep, v in re.findall(rf'{name}\{{model="fake",replica="([^"]+)"\}} ([\d.e+]+)', text)}


def _served(app, prompts: list[str]) -> dict[str, int]:
    """Requests per replica for `prompts`, sent one after the other (each finishes first)."""
    before = _series(app, "eagle_replica_requests_total")
    for p in prompts:
        out = app.client.completions.create(model="fake", prompt=p, max_tokens=4, temperature=0)
        assert out.choices[0].text
    after = _series(app, "eagle_replica_requests_total")
    return {r: int(after[r] - before.get(r, 0)) for r in after if after[r] > before.get(r, 0)}


def test_a_shared_system_prompt_stays_on_one_replica_and_distinct_prefixes_spread(app):
    shared = _served(app, [SYSTEM + f"user: question number {i} about topic {i * 7}?\nassistant:" for i in range(8)])
    assert list(shared.values()) == [8], shared              # all eight on one replica
    home = next(iter(shared))
    distinct = _served(app, [f"{i}: " + f"a different document number {i} to summarise. " * 12 for i in range(8)])
    assert len(distinct) == 2 and min(distinct.values()) >= 2, distinct   # new prefixes spread over both

    # the replica that got the shared prompt served 7 of them from its cache: 35 of the prompt's 16-token blocks
    def hits() -> float:
        return _series(app, "eagle_prefix_cache_hit_tokens_total").get(home, 0)
    assert wait_for(lambda: hits() >= 7 * 35 * 16, timeout=30), _series(app, "eagle_prefix_cache_hit_tokens_total")
    rates = _series(app, "eagle_replica_prefix_cache_request_hit_rate")
    assert set(rates) == set(distinct) and rates[home] > 0
    assert _series(app, "eagle_replica_prefix_cache_blocks")[home] >= 35
