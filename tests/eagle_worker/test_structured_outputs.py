"""Structured outputs: the output matches the request's JSON schema, regex, choice or grammar, greedy
or sampled; the grammar is part of each position's draw, so speculation (head, lookup, hybrid) gives
plain decoding's tokens; bad specs are refused naming the field; a matcher that fails fails its own
request, never the step it shares."""
from __future__ import annotations

import json
import re

import pytest

from eagle_worker import LLM, SamplingParams, StructuredOutputs

from .test_token_restrictions import KV, PROMPTS, outputs_by_method  # the tiny model's settings, prompts, methods


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir("llama")), draft=None, **KV)


def _texts(llm, prompts, params):
    return [(o.text, o.finish_reason) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_regex_or_a_choice_is_what_comes_out(llm, temperature):
    rx = r"(ab|cd)[0-9]{2,4}!"
    for text, reason in _texts(llm, PROMPTS, SamplingParams(max_tokens=24, temperature=temperature, seed=5,
                                                            structured_outputs=StructuredOutputs(regex=rx))):
        assert reason == "stop" and re.fullmatch(rx, text), (text, reason)
    choices = ["red", "green", "a blue one"]
    got = _texts(llm, PROMPTS, SamplingParams(max_tokens=24, temperature=temperature, seed=5,
                                              structured_outputs={"choice": choices}))
    assert all(reason == "stop" and text in choices for text, reason in got), got


def test_unconstrained_text_would_not_match(llm):
    """The regex test above checks something: without the grammar the tiny model writes other text."""
    free = _texts(llm, PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
    assert not any(re.fullmatch(r"(ab|cd)[0-9]{2,4}!", text) for text, _ in free)


def test_a_json_schema_gives_json_that_validates(llm):
    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    for temperature in (0.0, 1.0):
        for text, reason in _texts(llm, PROMPTS[:3], SamplingParams(max_tokens=64, temperature=temperature, seed=2,
                                                                    structured_outputs=StructuredOutputs(
                                                                        json=schema, disable_any_whitespace=True))):
            assert reason == "stop" and " " not in text, text
            jsonschema.validate(json.loads(text), schema)
    obj = _texts(llm, PROMPTS[:2], SamplingParams(max_tokens=64, temperature=0.0, structured_outputs={"json_object": True}))
    for text, reason in obj:
        assert reason in ("stop", "length"), text
        assert text.lstrip().startswith("{") and (reason == "length" or isinstance(json.loads(text), dict)), text


def test_a_lark_grammar_and_a_gbnf_grammar(llm):
    lark = 'start: "yes" | "no" | NUMBER\nNUMBER: /[1-9][0-9]?/'
    gbnf = 'root ::= "A" [0-9] [0-9] "Z"'
    for grammar, rx in ((lark, r"yes|no|[1-9][0-9]?"), (gbnf, r"A[0-9]{2}Z")):
        for text, reason in _texts(llm, PROMPTS[:4], SamplingParams(max_tokens=16, temperature=1.0, seed=8,
                                                                    structured_outputs={"grammar": grammar})):
            assert re.fullmatch(rx, text) and reason == "stop", (grammar, text, reason)


def test_stop_strings_and_logprobs_work_under_a_grammar(llm):
    """A stop string cuts the matched text as without a grammar; logprobs come for every kept token and
    are the raw distribution's (the grammar masks the draw, not what is reported)."""
    rx = "[a-z]{12}"
    whole = llm.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.0, logprobs=2,
                                                    structured_outputs={"regex": rx}))[0]
    assert re.fullmatch(rx, whole.text) and len(whole.logprobs) == len(whole.token_ids)
    raw = llm.generate(PROMPTS[0], SamplingParams(max_tokens=1, temperature=0.0, logprobs=2))[0].logprobs[0]
    assert [t for t, _ in whole.logprobs[0].top] == [t for t, _ in raw.top]      # the raw top-2 at the first position
    assert [v for _, v in whole.logprobs[0].top] == pytest.approx([v for _, v in raw.top], abs=1e-5)
    stop = whole.text[3:5]
    cut = llm.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.0, stop=[stop],
                                                  structured_outputs={"regex": rx}))[0]
    assert cut.finish_reason == "stop" and cut.text == whole.text[:whole.text.index(stop)]


def test_max_tokens_cuts_a_match_with_length(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.0,
                                                  structured_outputs={"regex": "[a-z]{40}"}))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3 and re.fullmatch("[a-z]+", out.text)


