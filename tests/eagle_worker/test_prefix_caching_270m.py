"""Prefix caching on the real default model (gemma-3-270m with its built-in head, float32): requests
sharing a system prompt and a conversation resending its history hit the cache (the history's
answer included: blocks filled by decoding are cached too), and every output is the one computed
without the cache."""
from __future__ import annotations

import pytest

from eagle_worker import LLM, SamplingParams

pytestmark = pytest.mark.slow

SYSTEM = ("You are a helpful assistant for a chemistry course. Explain each answer step by step, name the "
          "laws you use, keep numbers to three significant figures, and say so when a question is outside "
          "the course. ") * 3
QUESTIONS = ["What is the molar mass of water?", "Why does ice float?", "Balance: H2 + O2 -> H2O.",
             "What is Avogadro's number?"]


@pytest.fixture(scope="module")
def llms():
    return LLM(), LLM(enable_prefix_caching=False)


def test_shared_system_prompt_hits_and_outputs_are_unchanged(llms):
    on, off = llms
    params = SamplingParams(max_tokens=16, temperature=0.0)
    prompts = [SYSTEM + q for q in QUESTIONS]
    n_system = len(on.engine.tokenize(SYSTEM))
    outs = on.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in off.generate(prompts, params)]
    cached = [o.metrics["num_cached_tokens"] for o in outs]
    bs = on.engine.config.block_size
    assert cached[0] == 0 and all(c >= (n_system // bs - 1) * bs for c in cached[1:]), cached
    assert on.engine.stats()["spec_steps"] > 0


def test_a_conversation_resending_its_history_hits_its_own_answer(llms):
    on, off = llms
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    history = SYSTEM + QUESTIONS[1]
    first = on.generate(history, params)[0]
    second_prompt = history + first.text + "\nAnd why is that unusual?"
    second = on.generate(second_prompt, params)[0]
    assert second.token_ids == off.generate(second_prompt, params)[0].token_ids
    n_history = len(on.engine.tokenize(history))
    assert second.metrics["num_cached_tokens"] > n_history      # part of the first answer came from the cache
