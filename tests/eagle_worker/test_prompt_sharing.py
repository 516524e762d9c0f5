"""Identical prompts in flight are prefilled once (`n` samples, duplicate job rows): followers copy the
leader's prompt KV and feed only the last prompt token, and their tokens are exactly what each would
sample alone (keyed sampling makes that checkable), with plain decoding and with the EAGLE head."""
from __future__ import annotations

import pytest

from eagle_worker import LLM, SamplingParams, SpecConfig
from tests.conftest import assert_no_leaks

PROMPT = "The quick brown fox jumps over the lazy dog and runs"
OTHER = "def add(a, b):\n"
KV = dict(block_size=4, num_kv_blocks=512)


def _params(i: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=10, temperature=1.0, seed=100 + i, ignore_eos=True, **kw)


@pytest.fixture(scope="module", params=["plain", "head"])
def llm(request, copying_target):
    target, head = copying_target
    spec = SpecConfig(draft=str(head), adaptive=False, depth=3, top_k=3, num_draft_tokens=6) if request.param == "head" \
        else None
    return LLM(model=str(target), spec=spec, **KV)


def test_n_samples_prefill_once_and_sample_as_alone(llm):
    alone = [llm.generate(PROMPT, _params(i))[0] for i in range(4)]
    before = llm.engine.totals["shared_prompt_tokens"]
    outs = llm.generate([PROMPT, PROMPT, OTHER, PROMPT, PROMPT], [_params(0), _params(1), _params(9), _params(2),
                                                                  _params(3)])
    together = [outs[i] for i in (0, 1, 3, 4)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert len({tuple(o.token_ids) for o in together}) > 1          # four samples, not one text four times
    n = len(alone[0].prompt_token_ids) - 1
    assert [o.metrics["num_cached_tokens"] for o in outs] == [0, n, 0, n, n]
    assert llm.engine.totals["shared_prompt_tokens"] - before == 3 * n
    if llm.engine.config.spec is not None:   # the followers' head had the prompt's context: it drafts as alone
        # a follower also drafts for its first token (one more forward than alone, where prefill gave it)
        forwards = sum(o.metrics["num_target_forwards"] for o in together[1:])
        assert forwards <= sum(o.metrics["num_target_forwards"] for o in alone[1:]) + 3, forwards
    assert_no_leaks(llm.engine)


def test_followers_prefill_themselves_when_the_leader_is_aborted(llm):
    alone = [llm.generate(PROMPT, _params(i))[0].token_ids for i in (1, 2)]
    eng = llm.engine
    for i in range(3):
        eng.add_request(f"r{i}", PROMPT, _params(i))
    assert eng.abort("r0")                         # the leader goes before its prefill ran
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert done["r0"].finish_reason == "abort"
    assert [done["r1"].token_ids, done["r2"].token_ids] == alone
    assert done["r1"].metrics["num_cached_tokens"] == 0                  # prefilled by itself
    assert done["r2"].metrics["num_cached_tokens"] == len(done["r2"].prompt_token_ids) - 1   # r1 led it
    assert_no_leaks(eng)


def test_prompt_logprobs_and_a_less_urgent_holder_do_not_share(llm):
    eng = llm.engine
    before = eng.totals["shared_prompt_tokens"]
    outs = llm.generate([PROMPT, PROMPT], [_params(0), _params(1, prompt_logprobs=2)])
    assert outs[1].metrics["num_cached_tokens"] == 0 and outs[1].prompt_logprobs is not None
    eng.add_request("a", PROMPT, _params(0), priority=1)
    eng.add_request("b", PROMPT, _params(1), priority=0)   # does not wait for a's prefill
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.totals["shared_prompt_tokens"] == before
    assert_no_leaks(eng)


def test_a_prompt_arriving_while_another_holds_it_copies_it_at_once(llm):
    """Later arrivals (the n samples reach a replica one by one) copy the running holder's prompt KV,
    head KV included once the head has consumed the prompt, and still sample exactly as alone."""
    import torch

    alone = [llm.generate(PROMPT, _params(i))[0].token_ids for i in range(3)]
    eng = llm.engine
    for layer in eng.worker.head.attention_layers() if eng.config.spec is not None else []:
        layer.k_cache.normal_()         # slots the head never wrote hold noise, so a missed copy shows
        layer.v_cache.normal_()
    eng.add_request("h", PROMPT, _params(0))
    for _ in range(3):
        eng.step()                                          # h prefilled and decoding
    eng.add_request("c1", PROMPT, _params(1))
    n = eng.requests["c1"].num_prompt_tokens - 1
    assert eng.requests["c1"].num_computed_tokens == n      # copied on arrival
    if eng.config.spec is not None:
        h, c1 = eng.requests["h"], eng.requests["c1"]
        done = eng.worker.states["c1"].draft.start
        assert done == min(eng.worker.states["h"].draft.start, n) and done > 0
        src, dst = eng.block_manager.slots(h, 0, done), eng.block_manager.slots(c1, 0, done)
        for layer in eng.worker.head.attention_layers():
            assert torch.equal(layer.k_cache[dst], layer.k_cache[src])
    eng.step()
    eng.add_request("c2", PROMPT, _params(2))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert [done[r].token_ids for r in ("h", "c1", "c2")] == alone
    assert [done[r].metrics["num_cached_tokens"] for r in ("h", "c1", "c2")] == [0, n, n]
    assert_no_leaks(eng)


def test_a_follower_starts_with_the_heads_inputs_for_the_whole_prompt(copying_target):
    """The head has written no KV for a prompt before its first draft; a follower that took the
    leader's KV must take its pending (feature, next token) pairs too, or its head drafts blind."""
    import torch

    target, head = copying_target
    eng = LLM(model=str(target), spec=SpecConfig(draft=str(head), adaptive=False), **KV).engine
    eng.add_request("lead", PROMPT, _params(0))
    eng.add_request("follow", PROMPT, _params(1))
    eng.step()                                              # the leader's prefill; the follower forks
    lead, follow = eng.worker.states["lead"].draft, eng.worker.states["follow"].draft
    prompt = eng.requests["follow"].prompt_token_ids
    assert follow.start == 0 and follow.tokens == prompt[1:]
    assert torch.equal(torch.cat(follow.features), torch.cat(lead.features)[:len(prompt) - 1])
    while eng.has_unfinished_requests():
        eng.step()
    assert_no_leaks(eng)