def test_speculation_gives_plain_decodings_tokens_under_a_grammar(copying_target):
    """The head and lookup draft the prompt's tokens, which the grammar mostly forbids: verification
    must accept exactly where plain decoding's masked draw agrees, greedy and sampled."""
    target, head = copying_target
    specs = [StructuredOutputs(regex=r"[a-z ]{3,30}\."), StructuredOutputs(choice=["quick", "brown fox", "lazy dog"]),
             StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}),
             StructuredOutputs(regex=r"(The quick brown fox )+")]
    params = [SamplingParams(max_tokens=20, temperature=t, seed=40 + i, structured_outputs=s)
              for i, (s, t) in enumerate((s, t) for s in specs for t in (0.0, 1.0))]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    runs = {}
    for name, outs in outputs_by_method(target, head, prompts, params).items():
        runs[name] = [(o.token_ids, o.finish_reason) for o in outs]
        if name != "plain":     # drafts were accepted under the masks: the comparison checks verification
            assert max(o.metrics["mean_accepted_tokens"] for o in outs) > 1.2, name
    assert runs["head"] == runs["plain"] and runs["lookup"] == runs["plain"] and runs["hybrid"] == runs["plain"]


@pytest.mark.parametrize("spec, needle", [
    (dict(), "must set exactly one of json, regex, choice, grammar, json_object; got none"),
    (dict(regex="a", choice=["b"]), r"must set exactly one .* got \['regex', 'choice'\]"),
    (dict(json="{not json"), "json is not valid JSON"),
    (dict(json='{"type": "object", "type": "array"}'), "json is not valid JSON: the key 'type' appears twice"),
    (dict(json=[1, 2]), "json must be a JSON schema"),
    (dict(regex=""), "regex must be a non-empty string"),
    (dict(grammar=7), "grammar must be a non-empty string"),
    (dict(choice=[]), "choice must be a list of 1 to 1024 non-empty strings"),
    (dict(choice=["a", ""]), "choice must be a list of 1 to 1024 non-empty strings"),
    (dict(choice="ab"), "choice must be a list of 1 to 1024 non-empty strings"),
    (dict(json_object=1), "json_object must be true or false"),
    (dict(regex="a", disable_any_whitespace=None), "disable_any_whitespace must be true or false"),
    (dict(regex="a" * (64 * 1024 + 1)), "regex is longer than 65536 characters"),
    (dict(choice=["x" * 70] * 1000), "choice is longer than 65536 characters"),
    (dict(json=True), "json must be a JSON schema object, got bool"),
    (dict(json="true"), "json must be a JSON schema object, got bool"),
    (dict(json="[" * 100_000 + "]" * 100_000), "json is nested too deeply"),
    (dict(json={"a": float("nan")}), "json is not JSON"),
    (dict(regex="a+", disable_any_whitespace=True), "disable_any_whitespace applies to json and json_object, not regex"),
])
def test_bad_specs_name_the_field(spec, needle):
    with pytest.raises(ValueError, match=r"SamplingParams\.structured_outputs " + needle):
        StructuredOutputs(**spec)
    with pytest.raises(ValueError, match=r"SamplingParams\.structured_outputs " + needle):
        SamplingParams(structured_outputs=spec)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(structured_outputs={"regexp": "a"}), r"has unknown field\(s\) \['regexp'\]"),
    (dict(structured_outputs="a+"), "must be a StructuredOutputs or a dict of its fields, got str"),
    (dict(structured_outputs={"regex": "a"}, min_tokens=2), "cannot be combined with min_tokens or allowed_token_ids"),
    (dict(structured_outputs={"regex": "a"}, allowed_token_ids=[3]), "cannot be combined with min_tokens"),
])
def test_bad_sampling_params_name_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=r"SamplingParams\.structured_outputs " + needle):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("spec, needle", [
    (dict(regex="a(b"), "regex: (?s:.*)unclosed group"),
    (dict(grammar="start: foo"), "grammar: (?s:.*)foo"),
    (dict(json={"type": "nonsense"}), "json_schema: (?s:.*)nonsense"),
])
def test_a_grammar_that_does_not_compile_is_refused_before_it_runs(llm, spec, needle):
    with pytest.raises(ValueError, match=r"SamplingParams\.structured_outputs " + needle):
        StructuredOutputs(**spec).compile()
    with pytest.raises(ValueError, match=r"SamplingParams\.structured_outputs " + needle):
        llm.engine.add_request("bad-grammar", "x", SamplingParams(structured_outputs=spec))
    assert not llm.engine.has_unfinished_requests()


def test_a_matcher_failing_mid_output_fails_its_request_alone(llm):
    """A schema past the parser's limits after its first token (2,000 optional properties): its
    request ends with an error naming the grammar, and without the refused token; the request beside
    it in the same steps finishes as if alone."""
    big = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(2000)}}
    ok = SamplingParams(max_tokens=6, temperature=0.0, structured_outputs={"regex": "[a-z]+"})
    alone = llm.generate(PROMPTS[1], ok)[0]
    engine = llm.engine
    engine.add_request("ok", PROMPTS[1], ok)
    engine.add_request("broken", PROMPTS[1], SamplingParams(max_tokens=6, temperature=1.0, seed=1,
                                                            structured_outputs={"json": big}))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    broken = outs["broken"]
    assert broken.finish_reason == "error" and "structured output's grammar failed" in broken.error, broken
    assert "items" in broken.error and len(broken.token_ids) <= 1
    assert outs["ok"].token_ids == alone.token_ids and engine.stats()["failed_steps"] == 0


