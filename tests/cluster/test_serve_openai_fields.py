"""The OpenAI API as clients use it (issue #22), through real Serve, real HTTP and the official
`openai` client, against the fake engine (tests/cluster/fake_engine.py: byte tokens, made-up
logprobs, a logit_bias of +50 or more forces its token): n, logprobs, echo, penalties and
logit_bias, stop, the fields refused by name, the body cap, malformed bodies and routes, and
tokenization in the ingress (the replica gets token ids)."""
from __future__ import annotations

import json
import threading
import time

import openai
import pytest
import requests
from ray import serve

from cluster.config import ServeConfig
from tests.cluster.conftest import FAKE

MODEL = "fake"
CAP = 256 * 1024


@pytest.fixture(scope="module")
def app(deploy):
    cfg = ServeConfig(model=MODEL, engine=FAKE, app_name="fields", num_replicas=1, resources_per_rank={"cpu": 0.25},
                      limits={"max_model_len": 256, "max_tokens": 64, "max_request_body_bytes": CAP})
    return deploy(cfg, "/fields")


def _err(exc_info) -> dict:
    body = exc_info.value.body
    return body.get("error", body) if isinstance(body, dict) and "error" in body else body


def _refused(call, status: int, param: str | None, needle: str = "") -> dict:
    with pytest.raises(openai.APIStatusError) as ei:
        call()
    err = _err(ei)
    assert ei.value.status_code == status, err
    assert err["param"] == param and needle in err["message"], err
    return err


def test_n_choices_seeded_and_usage(app):
    kw = dict(model=MODEL, prompt="abc", max_tokens=5, temperature=1.0, seed=11)
    r = app.client.completions.create(**kw, n=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 15 and r.usage.prompt_tokens == 3
    # with a seed, sample i is the single request with seed + i
    for c in r.choices:
        alone = app.client.completions.create(**(kw | {"seed": 11 + c.index}))
        assert alone.choices[0].text == c.text
    chat = app.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                              max_tokens=4, seed=3)
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8


def test_n_streamed_chunks_carry_their_index(app):
    chunks = list(app.client.completions.create(model=MODEL, prompt="abc", max_tokens=4, n=2, seed=5, stream=True,
                                                stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        texts[c.choices[0].index] += c.choices[0].text
    full = app.client.completions.create(model=MODEL, prompt="abc", max_tokens=4, n=2, seed=5)
    assert texts == {c.index: c.text for c in full.choices}
    assert chunks[-1].usage.completion_tokens == 8
    chat = list(app.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2,
                                                   max_tokens=3, stream=True))
    roles = [c.choices[0].index for c in chat if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    assert sorted(c.choices[0].index for c in chat if c.choices[0].finish_reason) == [0, 1]


def test_completion_logprobs_format(app):
    r = app.client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text          # token text, not ids
    assert lp.token_logprobs == [-0.5] * 4
    assert all(len(top) == 2 and t in top for t, top in zip(lp.tokens, lp.top_logprobs))
    assert lp.text_offset == [0, 1, 2, 3]


def test_completion_logprobs_streamed(app):
    chunks = list(app.client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0, logprobs=1,
                                                stream=True))
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert "".join(tokens) == "".join(c.choices[0].text for c in chunks) and offsets == [0, 1, 2, 3]


def test_chat_logprobs_format_and_streamed(app):
    msgs = [{"role": "user", "content": "hi"}]
    r = app.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0, logprobs=True,
                                           top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(t.bytes == list(t.token.encode()) and len(t.top_logprobs) == 2 for t in content)
    assert content[0].top_logprobs[0].token == content[0].token and content[0].top_logprobs[1].logprob == -1.5
    chunks = list(app.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0,
                                                     logprobs=True, stream=True))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    _refused(lambda: app.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, top_logprobs=2),
             400, "top_logprobs", "logprobs")


def test_echo(app):
    r = app.client.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith("abc") and len(r.choices[0].text) == 6
    r = app.client.completions.create(model=MODEL, prompt="abc", max_tokens=2, temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.tokens[:3] == ["a", "b", "c"] and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == [-0.5] * 4 and lp.text_offset == [0, 1, 2, 3, 4]
    chunks = list(app.client.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0, echo=True,
                                                stream=True))
    assert chunks[0].choices[0].text.startswith("abc") and "".join(c.choices[0].text for c in chunks)[3:] == \
        app.client.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0).choices[0].text


