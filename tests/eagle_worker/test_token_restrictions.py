"""vLLM's token restrictions. `min_tokens`: no EOS or stop token within the first that many output
tokens, and a stop string ends the output only where it ends after their text; after them every stop
works as before. `allowed_token_ids`: only those tokens can be drawn. Both are part of the draw at
each output position, so speculation (head, lookup, hybrid) and seeded sampling give plain
decoding's tokens."""
from __future__ import annotations

import pytest

from eagle_worker import LLM, SamplingParams, SpecConfig

EOS = 2                     # the tiny models' eos_token_id (tests/conftest.py)
KV = dict(block_size=4, num_kv_blocks=512)
PROMPTS = ["The quick brown fox", "def add(a, b):\n", "Question: what is two plus two?\nAnswer:", "x",
           "The quick brown fox jumps over the lazy dog. The quick", "Bonjour"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir("llama")), draft=None, **KV)


@pytest.mark.parametrize("min_tokens", [0, 1, 5])
def test_a_forced_eos_comes_right_after_min_tokens(llm, min_tokens):
    """EOS biased to win every draw: it is the first token without min_tokens, the (min_tokens+1)-th with."""
    for temperature in (0.0, 1.0):
        out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=temperature, seed=3,
                                                      logit_bias={EOS: 100}, min_tokens=min_tokens))[0]
        assert out.finish_reason == "stop" and out.token_ids[-1] == EOS
        assert len(out.token_ids) == min_tokens + 1 and EOS not in out.token_ids[:-1], out.token_ids


def test_stop_token_ids_wait_for_min_tokens_too(llm):
    stop = 17
    kw = dict(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop], logit_bias={stop: 100})
    assert llm.generate(PROMPTS[1], SamplingParams(**kw))[0].token_ids == [stop]
    out = llm.generate(PROMPTS[1], SamplingParams(**kw, min_tokens=4))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop and len(out.token_ids) == 5
    assert stop not in out.token_ids[:-1]


def test_ignore_eos_with_min_tokens_leaves_eos_to_the_model(llm):
    """With ignore_eos, EOS is no stop, so min_tokens does not forbid it: the draw is plain decoding's."""
    kw = dict(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={EOS: 100})
    assert llm.generate(PROMPTS[0], SamplingParams(**kw, min_tokens=6))[0].token_ids == [EOS] * 8


