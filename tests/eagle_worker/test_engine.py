"""Engine behaviour on tiny random models: greedy parity with transformers, batching, chunked
prefill, preemption, seeds, stop rules, abort, bad input, and no leaked KV blocks."""
from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle_worker import LLM, SamplingParams, SpecConfig
from eagle_worker.config import EngineConfig
from eagle_worker.engine import LLMEngine
from tests.conftest import assert_no_leaks

PROMPTS = ["The quick brown fox", "Question: what is two plus two?\nAnswer:", "def add(a, b):\n",
           "Bonjour", "Speculative decoding drafts tokens and verifies them in one pass. The quick",
           "x", "The lazy dog", "two plus two"]


def hf_greedy(model, tokenizer, prompt: str, n: int) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    # no EOS stop, no min_new_tokens (which would mask EOS and change the argmax)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def family_setup(request, tiny_model_dir):
    path = tiny_model_dir(request.param)
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    return path, ref


def test_greedy_matches_transformers_alone_and_in_batch(family_setup):
    path, ref = family_setup
    llm = LLM(model=str(path), block_size=4, num_kv_blocks=256, draft=None)   # plain decoding
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = [hf_greedy(ref, llm.tokenizer, p, 16) for p in PROMPTS]
    alone = [llm.generate(p, params)[0].token_ids for p in PROMPTS[:3]]
    assert alone == expected[:3]
    batched = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in batched] == expected
    assert all(o.finish_reason == "length" and o.metrics["mean_accepted_tokens"] == 1.0 for o in batched)
    assert_no_leaks(llm.engine)


def test_chunked_prefill_and_preemption_do_not_change_greedy_output(tiny_model_dir):
    path = tiny_model_dir("llama")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = LLM(model=str(path), block_size=4, num_kv_blocks=512).generate(PROMPTS, params)
    # 5-token step budget chunks every prompt; 20 blocks of 4 cannot hold 8 sequences of 30-70 tokens -> preemption
    tight = LLM(model=str(path), block_size=4, num_kv_blocks=20, max_num_batched_tokens=5)
    outs = tight.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert_no_leaks(tight.engine)


def test_prompt_logprobs_survive_a_preemption_mid_prefill(tiny_model_dir):
    """An offline request preempted halfway through its prompt is recomputed in other chunks; it lost
    the prompt logprobs of every chunk after the first pass's (14 of 40 delivered)."""
    path = str(tiny_model_dir("llama"))

    def engine(**kw):
        return LLMEngine(EngineConfig(model=path, draft=None, block_size=4, num_kv_blocks=64,
                                      enable_prefix_caching=False, offline_slowdown=None, **kw))

    def short(start):
        return list(range(start, start + 4))

    quick = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    scored = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    eng, prompt, got, ends = engine(max_num_seqs=3, max_num_batched_tokens=16), list(range(10, 50)), {}, {}
    eng.add_request("C", short(60), quick)
    eng.add_request("D", short(80), quick)
    eng.step()
    eng.add_request("B", prompt, scored, priority=1)          # offline: the one preempted
    eng.step()
    eng.step()                                                 # B's first two chunks
    eng.add_request("A", short(70), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.prompt_logprobs is not None:
                got[o.request_id] = o.prompt_logprobs
            if o.finished:
                ends[o.request_id] = o
    assert ends["B"].metrics["num_preemptions"] == 1
    alone = engine()
    alone.add_request("B", prompt, scored)
    want = next(o.prompt_logprobs for o in alone.step() if o.prompt_logprobs is not None)
    assert len(got["B"]) == len(want) == len(prompt) and got["B"][0] is None
    for a, b in zip(got["B"][1:], want[1:]):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert_no_leaks(eng)


def test_seed_gives_same_sample_alone_and_in_batch(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=256)
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], seeded)[0].token_ids
    others = [SamplingParams(max_tokens=20, temperature=0.8, ignore_eos=True) for _ in PROMPTS[1:]]
    batched = llm.generate(PROMPTS, [seeded] + others)[0].token_ids
    assert alone == batched
    different = llm.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True))
    assert different[0].token_ids != alone


