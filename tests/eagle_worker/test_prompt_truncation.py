"""vLLM's `truncate_prompt_tokens`: keep the prompt's last k tokens (tokenized whole, then cut, as
vLLM cuts on the left), or with -1 as many as leave the context room for max_tokens. A truncated
request is the request of its kept tokens: the same output, the kept ids reported as its prompt."""
from __future__ import annotations

import pytest

from eagle_worker import LLM, SamplingParams
from eagle_worker.engine import ContextLengthError

CONTEXT = 48
LONG = " ".join(f"word{i}" for i in range(200))      # far more tokens than the context holds


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir("llama")), draft=None, max_model_len=CONTEXT, block_size=4, num_kv_blocks=256)


def test_the_last_k_tokens_are_the_prompt(llm):
    whole = llm.engine.tokenize("The quick brown fox jumps over the lazy dog")
    greedy = dict(max_tokens=6, temperature=0, ignore_eos=True)
    cut = llm.generate("The quick brown fox jumps over the lazy dog", SamplingParams(truncate_prompt_tokens=5, **greedy))[0]
    kept = llm.generate(whole[-5:], SamplingParams(**greedy))[0]
    assert cut.prompt_token_ids == whole[-5:] and len(whole) > 5
    assert cut.token_ids == kept.token_ids
    short = llm.generate(whole[:3], SamplingParams(truncate_prompt_tokens=5, **greedy))[0]
    assert short.prompt_token_ids == whole[:3]                      # shorter than k: kept whole


def test_minus_one_keeps_what_fits_beside_max_tokens(llm):
    with pytest.raises(ContextLengthError):
        llm.generate(LONG, SamplingParams(max_tokens=8))
    out = llm.generate(LONG, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, truncate_prompt_tokens=-1))[0]
    assert out.prompt_token_ids == llm.engine.tokenize(LONG)[-(CONTEXT - 8):]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"


@pytest.mark.parametrize("params, needle", [
    (dict(truncate_prompt_tokens=CONTEXT), f"truncate_prompt_tokens ({CONTEXT}) must be less than max_model_len"),
    (dict(truncate_prompt_tokens=-1, max_tokens=CONTEXT), f"max_tokens ({CONTEXT}) leaves none of max_model_len"),
])
def test_a_cut_that_leaves_no_room_is_refused_naming_it(llm, params, needle):
    with pytest.raises(ValueError, match=r"SamplingParams\.truncate_prompt_tokens") as e:
        llm.generate(LONG, SamplingParams(**params))
    assert needle in str(e.value)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, "3"])
def test_values_other_than_minus_one_or_positive_are_refused(bad):
    with pytest.raises(ValueError, match=r"SamplingParams\.truncate_prompt_tokens must be None, -1"):
        SamplingParams(truncate_prompt_tokens=bad)


def test_a_truncated_text_prompt_may_be_longer_than_the_context_holds_but_is_bounded(llm, monkeypatch):
    huge = "x" * (CONTEXT * llm.engine.prompts.max_chars_per_token + 10)
    with pytest.raises(ContextLengthError, match="characters"):
        llm.generate(huge, SamplingParams(max_tokens=2))
    out = llm.generate(huge, SamplingParams(max_tokens=2, truncate_prompt_tokens=10))[0]
    assert len(out.prompt_token_ids) == 10
    monkeypatch.setattr("eagle_worker.sampling_params.MAX_TRUNCATED_PROMPT_CHARS", 10)
    huger = huge * 2                     # beyond what the context holds too (the bound is the larger of the two)
    with pytest.raises(ValueError, match=f"prompt has {len(huger)} characters; a prompt cut by truncate_prompt_tokens"):
        llm.generate(huger, SamplingParams(max_tokens=2, truncate_prompt_tokens=10))