def test_penalties_and_logit_bias(app):
    kw = dict(model=MODEL, prompt="abc", max_tokens=6, temperature=0)
    r = app.client.completions.create(**kw, presence_penalty=1.0, frequency_penalty=-0.5,
                                      extra_body={"repetition_penalty": 1.3})
    assert r.usage.completion_tokens == 6
    forced = app.client.completions.create(**kw, logit_bias={str(ord("q")): 100})
    assert forced.choices[0].text == "q" * 6
    _refused(lambda: app.client.completions.create(**kw, logit_bias={"q": 5}), 400, "logit_bias", "token ids")
    _refused(lambda: app.client.completions.create(**kw, logit_bias={"5": 500}), 400, "logit_bias", "[-100, 100]")
    _refused(lambda: app.client.completions.create(**kw, logit_bias={"999": 5}), 400, "logit_bias", "999")
    _refused(lambda: app.client.completions.create(**kw, presence_penalty=3), 400, "presence_penalty")


def test_stop_list(app):
    base = app.client.completions.create(model=MODEL, prompt="abc", max_tokens=12, temperature=0).choices[0].text
    stop = base[5:7]
    r = app.client.completions.create(model=MODEL, prompt="abc", max_tokens=12, temperature=0,
                                      stop=["@@", stop, "##", "%%"])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == base[:base.index(stop)]
    _refused(lambda: app.client.completions.create(model=MODEL, prompt="abc", max_tokens=2, stop=list("abcde")),
             400, "stop", "at most 4")


@pytest.mark.parametrize("field,value", [
    ("response_format", {"type": "json_schema"}), ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "required"), ("functions", [{"name": "f"}]), ("frobnicate", 1), ("best_of", 3),
])
def test_unserved_fields_refused_by_name(app, field, value):
    msgs = [{"role": "user", "content": "hi"}]
    if field == "best_of":
        call = lambda: app.client.completions.create(model=MODEL, prompt="x", max_tokens=2, best_of=value)  # noqa: E731
    else:
        call = lambda: app.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,  # noqa: E731
                                                          extra_body={field: value})
    _refused(call, 400, field)


def test_harmless_fields_accepted(app):
    r = app.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           user="u1", metadata={"k": "v"}, store=False, response_format={"type": "text"},
                                           tool_choice="none", parallel_tool_calls=False)
    assert r.usage.completion_tokens == 2


def test_seed_out_of_range(app):
    for seed in (2**64, -1):
        _refused(lambda: app.client.completions.create(model=MODEL, prompt="x", max_tokens=2, seed=seed), 400, "seed")


def _raw(app, body, headers=None, method="POST", path="/v1/completions"):
    return requests.request(method, f"{app.url}{path}", data=body,
                            headers={"Content-Type": "application/json"} | (headers or {}))


def _shape(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_body_cap_413(app):
    big = json.dumps({"model": MODEL, "prompt": "a" * (CAP + 10), "max_tokens": 2})
    assert "limit" in _shape(_raw(app, big), 413)["message"]
    chunked = _raw(app, (part.encode() for part in [big[:1000], big[1000:]]))   # no Content-Length
    _shape(chunked, 413)
    with pytest.raises(openai.APIStatusError) as ei:
        app.client.completions.create(model=MODEL, prompt="a" * 4_000_000, max_tokens=2)
    assert ei.value.status_code == 413


def test_prompt_too_long_in_characters(app):
    err = _shape(_raw(app, json.dumps({"model": MODEL, "prompt": "a" * 300, "max_tokens": 2})), 400)
    assert err["param"] == "prompt" and "characters" in err["message"]


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(app):
    """vLLM's truncate_prompt_tokens (byte tokens here, context 256): the prompt's last k tokens on both
    endpoints, echo shows them, and the answer is the answer to them; -1 keeps what fits beside max_tokens;
    a cut that leaves no room, or 0, is a 400 naming the field."""
    long = "".join(chr(97 + i % 26) for i in range(600))           # more characters than the context holds
    cut = app.client.completions.create(model=MODEL, prompt=long, max_tokens=4, temperature=0, echo=True,
                                        extra_body={"truncate_prompt_tokens": 10})
    alone = app.client.completions.create(model=MODEL, prompt=long[-10:], max_tokens=4, temperature=0)
    assert cut.usage.prompt_tokens == 10 and cut.choices[0].text == long[-10:] + alone.choices[0].text
    fit = app.client.completions.create(model=MODEL, prompt=[ord(c) for c in long], max_tokens=6,
                                        extra_body={"truncate_prompt_tokens": -1})
    assert fit.usage.prompt_tokens == 256 - 6 and fit.usage.completion_tokens == 6
    chat = app.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long}], max_tokens=3,
                                              extra_body={"truncate_prompt_tokens": 20})
    assert chat.usage.prompt_tokens == 20
    for value, needle in [(256, "(256) must be less than max_model_len (256)"), (0, "at least 1, got 0")]:
        err = _shape(_raw(app, json.dumps({"model": MODEL, "prompt": long, "max_tokens": 2, "truncate_prompt_tokens": value})),
                     400)
        assert err["param"] == "truncate_prompt_tokens" and needle in err["message"], err