def test_stop_token_ids_stop_strings_and_logprobs(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=256)
    base = llm.generate(PROMPTS[1], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[stop_id], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: first + 1]
    # the stop token's own text is not output (vLLM), unless include_stop_str_in_output
    tok = llm.tokenizer
    assert out.text == tok.decode(base.token_ids[:first], skip_special_tokens=True)
    kept = llm.generate(PROMPTS[1], SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[stop_id],
                                                   ignore_eos=True, include_stop_str_in_output=True))[0]
    assert kept.text == tok.decode(base.token_ids[: first + 1], skip_special_tokens=True) != out.text
    # stop string: the first two characters from the middle on that are not all whitespace
    mid = len(base.text) // 2
    stop_str = next(base.text[i: i + 2] for i in range(mid, len(base.text) - 1) if base.text[i: i + 2].strip())
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=16, temperature=0.0, stop=[stop_str], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and stop_str not in out.text and base.text.startswith(out.text)
    assert out.text == base.text[: base.text.index(stop_str)]
    lp = llm.generate(PROMPTS[1], SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, ignore_eos=True))[0]
    assert [x.token_id for x in lp.logprobs] == lp.token_ids and all(x.logprob <= 0 and not x.top for x in lp.logprobs)


@pytest.mark.parametrize("stop, include, kept", [
    (["b", "a"], False, "x"), (["a", "b"], False, "x"),     # "b" first in the list, "a" first in the text
    (["bcd", "c"], False, "xab"), (["bcd", "c"], True, "xabc"),   # "c" is completed first
    (["ab", "a"], True, "xa"), (["zz"], False, None),
])
def test_new_text_is_cut_at_the_stop_string_it_completes_first(stop, include, kept):
    """Several characters arrive at once: the list's order decided which stop cut them, so the text
    kept could still hold another stop string (`stop=["b", "a"]`, new text "ab": "xa")."""
    from types import SimpleNamespace

    seq = SimpleNamespace(text="xabcd", params=SimpleNamespace(stop=stop, include_stop_str_in_output=include))
    assert LLMEngine._hit_stop_string(None, seq, 4) == (kept is not None)
    assert seq.text == (kept if kept is not None else "xabcd")


@pytest.mark.parametrize("stop, reason, text", [(["b\ufffd"], "stop", "xa"), (["zz"], "length", "xab\ufffd")])
def test_text_flushed_when_a_request_ends_is_checked_against_stop_strings(stop, reason, text):
    """Text held back for a partial character is flushed at the end; a stop string it completes
    cuts it and makes the reason "stop", as if the text had come a character at a time."""
    from types import SimpleNamespace

    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "xab\ufffd")
    seq = SimpleNamespace(text="xa", output_token_ids=[1, 2, 3], num_output_tokens=3, metrics=SimpleNamespace(),
                          params=SimpleNamespace(stop=stop, include_stop_str_in_output=False, min_tokens=0))
    engine = SimpleNamespace(tokenizer=tokenizer)
    engine._hit_stop_string = lambda s, n: LLMEngine._hit_stop_string(engine, s, n)
    LLMEngine._finish(engine, seq, "length")
    assert (seq.finish_reason, seq.text) == (reason, text)


def _streamed(engine: LLMEngine, prompt: str, params: SamplingParams) -> tuple[list[str], object]:
    engine.add_request("r", prompt, params)
    deltas, last = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.delta_text)
            last = out
    return deltas, last


def test_streamed_text_never_runs_past_a_stop_string_that_spans_tokens(tiny_model_dir):
    """The deltas hold back what could start a stop string, so what a client assembles from the
    stream is the final text (vLLM's rule), also when the stop string ends in a later token."""
    llm = LLM(model=str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=256, draft=None)
    plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    deltas, base = _streamed(llm.engine, PROMPTS[1], plain)
    assert "".join(deltas) == base.text
    bounds = [sum(len(d) for d in deltas[:i]) for i in range(1, len(deltas))]
    text = base.text
    stop = next(text[b - 1: b + 1] for b in bounds if 0 < b < len(text) and text[b - 1: b + 1].strip()
                and text.index(text[b - 1: b + 1]) == b - 1)                # first seen across a token boundary
    deltas, out = _streamed(llm.engine, PROMPTS[1], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                                  stop=[stop, "an unseen longer stop string"]))
    assert out.finish_reason == "stop" and out.text == text[: text.index(stop)]
    assert "".join(deltas) == out.text


def eos_forcing_model(path, tmp_path, token: int):
    """A copy of the tiny model whose EOS row of the LM head is 1.5x the row of `token`: wherever
    `token` is the greedy choice with a positive logit, EOS now is (its logit is 1.5x that)."""
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    eos = model.config.eos_token_id
    assert not model.config.tie_word_embeddings
    with torch.no_grad():
        w = model.get_output_embeddings().weight
        w[eos] = 1.5 * w[token]
    out = tmp_path / "eos-forcing"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(path).save_pretrained(out)
    return out


