"""The OpenAI-compatible endpoint end to end: real Ray Serve, real HTTP, the official `openai` client,
the real engine on a tiny random Gemma 3 (fast on CPU; its chat template is Gemma's fallback)."""
from __future__ import annotations

import concurrent.futures as cf

import openai
import pytest
import requests

from cluster.config import ServeConfig

MODEL = "tiny-gemma"
NO_EOS = {"ignore_eos": True}  # random weights may emit EOS at once; lengths must be exact here


@pytest.fixture(scope="module")
def app(deploy, tiny_model_dir):
    cfg = ServeConfig(
        model=str(tiny_model_dir("gemma3")), served_model_name=MODEL, num_replicas=1,
        resources_per_rank={"cpu": 1}, kv_cache_gb=0.02, app_name="api", ingress={"stream_interval": 3},
        limits={"max_model_len": 128, "max_tokens": 32, "max_num_seqs": 4, "max_queued_requests": 16},
    )
    return deploy(cfg)


def test_models(app):
    models = app.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert requests.get(f"{app.url}/v1/models").json()["data"][0]["max_model_len"] == 128
    assert app.client.models.retrieve(MODEL).id == MODEL                 # GET /v1/models/{id}
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        app.client.models.retrieve("other-model")
    by_path = requests.get(f"{app.url}/v1/models/{app.config.model}")    # the model as the config names it
    assert by_path.status_code == 200 and by_path.json()["id"] == MODEL
    with pytest.raises(openai.NotFoundError) as e:      # a 100 kB model name is not echoed back whole
        app.client.completions.create(model="m" * 100_000, prompt="x", max_tokens=1)
    assert "(100000 characters)" in e.value.message and len(e.value.message) < 400
    for path in ("/v1/models", "/health"):             # HEAD as load balancers' probes send it: no body
        head = requests.head(f"{app.url}{path}")
        assert head.status_code == 200 and head.content == b"", (path, head.status_code)


def test_health(app):
    r = requests.get(f"{app.url}/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_completion_and_usage(app):
    r = app.client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=6,
                                      temperature=0, extra_body=NO_EOS)
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens > 1 and r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_completion_stream_matches_non_stream(app):
    kw = dict(model=MODEL, prompt="Question: what is two plus two?", max_tokens=12, temperature=0, extra_body=NO_EOS)
    full = app.client.completions.create(**kw)
    chunks = list(app.client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_a_stream_has_one_request_id_header(app):
    """Serve's own x-request-id only (the client's, echoed back): a second one of the ingress's made
    clients read both joined as "cmpl-..., <id>"."""
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": True}
    for headers in ({}, {"X-Request-Id": "mine-1"}):
        with requests.post(f"{app.url}/v1/completions", json=body, headers=headers, stream=True, timeout=60) as r:
            assert r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n")
            ids = r.raw.headers.getlist("x-request-id")
            assert len(ids) == 1 and "," not in ids[0], ids
            assert not headers or ids == ["mine-1"], ids


def test_streamed_chunks_carry_stream_interval_tokens(app):
    """ingress.stream_interval 3: the first token at once, then chunks of 3 or more tokens, the last
    with what is left; the same tokens and log-probabilities as the whole response."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10, temperature=0, logprobs=True,
              extra_body=NO_EOS)
    full = app.client.chat.completions.create(**kw).choices[0].logprobs.content
    chunks = [c for c in app.client.chat.completions.create(**kw, stream=True) if c.choices and c.choices[0].logprobs]
    sizes = [len(c.choices[0].logprobs.content) for c in chunks]
    assert sizes[0] == 1 and sum(sizes) == 10 and all(n >= 3 for n in sizes[1:-1]) and len(sizes) <= 5
    streamed = [t for c in chunks for t in c.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in full]


def test_token_id_prompt(app):
    r = app.client.completions.create(model=MODEL, prompt=[1, 40, 41, 42], max_tokens=3, temperature=0,
                                      extra_body=NO_EOS)
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 3


def test_chat_and_stream(app):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Bonjour, comment ça va ?"}]
    full = app.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                              extra_body=NO_EOS)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 10
    chunks = list(app.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                                     extra_body=NO_EOS, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_the_clients_nulls_a_whitespace_prompt_and_one_created_time_per_stream(app):
    """The official client sends null for an argument given as None: the field's default, as OpenAI
    and vLLM read it. Whitespace is a prompt. Every chunk of a stream carries the request's time."""
    nulls = dict(temperature=None, top_p=None, n=None, presence_penalty=None, frequency_penalty=None, seed=None)
    r = app.client.completions.create(model=MODEL, prompt=" \n", max_tokens=3, echo=None, extra_body=NO_EOS, **nulls)
    assert r.usage.completion_tokens == 3 and r.usage.prompt_tokens >= 2 and len(r.choices) == 1
    chunks = list(app.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=24, logprobs=None, stream=True, extra_body=NO_EOS,
                                                     **nulls))
    assert len(chunks) > 3 and len({c.created for c in chunks}) == 1 and len({c.id for c in chunks}) == 1
    # a prompt with no room for one token: OpenAI's code, naming the field that holds it
    with pytest.raises(openai.BadRequestError) as ei:
        app.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello " * 130}])
    err = _err(ei)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages", err
    assert err["message"].startswith("This model's maximum context length is 128 tokens. However, your messages")
    with pytest.raises(openai.BadRequestError) as ei:       # longer in tokens, not yet in characters
        app.client.completions.create(model=MODEL, prompt=list(range(5, 140)))
    err = _err(ei)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt", err
    assert err["message"].startswith("This model's maximum context length is 128 tokens. However, your request has "
                                     "135 input tokens"), err


