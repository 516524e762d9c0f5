"""EAGLE through the whole stack: a draft head that really accepts, served over HTTP, gives exactly the
plain-decoding text at temperature 0 while /metrics shows tau > 2 (fewer target forwards than tokens)."""
from __future__ import annotations

import re

import pytest
import requests

from cluster.config import ServeConfig

PROMPTS = ["The quick brown fox", "def add(a, b):\n", "Bonjour"]
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def apps(deploy, copying_target):
    target, head = copying_target

    def cfg(name, draft, **kw):
        return ServeConfig(model=str(target), served_model_name="copy", draft=draft, app_name=name, num_replicas=1, **kw,
                           resources_per_rank={"cpu": 0.5}, kv_cache_gb=0.01,
                           limits={"max_model_len": 128, "max_tokens": 48, "max_num_seqs": 4})
    return deploy(cfg("plain", None), "/plain"), deploy(cfg("eagle", str(head), speculation={"adaptive": False}), "/eagle")


def _metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))


def test_eagle_output_equals_plain_and_tau_above_two(apps):
    plain, eagle = apps
    kw = dict(model="copy", max_tokens=40, temperature=0, extra_body=NO_EOS)
    for prompt in PROMPTS:
        want = plain.client.completions.create(prompt=prompt, **kw).choices[0].text
        assert eagle.client.completions.create(prompt=prompt, **kw).choices[0].text == want
        streamed = "".join(c.choices[0].text for c in eagle.client.completions.create(prompt=prompt, stream=True, **kw))
        assert streamed == want
    text = requests.get(f"{eagle.url}/metrics").text
    tau = _metric(text, "eagle_mean_accepted_tokens_sum") / _metric(text, "eagle_mean_accepted_tokens_count")
    assert tau > 2.0, tau
    assert _metric(text, "eagle_target_forwards_total") < _metric(text, "eagle_generation_tokens_total") / 2
