"""A seed is a text, through the engine: the same seed gives the same tokens with no head, a head
(dynamic, chain, adaptive), prompt lookup and the hybrid, alone or in a batch of 8, after preemption;
with top-k/top-p, penalties and logit_bias too. Logprobs (top-k, raw target) under speculation are
plain decoding's, prompt_logprobs agree with the logprobs of the same tokens generated, and extreme
parameters never fail a step. The real default model: test_seed_identity_270m.py."""
from __future__ import annotations

import pytest

from eagle_worker import LLM, SamplingParams, SpecConfig
from eagle_worker.config import EngineConfig
from eagle_worker.engine import LLMEngine
from tests.conftest import assert_no_leaks

PROMPTS = ["The quick brown fox", "def add(a, b):\n", "Question: what is two plus two?\nAnswer:", "x",
           "Speculative decoding drafts tokens and verifies them in one pass.", "Bonjour",
           "The quick brown fox jumps over the lazy dog. The quick", "Very long"]
KV = dict(block_size=4, num_kv_blocks=1024)
PARAMS = {
    "t1": dict(temperature=1.0),
    "filters": dict(temperature=0.9, top_k=5, top_p=0.9, min_p=0.05),
    "processed": dict(temperature=1.0, top_k=4, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3,
                      logit_bias={5: 2.0, 7: -3.0}),
}


def methods(head: str) -> dict[str, SpecConfig | None]:
    fixed = dict(adaptive=False, depth=3, top_k=3, num_draft_tokens=6)
    return {"plain": None,
            "head": SpecConfig(draft=head, lookup=False, **fixed),
            "head-adaptive": SpecConfig(draft=head, lookup=False),
            "chain": SpecConfig(draft=head, lookup=False, tree="chain", depth=4, adaptive=False),
            "lookup": SpecConfig(lookup=True, lookup_ngram=(1, 3), adaptive=False),
            "hybrid": SpecConfig(draft=head, lookup=True, lookup_ngram=(1, 3), **fixed)}


def seeded(kind: str, n: int = len(PROMPTS), max_tokens: int = 12, **extra) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=1000 + i, **PARAMS[kind], **extra)
            for i in range(n)]


def run(llm: LLM, params: list[SamplingParams], batch: bool) -> list[list[int]]:
    if batch:
        return [o.token_ids for o in llm.generate(PROMPTS, params)]
    return [llm.generate(p, q)[0].token_ids for p, q in zip(PROMPTS, params)]


def test_same_seed_same_tokens_with_every_method_and_batch_size(copying_target):
    target, head = copying_target
    llms = {name: LLM(model=str(target), spec=spec, **KV) for name, spec in methods(str(head)).items()}
    for kind in PARAMS:
        expected = run(llms["plain"], seeded(kind), batch=False)
        assert len({tuple(t) for t in expected}) > 4          # the seeds really differ
        for name, llm in llms.items():
            for batch in (True, False) if name in ("plain", "head") else (True,):
                assert run(llm, seeded(kind), batch) == expected, (kind, name, "batch 8" if batch else "batch 1")
    for name in ("head", "chain"):
        assert llms[name].engine.stats()["acceptance_rate_per_depth"][0] > 0.15, name   # the drafts were used
    assert all(llms[name].engine.stats()["spec_steps"] > 0 for name in llms if name != "plain")
    for llm in llms.values():
        assert_no_leaks(llm.engine)


def test_same_tokens_after_preemption_and_in_chunked_prefill(copying_target):
    target, head = copying_target
    expected = run(LLM(model=str(target), draft=None, **KV), seeded("processed", max_tokens=24), batch=False)
    tight = LLM(model=str(target), block_size=4, num_kv_blocks=24, max_num_batched_tokens=6,
                spec=SpecConfig(draft=str(head), lookup=False, adaptive=False, depth=3, top_k=3, num_draft_tokens=6))
    outs = tight.generate(PROMPTS, seeded("processed", max_tokens=24))
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert [o.token_ids for o in outs] == expected


