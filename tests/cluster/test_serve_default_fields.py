"""The OpenAI fields of issue #22 on the built-in default model (Gemma 3 270M with its shipped EAGLE-3
head, so logprobs come from speculative steps), over real HTTP with the `openai` client. Slow: it
loads the real model."""
from __future__ import annotations

import openai
import pytest

from cluster.config import ServeConfig

MODEL = "gemma-3-270m"


@pytest.fixture(scope="module")
def app(deploy):
    cfg = ServeConfig(app_name="default-fields", num_replicas=1, resources_per_rank={"cpu": 1}, kv_cache_gb=0.1,
                      limits={"max_model_len": 256, "max_tokens": 24, "max_num_seqs": 4})
    return deploy(cfg, "/default-fields")


@pytest.fixture(scope="module")
def tokenizer():
    from eagle_worker.prompt_tokenizer import PromptTokenizer

    return PromptTokenizer.load(MODEL)


def test_logprobs_echo_and_stream(app, tokenizer):
    prompt = "The capital of France is"
    r = app.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2, echo=True)
    choice, n_prompt = r.choices[0], r.usage.prompt_tokens
    lp = choice.logprobs
    assert n_prompt == len(tokenizer.tokenize(prompt)) and len(lp.tokens) == n_prompt + r.usage.completion_tokens
    assert "".join(lp.tokens[1:]) == choice.text            # token text (after <bos>), echo included
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    for tok, top in zip(lp.tokens[n_prompt:], lp.top_logprobs[n_prompt:]):
        assert max(top, key=top.get) == tok                 # greedy under speculation: the target's top token
    chunks = list(app.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2,
                                                stream=True))
    streamed = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens[n_prompt:]
    streamed_lps = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    assert streamed_lps == pytest.approx(lp.token_logprobs[n_prompt:], abs=1e-4)


def test_n_seeded_samples_and_logit_bias(app, tokenizer):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0)
    r = app.client.completions.create(**kw, n=2, seed=123)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [app.client.completions.create(**kw, seed=123 + i).choices[0].text
                                           for i in range(2)]
    forced = tokenizer.tokenize(" banana")[-1]
    r = app.client.completions.create(**kw, seed=1, logit_bias={str(forced): 100})
    assert r.choices[0].text == tokenizer.token_text(forced) * 12


def test_chat_logprobs_and_stop_list(app):
    msgs = [{"role": "user", "content": "Count from one to ten in words."}]
    r = app.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0, logprobs=True,
                                           top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content).startswith(r.choices[0].message.content)
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token for t in content)
    text = r.choices[0].message.content
    if len(text) > 6:
        stop = text[3:6]
        s = app.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0,
                                               stop=["@@@", stop])
        assert s.choices[0].finish_reason == "stop" and s.choices[0].message.content == text[:text.index(stop)]


def test_response_format_json_schema_and_structured_outputs(app):
    """OpenAI's json_schema on chat (plain and streamed: the same text) parses and validates; vLLM's
    structured_outputs on completions gives one of the choices; a sampled request too."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    msgs = [{"role": "user", "content": "Alice is 31. Give her as JSON."}]
    for temperature in (0.0, 1.0):
        kw = dict(model=MODEL, messages=msgs, max_tokens=24, temperature=temperature, seed=5, response_format=fmt)
        r = app.client.chat.completions.create(**kw)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
        streamed = "".join(c.choices[0].delta.content or "" for c in app.client.chat.completions.create(**kw, stream=True)
                           if c.choices)
        assert streamed == text
    r = app.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=1.0, seed=9, n=2,
                                           response_format=fmt)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:                                     # each sample matches the schema
        jsonschema.validate(json.loads(c.message.content), schema)
    choices = ["Paris", "London", "Rome"]
    r = app.client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0,
                                      extra_body={"structured_outputs": {"choice": choices}})
    assert r.choices[0].text == "Paris" and r.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as ei:
        app.client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"structured_outputs": {"regex": "(a"}})
    assert ei.value.body["param"] == "structured_outputs"


def test_bad_words_and_truncate_prompt_tokens(app, tokenizer):
    """vLLM's two prompt/output extensions on the real model under its EAGLE-3 head: a bad word's tokens
    never come (its logprob tokens show it), and a truncated prompt answers as its last k tokens alone."""
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=1)
    base = app.client.completions.create(**kw).choices[0]
    word = base.text.split()[0]
    banned = [[tokenizer.token_text(t) for t in seq] for seq in tokenizer.bad_word_token_ids([word])]
    assert any(base.logprobs.tokens[i:i + len(s)] == s for s in banned for i in range(8)), (word, base.logprobs.tokens)
    cut = app.client.completions.create(**kw, extra_body={"bad_words": [word]}).choices[0]
    assert not any(cut.logprobs.tokens[i:i + len(s)] == s for s in banned for i in range(8)), (word, cut.logprobs.tokens)
    assert cut.text != base.text

    long = "Some words that will be cut away. " * 40 + "The capital of France is"
    ids = tokenizer.tokenize(long)
    r = app.client.completions.create(model=MODEL, prompt=long, max_tokens=6, temperature=0,
                                      extra_body={"truncate_prompt_tokens": 7})
    alone = app.client.completions.create(model=MODEL, prompt=ids[-7:], max_tokens=6, temperature=0)
    assert r.usage.prompt_tokens == 7 and r.choices[0].text == alone.choices[0].text