def test_token_ids_beyond_any_vocabulary_and_keys_twice_are_a_400(app):
    """A first id of 2**32 overflowed the tokenizer's decode in the echo check: a 500 and a traceback."""
    for ids in ([2 ** 32], [1, 2 ** 40]):
        err = _shape(_raw(app, json.dumps({"model": MODEL, "prompt": ids, "max_tokens": 2})), 400)
        assert err["param"] == "prompt" and "beyond any vocabulary" in err["message"]
    twice = _shape(_raw(app, '{"model": "fake", "prompt": "x", "n": 1, "n": 2}'), 400)["message"]
    assert "the key 'n' appears twice" in twice                 # over real HTTP too: one value would be dropped


def test_malformed_bodies(app):
    deep = "[" * 100_000 + "]" * 100_000
    assert "nested" in _shape(_raw(app, deep), 400)["message"]
    for depth in (40_000, 900):   # too deep for the JSON parser; parsed but too deep for the model
        deep_obj = '{"model": "fake", "prompt": "x", "metadata": ' + '{"a":' * depth + "1" + "}" * (depth + 1)
        _shape(_raw(app, deep_obj), 400)
    assert "JSON object" in _shape(_raw(app, "[1, 2]"), 400)["message"]
    assert "not valid JSON" in _shape(_raw(app, "{nope"), 400)["message"]
    _shape(_raw(app, b"\xff\xfe{}"), 400)
    for body in ('{"model": "fake", "prompt": "a\\ud800b"}',   # a lone surrogate: valid JSON, not text
                 '{"model": "fake", "messages": [{"role": "user", "content": "\\udfff"}]}'):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        assert _shape(_raw(app, body, path=path), 400)["param"] in ("prompt", "messages")
    _shape(_raw(app, '{"model": "fake", "prompt": "x", "\\ud800": 1}'), 400)
    assert "ud800" in _shape(_raw(app, '{"model": "\\ud800", "prompt": "x"}'), 404)["message"]
    err = _shape(_raw(app, json.dumps({"model": MODEL, "prompt": "x"}), {"Content-Type": "text/plain"}), 415)
    assert "Content-Type" in err["message"]
    r = requests.post(f"{app.url}/v1/completions", data=json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}))
    assert r.status_code == 200, r.text  # no Content-Type at all: read as JSON
    assert app.client.completions.create(model=MODEL, prompt="still up", max_tokens=2).usage.completion_tokens == 2


def test_404_405_shapes(app):
    assert _shape(requests.get(f"{app.url}/v1/nothing-here"), 404)["type"] == "not_found_error"
    assert "not allowed" in _shape(requests.get(f"{app.url}/v1/completions"), 405)["message"]
    _shape(requests.delete(f"{app.url}/v1/chat/completions"), 405)


def _replica_stats(app_name: str) -> dict:
    return serve.get_deployment_handle("LLMServer", app_name).stats.remote().result()


def test_replica_receives_token_ids(app):
    app.client.completions.create(model=MODEL, prompt="text prompt", max_tokens=2)
    app.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "chat"}], max_tokens=2)
    assert _replica_stats("fields")["text_prompts"] == 0