def test_eos_stops_generation_and_is_the_last_token(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    base = LLM(model=str(path), block_size=4, num_kv_blocks=256).generate(
        PROMPTS[1], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    llm = LLM(model=str(eos_forcing_model(path, tmp_path, base.token_ids[4])), block_size=4, num_kv_blocks=256)
    eos = llm.tokenizer.eos_token_id
    forced = llm.generate(PROMPTS[1], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert eos in forced.token_ids[:5], forced.token_ids  # the construction works: greedy does pick EOS
    cut = forced.token_ids.index(eos) + 1
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.token_ids == forced.token_ids[:cut] and out.token_ids[-1] == eos
    # EOS in the stop rule means the model's EOS, not `stop_token_ids`: an empty list still stops
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[]))[0]
    assert out.finish_reason == "stop" and out.token_ids == forced.token_ids[:cut]
    # ignore_eos: EOS is generated like any token and the request runs to max_tokens
    assert forced.finish_reason == "length" and len(forced.token_ids) == 16
    assert_no_leaks(llm.engine)


def test_incremental_outputs_and_abort(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=256))
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    deltas, tokens = {"a": "", "b": ""}, {"a": [], "b": []}
    finished = {}
    for _ in range(12):
        for out in engine.step():
            deltas[out.request_id] += out.delta_text
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out
    assert finished["a"].text == deltas["a"] and finished["a"].token_ids == tokens["a"]
    assert "b" not in finished
    assert engine.abort("b") and not engine.abort("nope")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason, o.finished) for o in outs] == [("b", "abort", True)]
    assert_no_leaks(engine)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"), (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(min_p=2.0), "min_p"),
    (dict(seed=2**64), "seed"), (dict(seed=2**63), "seed"), (dict(seed=-1), "seed"), (dict(seed=1.5), "seed"),
    (dict(logprobs=21), "logprobs"), (dict(logprobs=True), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=3.0), "repetition_penalty"),
    (dict(logit_bias={5: 101}), "logit_bias"), (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={-1: 1}), "logit_bias"), (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(logit_bias={True: 1}), "logit_bias"), (dict(logit_bias={"\u0665": 1}), "logit_bias"),
    (dict(max_tokens=True), "max_tokens"), (dict(top_k=True), "top_k"),
    (dict(stop=[1]), "stop"), (dict(stop=b"x"), "stop"), (dict(stop=[None, "a"]), "stop"),
    (dict(stop=""), "stop must not hold an empty string"), (dict(stop=["a", ""]), "stop must not hold an empty"),
    (dict(stop_token_ids=["a"]), "stop_token_ids"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids="ab"), "stop_token_ids"),
    (dict(ignore_eos="no"), "ignore_eos"), (dict(ignore_eos=2), "ignore_eos"),
    (dict(include_stop_str_in_output="no"), "include_stop_str_in_output"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_requests_are_refused_and_engine_keeps_serving(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=64, max_model_len=64))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e1", "", SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e2", [], SamplingParams())
    with pytest.raises(ValueError, match="maximum context"):
        engine.add_request("e3", "fox " * 200, SamplingParams())
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request("e4", [1, 5, 10**6], SamplingParams())
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.add_request("e5", "hi", {"max_tokens": 3})
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("e6", "hi", SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="stop_token_ids token ids out of range"):
        engine.add_request("e7", "hi", SamplingParams(stop_token_ids=[3, 10**6]))
    with pytest.raises(ValueError, match="position 1 is str"):
        engine.add_request("e8", [5, "hi"], SamplingParams())
    with pytest.raises(ValueError, match="position 2 is bool"):
        engine.add_request("e9", [5, 6, True], SamplingParams())
    with pytest.raises(ValueError, match="not valid Unicode text .* at character 4"):
        engine.add_request("e10", "abc \ud800 def", SamplingParams())
    changed = SamplingParams(max_tokens=3)
    changed.max_tokens = 0                         # set after building: checked again when the request is added
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("e11", "hi", changed)
    changed = SamplingParams(max_tokens=3)
    changed.temperature = float("nan")
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("e12", "hi", changed)
    engine.tokenize = lambda text: [5, 10**6]      # a tokenizer with more ids than the model's embedding
    with pytest.raises(ValueError, match=r"out of range \[0, \d+\): \[1000000\]"):
        engine.add_request("e13", "hi", SamplingParams())
    del engine.tokenize
    for i, priority in enumerate(("high", None, 0.5, True, -1)):   # a non-integer broke every later step
        with pytest.raises(ValueError, match=f"priority must be an integer >= 0 .*got {priority!r}"):
            engine.add_request(f"p{i}", "hi", SamplingParams(), priority=priority)
    mine = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("ok", "The quick", mine)
    mine.max_tokens = 50                           # the running request keeps what it was added with
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("ok", "again", SamplingParams())
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and len(outs[-1].token_ids) == 3
    assert_no_leaks(engine)


