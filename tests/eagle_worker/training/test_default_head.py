"""The shipped gemma-3-270m head: it loads as `draft="default"`, greedy output with it equals
greedy output without it, and it accepts tau > 1.5 on held-out-style prompts (the bench's frame)."""
from __future__ import annotations

import json

import pytest

from eagle_worker.speculative.config import HEADS_DIR

pytestmark = pytest.mark.slow

HEAD = HEADS_DIR / "gemma-3-270m"
# not training prompts: written for this test, in the frame the head was trained on
PROMPTS = ["Question: A baker makes 24 muffins and sells 3/4 of them. How many are left?\nAnswer:",
           "Question: What is the capital of Australia, and why was it chosen?\nAnswer:",
           "Question: Write a Python function that returns the largest element of a list.\nAnswer:",
           "Question: Explain in two sentences what photosynthesis is.\nAnswer:"]


@pytest.mark.skipif(not (HEAD / "config.json").exists(), reason="no shipped gemma-3-270m head")
def test_default_head_is_lossless_and_accepts():
    from eagle_worker import LLM, SamplingParams
    from eagle_worker.speculative.config import SpecConfig

    cfg = json.loads((HEAD / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (HEAD / "GEMMA_TERMS.html").exists() and (HEAD / "NOTICE.md").exists() and (HEAD / "TRAINING.md").exists()
    assert (HEAD / "model.safetensors").stat().st_size <= 64 * 2**20

    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain = LLM(model="gemma-3-270m", dtype="float32").generate(PROMPTS, params)
    spec = LLM(model="gemma-3-270m", dtype="float32",
               spec=SpecConfig(draft="default", lookup=False, tree="dynamic", adaptive=False)).generate(PROMPTS, params)
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
    tau = sum(o.metrics["mean_accepted_tokens"] for o in spec) / len(spec)
    assert tau > 1.5, tau