def test_a_batch_of_prompts_answers_each_as_its_own_request(app):
    """A list of prompts (lm-eval's batched completions): choice p*n + j is sample j of prompt p, the
    text that prompt gets alone; usage counts each prompt once. Streamed too, and with token ids."""
    prompts = ["The quick brown fox", "Bonjour", "def add(a, b):"]
    alone = [app.client.completions.create(model=MODEL, prompt=p, max_tokens=5, seed=7, extra_body=NO_EOS)
             for p in prompts]
    r = app.client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, n=2, seed=7, extra_body=NO_EOS)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices[::2]] == [a.choices[0].text for a in alone]
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone) and r.usage.completion_tokens == 30
    texts = {}
    for chunk in app.client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, n=2, seed=7, stream=True,
                                               extra_body=NO_EOS):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(6)] == [c.text for c in r.choices]
    ids = app.client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=2, temperature=0)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5
    same = app.client.completions.create(model=MODEL, prompt=["once upon"] * 4, max_tokens=8, temperature=1.5,
                                         extra_body=NO_EOS)
    assert len({c.text for c in same.choices}) > 1              # no seed: each copy of a prompt samples anew
    for stream in (False, True):                               # a later prompt the engine refuses: a 400 either way
        with pytest.raises(openai.BadRequestError) as ei:
            app.client.completions.create(model=MODEL, prompt=[[5, 6], [10**6]], max_tokens=2, stream=stream)
        assert _err(ei)["param"] == "prompt" and "out of range" in _err(ei)["message"], _err(ei)
    with pytest.raises(openai.BadRequestError) as ei:              # more choices than the server admits at once
        app.client.completions.create(model=MODEL, prompt=["a"] * 500, max_tokens=2)
    assert _err(ei)["param"] == "prompt" and "500 prompts" in _err(ei)["message"], _err(ei)


def test_stop_sequence_and_seed(app):
    kw = dict(model=MODEL, prompt="def add(a, b):", max_tokens=16, temperature=1.0, seed=7, extra_body=NO_EOS)
    a, b = app.client.completions.create(**kw), app.client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text  # same seed, same sample
    text = a.choices[0].text
    if len(text) > 3:
        stop = text[2:4]
        c = app.client.completions.create(**kw, stop=[stop])
        assert c.choices[0].finish_reason == "stop" and stop not in c.choices[0].text
        kept = app.client.completions.create(**(kw | {"extra_body": NO_EOS | {"include_stop_str_in_output": True}}),
                                             stop=[stop])
        assert kept.choices[0].text == c.choices[0].text + stop          # vLLM's switch: the stop string kept


def _err(exc_info):
    body = exc_info.value.body
    return body.get("error", body) if isinstance(body, dict) and "error" in body else body