def test_a_prompt_longer_in_characters_than_the_context_holds_is_refused_untokenized(tiny_model_dir, monkeypatch):
    """No token has more characters than its longest vocabulary piece: a longer text cannot fit, and
    tokenizing 50 MB on the engine thread would stall every running request first."""
    from cluster.replica_errors import guess_param

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=64, max_model_len=64))
    limit = 64 * engine.prompts.max_chars_per_token
    tokenized = []
    monkeypatch.setattr(engine.prompts, "tokenize", lambda text: tokenized.append(len(text)) or [5, 6])
    with pytest.raises(ValueError) as e:
        engine.add_request("long", "x" * (limit + 1), SamplingParams())
    assert str(e.value) == (f"This model's maximum context length is 64 tokens. However, your prompt has {limit + 1} "
                            f"characters, more than that many tokens hold (at most {limit}). Please reduce the length "
                            "of the prompt.")
    assert tokenized == [] and guess_param(str(e.value)) == "prompt" and e.value.code == "context_length_exceeded"
    with pytest.raises(ValueError, match="However, your prompt has 64 tokens, and at least one token") as e:
        engine.add_request("full", [5] * 64, SamplingParams())      # counted in tokens too
    assert e.value.code == "context_length_exceeded"
    engine.add_request("fits", "x" * limit, SamplingParams(max_tokens=1))    # at the bound: tokenized, then counted
    assert tokenized == [limit]


def test_generation_stops_at_max_model_len(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=64, max_model_len=20)
    out = llm.generate("The quick brown fox", SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 20


def test_unknown_model_and_bad_config_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="no-such-model"):
        LLM(model="no-such-model")
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float8")


@pytest.mark.parametrize("temperature", [1e-45, 5e-324, 1e-6])
def test_a_temperature_too_small_to_sample_at_is_greedy(tiny_model_dir, temperature):
    """Dividing logits by a subnormal temperature gives inf and NaN probabilities: such requests
    decode greedily (as vLLM does below 1e-5) instead of crashing the step, beside other requests."""
    llm = LLM(model=str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=64)
    greedy = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    tiny, other = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=8, temperature=temperature, ignore_eos=True),
                                             SamplingParams(max_tokens=8, temperature=1.0, seed=1, ignore_eos=True)])
    assert tiny.token_ids == greedy.token_ids and len(other.token_ids) == 8
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1e-9])
def test_a_temperature_that_is_not_a_finite_non_negative_number_is_refused(bad):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=bad)


