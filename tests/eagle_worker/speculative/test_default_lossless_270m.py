"""The default speculation (the hybrid, sized per sequence and step) on the real default model is
lossless at every batch size: greedy float32 output is plain decoding's, alone, in a batch of 8 and
in a batch of 32, with prompts that copy (lookup drafts) and prompts that do not (the head drafts).
Once as measured on this machine, and once with rows priced near zero so that every sequence
drafts from every source it has at every batch size."""
from __future__ import annotations

import pytest

from eagle_worker import LLM, SamplingParams
from eagle_worker.speculative.step_cost import StepCost

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Question: Name three primary colors.\nAnswer:",
           "Once upon a time", "red, green, blue, red, green, blue, red, green,",
           "The quick brown fox jumps over the lazy dog. The quick brown fox",
           "Question: Repeat after me: to be or not to be.\nAnswer: to be or not to be. to be",
           "1, 2, 3, 4, 5, 6, 7, 8,"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
KV = dict(dtype="float32", kv_cache_gb=0.5)


@pytest.mark.slow
def test_the_default_is_lossless_at_batch_1_8_and_32(default_model_dir):
    expected = [o.token_ids for o in LLM(model="gemma-3-270m", spec=None, **KV).generate(PROMPTS, GREEDY)]
    for rows in ("measured", "free"):
        llm = LLM(model="gemma-3-270m", **KV)              # the default
        worker = llm.engine.worker
        assert worker.head is not None and worker.spec.lookup and worker.spec.adaptive
        if rows == "free":
            worker.hybrid.cost = StepCost(coefficients=(0.030, 1e-7, 1e-7, 1e-7, 1e-7))
        drafted = {}
        for size in (1, 8, 32):
            before = worker.totals["draft_nodes"]
            if size == 1:
                outs = [llm.generate(p, GREEDY)[0] for p in PROMPTS[:3] + PROMPTS[-2:]]
                want = expected[:3] + expected[-2:]
            else:
                outs = llm.generate((PROMPTS * 4)[:size], GREEDY)
                want = (expected * 4)[:size]
            assert [o.token_ids for o in outs] == want, (rows, size)
            drafted[size] = worker.totals["draft_nodes"] - before
        assert drafted[1] > 0, rows                        # batch 1 pays for trees on any device
        if rows == "free":
            assert all(drafted.values()), drafted
            assert llm.engine.stats()["acceptance_rate_per_depth"][0] > 0.3
