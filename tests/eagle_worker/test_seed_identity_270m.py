"""A seed is a text on the real default model (gemma-3-270m, float32, 262k vocabulary) with its
shipped EAGLE-3 head: no head, the head (adaptive, as served), prompt lookup and the hybrid, alone
and in a batch of 8, give the same tokens for the same seeds at temperature 1, with top-k/top-p
too (issue #22: six identical seed=42 requests returned four texts with the head)."""
from __future__ import annotations

from eagle_worker import LLM, SamplingParams, SpecConfig

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Question: Name three primary colors.\nAnswer:",
           "Once upon a time", "import numpy as np\n", "The quick brown fox jumps over the lazy dog. The quick",
           "Translate to French: good morning", "1, 2, 3, 4,"]
KV = dict(dtype="float32", kv_cache_gb=0.25)


def _params(i: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=10, temperature=1.0, seed=42 + i, ignore_eos=True, **kw)


def test_same_seed_same_tokens_with_every_method_on_the_default_model(default_model_dir):
    llms = {"plain": LLM(model="gemma-3-270m", draft=None, **KV),
            "head": LLM(model="gemma-3-270m", spec=SpecConfig(draft="default", lookup=False), **KV),
            "lookup": LLM(model="gemma-3-270m", spec=SpecConfig(lookup=True), **KV),
            "hybrid": LLM(model="gemma-3-270m", spec=SpecConfig(draft="default", lookup=True), **KV)}
    for kw in ({}, {"top_k": 50, "top_p": 0.9}):
        params = [_params(i, **kw) for i in range(len(PROMPTS))]
        expected = [o.token_ids for o in llms["plain"].generate(PROMPTS, params)]
        assert len({tuple(t) for t in expected}) == len(PROMPTS)
        for name, llm in llms.items():
            assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected, (name, kw, "batch 8")
        if kw:                              # alone too, once (a batch of 1 costs as much as one of 8)
            for name in ("plain", "head"):
                alone = [llms[name].generate(p, q)[0].token_ids for p, q in zip(PROMPTS[:3], params[:3])]
                assert alone == expected[:3], (name, kw, "batch 1")
    same = llms["head"].generate([PROMPTS[0]] * 6, [_params(0)] * 6)     # the six requests
    assert len({tuple(o.token_ids) for o in same}) == 1
    assert llms["head"].engine.stats()["acceptance_rate_per_depth"][0] > 0.2