LOOP = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}     # a schema that can produce nothing


@pytest.mark.parametrize("kwargs,status,param,needle", [
    (dict(max_tokens=10_000), 400, "max_tokens", "limit of 32"),
    (dict(prompt="hello " * 200), 400, "prompt", "maximum context"),
    (dict(prompt=list(range(5, 105)), max_tokens=30), 400, "max_tokens", "maximum context length is 128 tokens"),
    (dict(model="no-such-model"), 404, "model", "does not exist"),
    (dict(temperature=-1), 400, "temperature", "greater than or equal"),
    (dict(top_p=0), 400, "top_p", "greater than"),
    (dict(n=0), 400, "n", "greater than"),
    (dict(prompt=[1, -5], echo=True), 400, "prompt", ">= 0"),
    (dict(prompt=[1, 10**9], echo=True), 400, "prompt", "out of range"),
    (dict(seed=2**64), 400, "seed", "less than"),
    (dict(extra_body={"response_format": {"type": "json_schema"}}), 400, "response_format", "json_schema is required"),
    (dict(extra_body={"structured_outputs": {"regex": "[a-"}}), 400, "structured_outputs", "regex"),
    # compiles at the ingress, refused by the replica (its first mask): named as the client asked for it
    (dict(extra_body={"structured_outputs": {"json": LOOP}}), 400, "structured_outputs",
     "structured_outputs: json_schema: the grammar cannot produce"),
    (dict(extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": LOOP}}}), 400,
     "response_format", "response_format: json_schema: the grammar cannot produce"),
    (dict(prompt=""), 400, "prompt", "empty"),
    (dict(extra_body={"top_k": -5}), 400, "top_k", ""),
])
def test_bad_completion_requests(app, kwargs, status, param, needle):
    req = dict(model=MODEL, prompt="hi", max_tokens=2) | kwargs
    with pytest.raises(openai.APIStatusError) as ei:
        app.client.completions.create(**req)
    assert ei.value.status_code == status
    err = _err(ei)
    assert err["param"] == param and needle in err["message"], err
    assert err["type"] and "code" in err


def test_a_prompt_near_the_context_without_max_tokens_stops_at_the_context(app):
    """Only a max_tokens the client asked for is refused when it cannot fit (OpenAI, vLLM); without
    one, generation runs up to the context."""
    r = app.client.completions.create(model=MODEL, prompt=list(range(5, 120)), temperature=0, extra_body=NO_EOS)
    assert r.choices[0].finish_reason == "length" and r.usage.total_tokens == 128
    with pytest.raises(openai.BadRequestError) as ei:
        app.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello " * 13}],
                                           max_tokens=30)
    assert _err(ei)["code"] == "context_length_exceeded" and _err(ei)["param"] == "max_tokens", _err(ei)
    # errors name the field the client sent
    with pytest.raises(openai.BadRequestError) as ei:
        app.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello " * 13}],
                                           max_completion_tokens=30)
    assert _err(ei)["code"] == "context_length_exceeded" and _err(ei)["param"] == "max_completion_tokens", _err(ei)
    with pytest.raises(openai.BadRequestError) as ei:
        app.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           max_completion_tokens=10_000)
    assert _err(ei)["param"] == "max_completion_tokens" and "max_completion_tokens: 10000 exceeds" in \
        _err(ei)["message"], _err(ei)


def test_bad_chat_requests(app):
    with pytest.raises(openai.BadRequestError) as ei:
        app.client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert _err(ei)["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as ei:
        app.client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}], max_tokens=2)
    assert _err(ei)["param"].startswith("messages.0.role")


def test_malformed_json_then_still_serving(app):
    r = requests.post(f"{app.url}/v1/completions", data="{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = app.client.completions.create(model=MODEL, prompt="still alive?", max_tokens=2, extra_body=NO_EOS)
    assert r.usage.completion_tokens == 2


def test_concurrent_load_all_complete(app):
    """More requests than max_num_seqs: the surplus queues in the replica and all finish."""
    def one(i):
        return app.client.completions.create(model=MODEL, prompt=f"request {i}: the quick", max_tokens=5,
                                             temperature=0, extra_body=NO_EOS)

    with cf.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(12)))
    assert all(r.usage.completion_tokens == 5 for r in results)