def test_a_step_that_raises_fails_its_requests_and_the_engine_goes_on(tiny_model_dir):
    """The requests of a step that raised finish with "error" and the cause, their KV is freed, a
    request that was waiting outside that step finishes normally, and the engine serves the next."""
    llm = LLM(model=str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=64, max_num_seqs=2)
    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = llm.generate(PROMPTS[2], params)[0].token_ids
    execute, calls = engine.worker.execute, []

    def fail_second_step(batch):
        calls.append([it.seq.request_id for it in batch])
        if len(calls) == 2:
            raise RuntimeError("injected step failure")
        return execute(batch)

    engine.worker.execute = fail_second_step
    for rid, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[1]), ("c", PROMPTS[2])):
        engine.add_request(rid, prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert calls[1] == ["a", "b"]                               # max_num_seqs=2: c waited outside
    for rid in ("a", "b"):
        assert finals[rid].finish_reason == "error" and "injected step failure" in finals[rid].error
    assert finals["c"].finish_reason == "length" and finals["c"].token_ids == expected and finals["c"].error is None
    assert engine.stats()["failed_steps"] == 1
    assert llm.generate(PROMPTS[2], params)[0].token_ids == expected
    assert_no_leaks(engine)


def test_a_request_whose_output_fails_fails_alone_and_the_llm_stays_usable(tiny_model_dir, monkeypatch):
    """An error after the step (detokenizing, stop checks) ends that request with "error" and the
    cause; the request beside it in the batch finishes, nothing stays queued, and the next call runs."""
    import eagle_worker.engine as engine_module

    llm = LLM(model=str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=64)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = llm.generate(PROMPTS[1], params)[0].token_ids
    real = engine_module.detokenize_incrementally

    def broken_for_the_first(tokenizer, seq):
        if seq.prompt_token_ids == llm.engine.tokenize(PROMPTS[0]):
            raise RuntimeError("injected output failure")
        return real(tokenizer, seq)

    monkeypatch.setattr(engine_module, "detokenize_incrementally", broken_for_the_first)
    bad, good = llm.generate([PROMPTS[0], PROMPTS[1]], params)
    assert bad.finish_reason == "error" and "injected output failure" in bad.error
    assert good.finish_reason == "length" and good.token_ids == expected
    assert not llm.engine.requests and llm.generate(PROMPTS[1], params)[0].token_ids == expected
    assert_no_leaks(llm.engine)


def test_an_interrupted_generate_leaves_nothing_queued(tiny_model_dir):
    """Ctrl-C (or any error) in the middle of `generate` aborts that call's requests: the engine holds
    no request and no KV block afterwards, and the next call runs normally."""
    llm = LLM(model=str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=64)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = llm.generate(PROMPTS[0], params)[0].token_ids
    step, calls = llm.engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step()

    llm.engine.step = interrupted_step
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, params)
    llm.engine.step = step
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()
    assert llm.generate(PROMPTS[0], params)[0].token_ids == expected
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(kv_cache_gb=float("nan")), "kv_cache_gb must be a positive number"),
    (dict(kv_cache_gb=float("inf")), "kv_cache_gb must be a positive number"),
    (dict(kv_cache_gb="1"), "kv_cache_gb='1'"), (dict(max_model_len=0), "max_model_len must be at least 2"),
    (dict(max_model_len=1), "max_model_len must be at least 2"),
    (dict(max_model_len=2.5), "max_model_len=2.5"), (dict(num_kv_blocks=-3), "num_kv_blocks must be a positive"),
    (dict(enable_prefix_caching="no"), "enable_prefix_caching='no'"), (dict(max_num_seqs=None), "max_num_seqs=None"),
    (dict(draft=5), "draft=5"), (dict(model=""), "model=''"),
    (dict(tp_size=0), "tp_size must be at least 1"), (dict(seed=-1), "seed must be an integer in [0, 2**63)"),
    (dict(seed=2**70), "seed must be an integer in [0, 2**63)"),
    (dict(offline_slowdown="x"), "offline_slowdown must be a number or None"),
    (dict(offline_slowdown=True), "offline_slowdown must be a number or None"),
    (dict(spec={"depth": 3}), "spec must be a SpecConfig, None or 'auto', got dict"),
    (dict(draft="/tmp/nope", spec=SpecConfig(lookup=True)), "disagree"),
    (dict(draft="default", spec=None), "disagree"),
])
def test_engine_settings_of_the_wrong_type_or_range_name_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        EngineConfig(**kwargs)


def test_a_kv_cache_larger_than_the_machine_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ValueError, match="cannot allocate .* GiB for the KV cache .* lower kv_cache_gb"):
        LLM(model=str(tiny_model_dir("llama")), kv_cache_gb=1e6)


def test_a_model_folder_whose_config_cannot_build_a_model_is_named(tiny_model_dir, tmp_path):
    import json
    import shutil

    src = tiny_model_dir("llama")
    for name, edit, needle in (("garbage", None, "cannot read its config.json"),
                               ("no-heads", {"num_attention_heads": 0}, "cannot read its config.json"),
                               ("negative", {"max_position_embeddings": -5}, "does not describe a model")):
        folder = shutil.copytree(src, tmp_path / name)
        if edit is None:
            (folder / "config.json").write_text("not json")
        else:
            cfg = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps(cfg | edit))
        with pytest.raises(ValueError, match=f"model '{re.escape(str(folder))}': .*{needle}"):
            LLM(model=str(folder))
    for device in ("bogus", "mps", "meta"):
        with pytest.raises(ValueError, match="expected cpu, cuda or cuda:N"):
            EngineConfig(model=str(src), device=device)