def test_a_stop_string_must_end_after_the_first_min_tokens_tokens(llm):
    """As vLLM's detokenizer: stop strings are looked for only in the text after the first min_tokens
    tokens (one may begin before it), so min_tokens equal to the stopped length already moves the stop."""
    base = llm.generate(PROMPTS[2], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    early = llm.engine.tokenizer.decode(base.token_ids[:2]).strip()
    assert early, "the first two tokens should give some text to stop at"
    for stop in ([early[-1]], [early[-1], "a stop string far longer than anything here"]):
        kw = dict(max_tokens=16, temperature=0.0, ignore_eos=True, stop=stop)
        cut = llm.generate(PROMPTS[2], SamplingParams(**kw))[0]
        assert cut.finish_reason == "stop" and len(cut.token_ids) < 5, cut.token_ids
        out = llm.generate(PROMPTS[2], SamplingParams(**kw, min_tokens=len(cut.token_ids)))[0]
        assert len(out.token_ids) > len(cut.token_ids) and out.token_ids == base.token_ids[:len(out.token_ids)]


@pytest.mark.parametrize("text, new, stop, cut", [
    ("xxetyyyy", 2, ["et", "zzzzzzzzzz"], None),      # "et" ended before the new text: no stop now
    ("abcde", 1, ["de", "zzzz"], "abc"),               # ends in the new text
    ("abcde", 1, ["cde"], "ab"),                       # begins before it
    ("abcdef", 3, ["ef", "cd"], "ab"),                 # the one completed first wins, whatever the order
])
def test_a_stop_string_counts_only_where_it_ends_in_the_new_text(text, new, stop, cut):
    from types import SimpleNamespace

    from eagle_worker.engine import LLMEngine

    seq = SimpleNamespace(text=text, params=SimpleNamespace(stop=stop, include_stop_str_in_output=False))
    assert LLMEngine._hit_stop_string(None, seq, new) == (cut is not None)
    assert seq.text == (text if cut is None else cut)


def test_speculation_gives_plain_decodings_tokens_under_min_tokens(copying_target):
    """A likely (not certain) EOS: before min_tokens the head and lookup still draft it, and
    verification must refuse it exactly where plain decoding cannot draw it."""
    target, head = copying_target
    params = [SamplingParams(max_tokens=14, temperature=t, seed=100 + i, min_tokens=m, logit_bias={EOS: b})
              for i, (t, m, b) in enumerate([(0.0, 6, 6.0), (1.0, 6, 4.0), (0.0, 3, 9.0), (1.0, 9, 5.0),
                                            (0.0, 0, 6.0), (0.7, 5, 5.0)])]
    allowed = [EOS, 30, 31, 40, 41, 50, 77]
    params += [SamplingParams(max_tokens=14, temperature=t, seed=200 + i, allowed_token_ids=allowed, min_tokens=m)
               for i, (t, m) in enumerate([(0.0, 0), (1.0, 4)])]
    runs = {name: [o.token_ids for o in outs] for name, outs in
            outputs_by_method(target, head, PROMPTS + PROMPTS[:2], params).items()}
    assert runs["head"] == runs["plain"] and runs["lookup"] == runs["plain"] and runs["hybrid"] == runs["plain"]
    for ids, p in zip(runs["plain"], params):
        assert EOS not in ids[:p.min_tokens], (ids, p.min_tokens)
        assert not p.allowed_token_ids or set(ids) <= set(p.allowed_token_ids), ids
    assert any(ids[-1] == EOS and len(ids) < 14 for ids in runs["plain"]), "no run ended on EOS: the test checks nothing"


def outputs_by_method(target, head, prompts, params) -> dict:
    """Each method's outputs for the same requests: plain decoding, the head, lookup and the hybrid
    (fixed trees, so every step drafts); no step may fail."""
    fixed = dict(adaptive=False, depth=3, top_k=3, num_draft_tokens=6)
    runs = {}
    for name, spec in {"plain": None, "head": SpecConfig(draft=str(head), lookup=False, **fixed),
                       "lookup": SpecConfig(lookup=True, lookup_ngram=(1, 3), adaptive=False),
                       "hybrid": SpecConfig(draft=str(head), lookup=True, lookup_ngram=(1, 3), **fixed)}.items():
        llm = LLM(model=str(target), spec=spec, **KV)
        runs[name] = llm.generate(prompts, params)
        assert llm.engine.stats()["failed_steps"] == 0
    return runs


@pytest.mark.parametrize("kwargs", [dict(min_tokens=-1), dict(min_tokens=17), dict(min_tokens=True),
                                    dict(min_tokens=2.0), dict(min_tokens=None)])
def test_bad_min_tokens_name_the_field(kwargs):
    with pytest.raises(ValueError, match=r"SamplingParams\.min_tokens must be an integer in \[0, max_tokens=16\]"):
        SamplingParams(**kwargs)


def test_only_allowed_tokens_are_drawn_greedy_or_sampled(llm):
    base = llm.generate(PROMPTS[0], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0].token_ids
    allowed = [t for t in range(3, 200, 7) if t not in base][:6]
    for t in (0.0, 1.0, 1.5):
        out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=10, temperature=t, seed=9, ignore_eos=True,
                                                      allowed_token_ids=allowed))[0]
        assert len(out.token_ids) == 10 and set(out.token_ids) <= set(allowed), out.token_ids
    one = llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=1.0, seed=1, allowed_token_ids=[allowed[2]],
                                                  logit_bias={allowed[0]: 100}, ignore_eos=True))[0]
    assert one.token_ids == [allowed[2]] * 4          # the bias cannot bring back a token that is not allowed


@pytest.mark.parametrize("kwargs, needle", [
    (dict(allowed_token_ids=[]), "allowed_token_ids must be None or a non-empty list"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids must be None or a non-empty list"),
    (dict(allowed_token_ids=[True]), "allowed_token_ids must be None or a non-empty list"),
    (dict(allowed_token_ids="12"), "allowed_token_ids must be None or a non-empty list"),
])
def test_bad_allowed_token_ids_name_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_allowed_token_ids_the_engine_cannot_honour_are_refused(llm):
    with pytest.raises(ValueError, match=r"allowed_token_ids token ids out of range"):
        llm.engine.add_request("far", "x", SamplingParams(allowed_token_ids=[5, 10**6]))
    with pytest.raises(ValueError, match="allowed_token_ids: every allowed token ends the output"):
        llm.engine.add_request("eos-only", "x", SamplingParams(allowed_token_ids=[EOS], min_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("x", SamplingParams(allowed_token_ids=[EOS], max_tokens=3))[0].token_ids == [EOS]


def test_an_eos_id_beyond_the_models_vocabulary_fails_no_step(tiny_model_dir):
    """A tokenizer or generation config may name an EOS id the model has no logit for: min_tokens
    bans only the ids the model can draw, and the step runs."""
    llm = LLM(model=str(tiny_model_dir("llama")), draft=None, **KV)
    llm.engine.runner.eos_token_ids = set(llm.engine.runner.eos_token_ids) | {10**6}
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=6, temperature=0.0, min_tokens=3, logit_bias={EOS: 100}))
    assert [o.token_ids[-1] for o in outs] == [EOS, EOS] and [len(o.token_ids) for o in outs] == [4, 4]
    assert llm.engine.stats()["failed_steps"] == 0
