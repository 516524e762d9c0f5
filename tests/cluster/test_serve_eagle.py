"""EAGLE through the whole stack: a draft head that really accepts, served over HTTP, gives exactly the
plain-decoding text at temperature 0 while /metrics shows tau > 2 (fewer target forwards than tokens)."""
from __future__ import annotations

import re

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM

from cluster.config import ServeConfig
from tests.conftest import make_tokenizer, tiny_config

PROMPTS = ["The quick brown fox", "def add(a, b):\n", "Bonjour"]
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def copying_target(tmp_path_factory):
    """A tiny Qwen2 whose next token mostly depends on the current one, and an EAGLE-1 head that
    forwards the token embedding, so it drafts the target's own bigram argmax and accepts a lot."""
    from eagle_worker import LLM
    from eagle_worker.spec.head_init import new_head
    from eagle_worker.spec.head_loader import save_draft_head

    torch.manual_seed(0)
    cfg = tiny_config("qwen2")
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            if "o_proj" in name:
                p.mul_(0.01)
            if "down_proj" in name:
                p.zero_()
            if "norm" in name:
                p.fill_(1.0)
    target = tmp_path_factory.mktemp("copying-target")
    model.save_pretrained(target)
    make_tokenizer(cfg.vocab_size).save_pretrained(target)
    llm = LLM(model=str(target), block_size=4, num_kv_blocks=64, draft=None)
    head = new_head("eagle", llm.engine.runner.model, llm.engine.runner.hf_config, std=0.0)
    with torch.no_grad():
        hidden = head.config.hidden_size
        head.fc.weight[:, :hidden] = torch.eye(hidden)
    head_dir = tmp_path_factory.mktemp("copying-head")
    save_draft_head(head, head_dir)
    return target, head_dir


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