def test_metrics(app):
    app.client.completions.create(model=MODEL, prompt="metrics", max_tokens=3, extra_body=NO_EOS)
    text = requests.get(f"{app.url}/metrics").text
    for name in ("eagle_ttft_seconds_count", "eagle_tpot_seconds_count", "eagle_generation_tokens_total",
                 "eagle_mean_accepted_tokens_count", "eagle_generation_tokens_per_second",
                 "eagle_replica_kv_usage", "eagle_replica_queue_depth", 'eagle_requests_total{endpoint="completions"'):
        assert name in text.replace(f'model="{MODEL}",', ""), name


TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"


@pytest.fixture(scope="module")
def llama_apps(deploy, tiny_model_dir):
    """Tiny Llama has no chat template and no family fallback: one app without, one with an override."""
    def cfg(name, **kw):
        return ServeConfig(model=str(tiny_model_dir("llama")), served_model_name=name, app_name=name,
                           num_replicas=1, resources_per_rank={"cpu": 0.5}, kv_cache_gb=0.01,
                           limits={"max_model_len": 128, "max_tokens": 16}, **kw)
    return deploy(cfg("plain-llama"), "/plain"), deploy(cfg("templated-llama", chat_template=TEMPLATE), "/templated")


def test_chat_without_template_is_a_400(llama_apps):
    plain, _ = llama_apps
    with pytest.raises(openai.BadRequestError) as ei:
        plain.client.chat.completions.create(model="plain-llama", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=2)
    assert "chat template" in _err(ei)["message"] and _err(ei)["param"] == "messages"
    assert plain.client.completions.create(model="plain-llama", prompt="hi", max_tokens=2,
                                           extra_body=NO_EOS).usage.completion_tokens == 2


def test_chat_template_override(llama_apps):
    _, templated = llama_apps
    msgs = [{"role": "user", "content": "hi"}]
    chat = templated.client.chat.completions.create(model="templated-llama", messages=msgs, max_tokens=3,
                                                    temperature=0, extra_body=NO_EOS)
    # the same text through /v1/completions costs the same prompt tokens: the override was applied
    rendered = "[user] hi\n[assistant]"
    comp = templated.client.completions.create(model="templated-llama", prompt=rendered, max_tokens=3,
                                               temperature=0, extra_body=NO_EOS)
    assert chat.usage.prompt_tokens == comp.usage.prompt_tokens
    assert chat.choices[0].message.content == comp.choices[0].text


def test_logprobs_and_chat_usage_chunk(app):
    r = app.client.completions.create(model=MODEL, prompt="The quick", max_tokens=4, temperature=0, logprobs=0,
                                      extra_body=NO_EOS)
    lp = r.choices[0].logprobs.token_logprobs
    assert len(lp) == 4 and all(v <= 0 for v in lp)
    chat = app.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                              logprobs=True, extra_body=NO_EOS)
    assert len(chat.choices[0].logprobs.content) == 3
    chunks = list(app.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=3, stream=True, stream_options={"include_usage": True},
                                                     extra_body=NO_EOS))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


# ---- the OpenAI fields of issue #22 on the real engine ---------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir("gemma3"))


def test_n_samples_are_the_seeds_single_requests(app):
    kw = dict(model=MODEL, prompt="def add(a, b):", max_tokens=8, temperature=1.0, extra_body=NO_EOS)
    r = app.client.completions.create(**kw, n=2, seed=40)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 16
    assert [c.text for c in r.choices] == [app.client.completions.create(**kw, seed=40 + i).choices[0].text
                                           for i in range(2)]


def test_completion_logprobs_echo_real(app, tokenizer):
    prompt = "The quick brown"
    r = app.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=3, echo=True,
                                      extra_body=NO_EOS)
    choice, n_prompt = r.choices[0], r.usage.prompt_tokens
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and len(lp.tokens) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and lp.text_offset == sorted(lp.text_offset)
    ids = tokenizer(prompt).input_ids
    assert lp.tokens[:n_prompt] == [tokenizer.decode([i]) for i in ids]   # token text, not ids
    for tok, top in zip(lp.tokens[n_prompt:], lp.top_logprobs[n_prompt:]):
        assert 3 <= len(top) <= 4 and max(top, key=top.get) == tok        # greedy picks the raw top token


