"""One bad request never takes a replica down (issue #22, item 1), on real engines over real HTTP:
a temperature of 1e-45 once made the probabilities NaN, killed the engine loop, and the router passed
the request on until three replicas had died and an unrelated request got a 503."""
from __future__ import annotations

import concurrent.futures as cf

import pytest
import ray

from cluster.config import ServeConfig

EXTREMES = [{"temperature": 1e-45}, {"temperature": 5e-324, "top_p": 1e-9}, {"temperature": 1e-6, "min_p": 1.0},
            {"temperature": 0.3, "top_k": 1}]


def _replica_actors() -> set[str]:
    """Names of the app's live engine replica actors (a replacement gets a new name)."""
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if "isolation#LLMServer" in a["name"]}


@pytest.fixture(scope="module")
def app(deploy, tiny_model_dir):
    cfg = ServeConfig(model=str(tiny_model_dir("llama")), served_model_name="tiny", draft=None, app_name="isolation",
                      num_replicas=2, resources_per_rank={"cpu": 0.5}, kv_cache_gb=0.01,
                      limits={"max_model_len": 128, "max_tokens": 64, "max_num_seqs": 4})
    return deploy(cfg, "/isolation")


@pytest.mark.parametrize("extreme", EXTREMES, ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()))
def test_extreme_sampling_parameters_answer_and_no_replica_restarts(app, extreme):
    replicas = _replica_actors()
    assert len(replicas) == 2
    with cf.ThreadPoolExecutor(4) as pool:
        beside = [pool.submit(app.client.completions.create, model="tiny", prompt=f"beside {i}", max_tokens=40,
                              temperature=1.0, extra_body={"ignore_eos": True}) for i in range(2)]
        bad = [pool.submit(app.client.completions.create, model="tiny", prompt="Hello", max_tokens=8,
                           extra_body={"ignore_eos": True, **{k: v for k, v in extreme.items() if k == "top_k" or
                                                              k == "min_p"}},
                           **{k: v for k, v in extreme.items() if k in ("temperature", "top_p")}) for _ in range(2)]
        for f in bad:
            assert f.result(timeout=120).usage.completion_tokens == 8
        for f in beside:
            assert f.result(timeout=120).usage.completion_tokens == 40
    assert _replica_actors() == replicas     # the same two replica actors, none replaced


def test_n_samples_share_one_prefill_on_one_replica(app):
    """`n` samples of one prompt go to one replica (the router follows a sibling) and are prefilled
    once there (the others copy its KV): /metrics counts their prompts as cached, and each sample is
    the text a single request with its seed gives."""
    import re

    import requests

    def cached() -> float:
        text = requests.get(f"{app.url}/metrics").text
        return sum(float(v) for v in re.findall(r"^eagle_prompt_cached_tokens_total\{[^}]*\} (\S+)$", text, re.M))

    prompt = "Tell me a long story about a dragon who lives under a bridge"
    kw = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    before = cached()
    both = app.client.completions.create(n=3, seed=7, **kw)
    n_prompt = both.usage.prompt_tokens
    assert cached() - before == 2 * (n_prompt - 1)
    singles = [app.client.completions.create(seed=7 + i, **kw).choices[0].text for i in range(3)]
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == singles