def test_large_prompt_does_not_stall_a_stream(app):
    """A prompt near the body cap is read, checked and tokenized in the ingress while another
    request streams: the stream keeps its pace (the engine thread never sees the text)."""
    gaps, stop = [], threading.Event()

    def stream():
        last = time.monotonic()
        for _ in app.client.completions.create(model=MODEL, prompt="[slow:0.02] go", max_tokens=40, stream=True):
            now = time.monotonic()
            gaps.append(now - last)
            last = now
        stop.set()

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(0.2)
    while not stop.is_set():
        r = _raw(app, json.dumps({"model": MODEL, "prompt": "word " * (CAP // 6), "max_tokens": 2}))
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    t.join()
    assert len(gaps) >= 40 and max(gaps[1:]) < 1.0
    assert _replica_stats("fields")["text_prompts"] == 0


def test_n_with_a_failing_choice_answers_and_frees_the_rest(app):
    """Every choice of this prompt fails after 2 tokens: a 500 naming the cause, streamed or not,
    and the replica holds nothing afterwards."""
    with pytest.raises(openai.InternalServerError) as ei:
        app.client.completions.create(model=MODEL, prompt="[fail-step:2] x", max_tokens=8, n=3)
    assert "injected fault" in _err(ei)["message"]
    r = requests.post(f"{app.url}/v1/completions", stream=True, json={
        "model": MODEL, "prompt": "[slow:0.2] [fail-step:2] y", "max_tokens": 8, "n": 2, "stream": True})
    lines = [line.decode() for line in r.iter_lines() if line]   # the first tokens went out, then the error
    assert r.status_code == 200 and lines[-1] == "data: [DONE]" and "injected fault" in lines[-2]
    assert app.client.completions.create(model=MODEL, prompt="ok", max_tokens=2, n=2).usage.completion_tokens == 4
    stats = _replica_stats("fields")
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_echo_with_max_tokens_0_scores_the_prompt(app):
    """As vLLM (and lm-eval's loglikelihood requests) use it: the prompt's logprobs, nothing generated."""
    kw = dict(model=MODEL, prompt="abcd", max_tokens=0, echo=True, logprobs=1)
    r = app.client.completions.create(**kw)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "abcd" and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == 4
    assert lp.tokens == list("abcd") and lp.token_logprobs == [None, -0.5, -0.5, -0.5]
    chunks = list(app.client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "abcd"
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == list("abcd")
    _refused(lambda: app.client.completions.create(model=MODEL, prompt="abcd", max_tokens=0), 400, "max_tokens", "echo")


def test_abandoned_n_stream_aborts_every_choice(app):
    from tests.cluster.conftest import wait_for

    with requests.post(f"{app.url}/v1/completions", stream=True, timeout=60, json={
            "model": MODEL, "prompt": "[slow:0.5] long", "max_tokens": 60, "n": 3, "stream": True}) as r:
        lines = r.iter_lines()     # kept: a dropped line iterator closes the connection when collected
        next(lines)                # the first choice has started; the others join
        assert wait_for(lambda: _replica_stats("fields")["num_running"] == 3, timeout=5)
    assert wait_for(lambda: _replica_stats("fields")["num_running"] == 0, timeout=5)   # not after ~30 s of steps


def test_a_stream_with_more_choices_than_engine_slots_starts_at_once(deploy):
    """n above max_num_seqs: the later choices start only as earlier ones finish, so a stream that
    waited for every choice's first token would send nothing until then; it starts with the first."""
    cfg = ServeConfig(model=MODEL, engine=FAKE, app_name="fields-slots", num_replicas=1,
                      resources_per_rank={"cpu": 0.25}, limits={"max_model_len": 256, "max_num_seqs": 2})
    app = deploy(cfg, "/fields-slots")
    seen = []       # (choice, finish_reason) in arrival order
    with requests.post(f"{app.url}/v1/completions", stream=True, timeout=60, json={
            "model": MODEL, "prompt": "[slow:0.05] x", "max_tokens": 20, "n": 4, "stream": True,
            "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                choice = json.loads(line[6:])["choices"][0]
                seen.append((choice["index"], choice["finish_reason"]))
    first_finish = next(k for k, (_, reason) in enumerate(seen) if reason is not None)
    assert {i for i, _ in seen[:first_finish]} <= {0, 1}      # only the running choices before one ends
    assert seen[0][1] is None and sorted({i for i, _ in seen}) == [0, 1, 2, 3]
    assert sum(reason == "length" for _, reason in seen) == 4