def test_logprobs_under_speculation_are_the_targets(copying_target):
    target, head = copying_target
    params = seeded("filters", logprobs=3)
    plain = LLM(model=str(target), draft=None, **KV).generate(PROMPTS, params)
    spec = LLM(model=str(target), spec=SpecConfig(draft=str(head), lookup=False, adaptive=False), **KV).generate(PROMPTS, params)
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids and [x.token_id for x in s.logprobs] == s.token_ids
        for a, b in zip(p.logprobs, s.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert len(a.top) == len(b.top) == 3 and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.top[0][1] >= a.top[1][1] >= a.top[2][1] and a.top[0][1] >= a.logprob - 1e-6


def test_new_logprobs_stream_and_prompt_logprobs_match_generated_logprobs(copying_target):
    """prompt_logprobs of (prompt + generated tokens), scored in 5-token prefill chunks, equal the
    logprobs those tokens had when generated; each output's new_logprobs align with new_token_ids."""
    target, head = copying_target
    engine = LLMEngine(EngineConfig(model=str(target), spec=SpecConfig(draft=str(head), lookup=False, adaptive=False), **KV))
    engine.add_request("gen", PROMPTS[0], SamplingParams(max_tokens=12, ignore_eos=True, seed=3, logprobs=2))
    streamed, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert len(out.new_logprobs) == len(out.new_token_ids)
            assert [x.token_id for x in out.new_logprobs] == out.new_token_ids
            streamed += out.new_logprobs
            final = out
    assert final.prompt_logprobs is None and streamed == final.logprobs
    prompt = final.prompt_token_ids + final.token_ids
    scorer = LLMEngine(EngineConfig(model=str(target), draft=None, max_num_batched_tokens=5, **KV))
    scorer.add_request("score", prompt, SamplingParams(max_tokens=2, prompt_logprobs=2, ignore_eos=True))
    outs = []
    while scorer.has_unfinished_requests():
        outs += scorer.step()
    first, rest = outs[0].prompt_logprobs, [o.prompt_logprobs for o in outs[1:]]
    assert len(first) == len(prompt) and first[0] is None and all(x is None for x in rest)
    assert [x.token_id for x in first[1:]] == prompt[1:]
    n = len(final.prompt_token_ids)
    for got, want in zip(first[n:], final.logprobs):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
    assert_no_leaks(scorer)


def test_logit_bias_forces_and_forbids_tokens_under_speculation(copying_target):
    target, head = copying_target
    llm = LLM(model=str(target), spec=SpecConfig(draft=str(head), lookup=False, adaptive=False), **KV)
    forced = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=8, seed=1, ignore_eos=True, logit_bias={42: 100}))
    assert all(o.token_ids == [42] * 8 for o in forced)
    greedy = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids
    banned = {t: -100 for t in greedy}
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias=banned))[0]
    assert not set(out.token_ids) & set(greedy)


@pytest.mark.parametrize("extreme", [
    dict(temperature=1e-5, top_p=1e-9),
    dict(temperature=1.0, min_p=1.0, repetition_penalty=2.0, frequency_penalty=2.0, presence_penalty=2.0),
    dict(temperature=2.0, logit_bias={i: -100 for i in range(0, 320, 2)}, top_k=2),
    dict(temperature=1e6, repetition_penalty=1e-3),
])
def test_extreme_parameters_never_fail_a_step(extreme, copying_target):
    target, head = copying_target
    llm = LLM(model=str(target), spec=SpecConfig(draft=str(head), lookup=True), **KV)
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=10, ignore_eos=True, **extreme)] * len(PROMPTS))
    assert all(o.finish_reason == "length" and len(o.token_ids) == 10 for o in outs)
    assert llm.engine.stats()["failed_steps"] == 0