def test_chat_logprobs_streamed_real(app):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0, logprobs=True,
              top_logprobs=2, extra_body=NO_EOS)
    full = app.client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(full) == 5 and all(len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode()) for t in full)
    chunks = list(app.client.chat.completions.create(**kw, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in full]


def test_logit_bias_forces_and_penalties_change_output(app, tokenizer):
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0, extra_body=NO_EOS)
    forced = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(" fox"))[-1]
    r = app.client.completions.create(**kw, logit_bias={str(forced): 100}, logprobs=0)
    assert r.choices[0].logprobs.tokens == [tokenizer.decode([forced])] * 12
    plain = app.client.completions.create(**kw).choices[0].text
    penalized = app.client.completions.create(**{**kw, "extra_body": {**NO_EOS, "repetition_penalty": 2.0}},
                                              presence_penalty=2.0, frequency_penalty=2.0).choices[0].text
    assert penalized != plain
    with pytest.raises(openai.BadRequestError) as ei:
        app.client.completions.create(**kw, logit_bias={"99999999": 5})
    assert _err(ei)["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as ei:    # a stop token the model cannot make: a mistake
        app.client.completions.create(**{**kw, "extra_body": {**NO_EOS, "stop_token_ids": [99999999]}})
    assert _err(ei)["param"] == "stop_token_ids" and "out of range" in _err(ei)["message"]


def test_min_tokens_holds_eos_back_over_http(app, tokenizer):
    """EOS biased to win: without min_tokens the answer is EOS alone, with it EOS comes as token
    min_tokens + 1; above the default limit (16 for completions) the engine's refusal is a 400."""
    eos = tokenizer.eos_token_id
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0, logit_bias={str(eos): 100})
    assert app.client.completions.create(**kw).usage.completion_tokens == 1
    for stream in (False, True):
        r = app.client.completions.create(**kw, extra_body={"min_tokens": 5}, stream=stream,
                                          **({"stream_options": {"include_usage": True}} if stream else {}))
        chunks = list(r) if stream else [r]
        assert chunks[-1].usage.completion_tokens == 6
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    with pytest.raises(openai.BadRequestError) as ei:
        app.client.completions.create(model=MODEL, prompt="x", extra_body={"min_tokens": 17})
    assert _err(ei)["param"] == "min_tokens" and "max_tokens=16" in _err(ei)["message"], _err(ei)


def test_allowed_token_ids_over_http(app, tokenizer):
    labels = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(w))[-1] for w in (" yes", " no")]
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=6, extra_body={**NO_EOS, "allowed_token_ids": labels})
    for temperature in (0, 1):
        tokens = app.client.completions.create(**kw, temperature=temperature, seed=4, logprobs=0).choices[0].logprobs.tokens
        assert len(tokens) == 6 and set(tokens) <= {tokenizer.decode([i]) for i in labels}, tokens
    with pytest.raises(openai.BadRequestError) as ei:
        app.client.completions.create(**{**kw, "extra_body": {"allowed_token_ids": [99999999]}})
    assert _err(ei)["param"] == "allowed_token_ids" and "out of range" in _err(ei)["message"], _err(ei)


def test_4mb_body_is_a_413_and_messages_sent_back_are_accepted(app):
    with pytest.raises(openai.APIStatusError) as ei:   # the default cap (2 MiB): refused before it is parsed
        app.client.completions.create(model=MODEL, prompt="a" * 4_000_000, max_tokens=2)
    assert ei.value.status_code == 413 and _err(ei)["code"] == "request_too_large"
    msgs = [{"role": "user", "content": "hi"}]
    first = app.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, extra_body=NO_EOS)
    msgs += [first.choices[0].message.model_dump(), {"role": "user", "content": "and?"}]   # refusal: None etc.
    assert app.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3,
                                              extra_body=NO_EOS).usage.completion_tokens == 3


def test_prompt_scoring_with_echo_and_max_tokens_0(app, tokenizer):
    prompt = "The quick brown fox"
    r = app.client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == prompt and r.usage.completion_tokens == 0
    assert lp.tokens == [tokenizer.decode([i]) for i in tokenizer(prompt).input_ids]
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