@pytest.mark.parametrize("spec", [{"grammar": 'start: start "a"'},                      # left recursion, no base
                                  {"json": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}])
def test_a_grammar_that_cannot_produce_anything_is_refused_when_added(llm, spec):
    """It compiles (the ingress cannot tell), but its first mask fails: refused by the engine (a 400
    over HTTP), never an empty output that looks finished."""
    with pytest.raises(ValueError, match=r"SamplingParams\.structured_outputs \w+: the grammar cannot produce any output"):
        llm.engine.add_request("never", "x", SamplingParams(structured_outputs=spec))
    assert not llm.engine.has_unfinished_requests()


def test_whatever_llguidance_raises_is_the_requests_refusal_not_the_engines_end(llm, monkeypatch):
    """On a replica, add_request runs on the engine thread: only a ValueError is a refusal there."""
    import llguidance

    class Panicking:      # compiles as the real one; building a matcher raises
        validate_grammar = staticmethod(llguidance.LLMatcher.validate_grammar)

        def __init__(self, *a, **k):
            raise RuntimeError("a panic in the matcher")

    monkeypatch.setattr(llguidance, "LLMatcher", Panicking)
    with pytest.raises(ValueError, match=r"structured_outputs: the grammar could not be built \(RuntimeError: a panic"):
        llm.engine.add_request("panics", "x", SamplingParams(structured_outputs={"regex": "[0-9]{7}"}))
    monkeypatch.undo()
    assert llm.generate("x", SamplingParams(max_tokens=4, structured_outputs={"regex": "[0-9]{7}"}))[0].text.isdigit()


def test_ignore_eos_keeps_going_while_the_grammar_allows_more(llm):
    """`[a-z]+` may end after any letter: with ignore_eos the output runs to max_tokens without EOS; a
    grammar that is complete still ends it (nothing but EOS could follow)."""
    kw = dict(max_tokens=12, temperature=1.0, seed=3, logit_bias={2: 10.0})     # EOS (id 2) made likely
    free = llm.generate(PROMPTS[:3], SamplingParams(**kw, structured_outputs={"regex": "[a-z]+"}))
    assert any(o.token_ids[-1] == 2 and len(o.token_ids) < 12 for o in free), [o.token_ids for o in free]
    for o in llm.generate(PROMPTS[:3], SamplingParams(**kw, ignore_eos=True, structured_outputs={"regex": "[a-z]+"})):
        assert o.finish_reason == "length" and 2 not in o.token_ids and re.fullmatch("[a-z]+", o.text), o
    done = llm.generate(PROMPTS[0], SamplingParams(**kw, ignore_eos=True, structured_outputs={"choice": ["ab"]}))[0]
    assert done.text == "ab" and done.finish_reason == "stop"


def test_preemption_under_a_grammar_gives_the_same_tokens(tiny_model_dir):
    """A preempted request recomputes its KV; its matcher has all its output and goes on where it was."""
    params = [SamplingParams(max_tokens=40, temperature=t, seed=i, ignore_eos=True,
                             structured_outputs={"regex": "[a-z ]{10,60}"}) for i, t in enumerate([0.0, 1.0] * 3)]
    roomy = LLM(model=str(tiny_model_dir("llama")), draft=None, block_size=4, num_kv_blocks=512)
    tight = LLM(model=str(tiny_model_dir("llama")), draft=None, block_size=4, num_kv_blocks=40)
    want = [o.token_ids for o in roomy.generate(PROMPTS, params)]
    outs = tight.generate(PROMPTS, params)
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "no preemption: the test checks nothing"
    assert [o.token_ids for o in outs] == want


def test_the_default_model_writes_json_for_a_schema_with_and_without_speculation(default_model_dir):
    """The real model and its tokenizer (262K tokens, SentencePiece pieces): the default (hybrid)
    speculation and none give the same text, and it parses and validates."""
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    prompts = ["Here is Alice, 31, as a JSON record:\n", "A person as JSON:\n"]
    params = [SamplingParams(max_tokens=48, temperature=t, seed=11, structured_outputs=StructuredOutputs(json=schema))
              for t in (0.0, 1.0)]
    runs = []
    for draft in ("default", None):
        llm = LLM(model="gemma-3-270m", draft=draft)
        runs.append([(o.token_ids, o.text, o.finish_reason) for p in params for o in llm.generate(prompts, p)])
        del llm
    assert runs[0] == runs[1]
    for _, text, reason in runs[0]:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
