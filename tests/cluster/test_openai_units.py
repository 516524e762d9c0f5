"""The HTTP edge without Ray (fast tier): request models, reading a body, renders of n choices with
logprobs and echo, merging n streams, the prompt-length check, and the replica merging outputs."""
from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from cluster.ingress_prompts import IngressPrompts
from cluster.openai_body import read_json_object
from cluster.openai_errors import APIError, validation_error
from cluster.openai_render import ChatRender, CompletionRender, merge_streams
from cluster.openai_requests import HARMLESS, ChatCompletionRequest, CompletionRequest
from cluster.output_stream import merge_outputs
from tests.cluster.fake_engine import PromptTokenizer, RequestOutput, TokenLogprob


def _refusal(model, body: dict) -> APIError:
    with pytest.raises(ValidationError) as ei:
        model.model_validate(body)
    return validation_error(ei.value)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("extra,param,needle", [
    ({"seed": 2**64}, "seed", "less than"), ({"seed": -1}, "seed", "greater than"),
    ({"frobnicate": 1}, "frobnicate", "not supported"), ({"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"1": 101}}, "logit_bias", "[-100, 100]"), ({"stop": list("abcde")}, "stop", "at most 4"),
    ({"stop": ""}, "stop", "empty string"), ({"stop": ["x", ""]}, "stop", "empty string"),
    ({"logit_bias": {"7": 1, "07": -1}}, "logit_bias", "same token id 7"), ({"top_logprobs": 0}, "top_logprobs", "logprobs"),
    ({"max_tokens": 50, "max_completion_tokens": 3}, "max_tokens", "differs from max_completion_tokens 3"),
    ({"response_format": {"type": "text", "json_schema": {"name": "x"}}}, "response_format", "only allowed with it"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role", ""),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}]},
     "messages.0", "'cache_control'"),
    ({"messages": [{"role": "user", "content": "x", "foo": ""}]}, "messages.0.foo", ""),   # empty, still unknown
    ({"messages": [{"role": "user", "content": "x", "cache_control": {}}]}, "messages.0.cache_control", ""),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0", "needs content"),
    ({"messages": [{"role": "user", "content": []}]}, "messages.0", "needs content"),
    ({"n": 17}, "n", "less than"), ({"temperature": float("nan")}, "temperature", "finite"),
    ({"logit_bias": {"1": float("-inf")}}, "logit_bias.1", "finite"), ({"presence_penalty": -3}, "presence_penalty", ""),
    ({"repetition_penalty": 0}, "repetition_penalty", ""), ({"top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'json_schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "nonsense"}}}},
     "response_format", "nonsense"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name", ""),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs", "unknown name"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {}}, "structured_outputs", "got none"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least 1"),
    ({"structured_outputs": {"choice": ["a"] * 1025}}, "structured_outputs.choice", "at most 1024"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern", "not supported"),
    ({"structured_outputs": {"json": '{"a":' * 5000 + "1" + "}" * 5000}}, "structured_outputs", "nested too deeply"),
    ({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}}, "structured_outputs", "applies to json"),
    ({"structured_outputs": {"grammar": "x" * 70_000}}, "structured_outputs", "longer than 65536"),
    ({"structured_outputs": "a+"}, "structured_outputs", "valid dictionary"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "not both"),
    ({"structured_outputs": {"choice": ["a"]}, "min_tokens": 1}, "structured_outputs", "min_tokens"),
    ({"response_format": {"type": "json_object"}, "allowed_token_ids": [5]}, "response_format", "allowed_token_ids"),
    ({"tools": [{"type": "function"}]}, "tools", "tool calling"), ({"tool_choice": "auto"}, "tool_choice", ""),
    ({"stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats", ""),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]}, "messages.0.tool_calls", ""),
    # types as OpenAI checks them, no coercion: a string, a boolean or 4.0 is not an integer
    ({"max_tokens": "4"}, "max_tokens", "valid integer"), ({"n": True}, "n", "valid integer"),
    ({"max_completion_tokens": 4.0}, "max_completion_tokens", "valid integer"),
    ({"temperature": "0.5"}, "temperature", "valid number"), ({"stream": "true"}, "stream", "valid boolean"),
    ({"stop": ["a", 1]}, "stop", "valid string"), ({"logprobs": 1}, "logprobs", "valid boolean"),
    ({"logit_bias": {"²": 5}}, "logit_bias", "token ids"), ({"logit_bias": {"١٢": 5}}, "logit_bias", "token ids"),
    # one request's lists are worked into every step: bounded
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "at most 1024"),
    ({"stop_token_ids": [3] * 1025}, "stop_token_ids", "at most 1024"),
])
def test_chat_fields_refused_by_name(extra, param, needle):
    err = _refusal(ChatCompletionRequest, CHAT | extra)
    assert err.status == 400 and err.param == param and needle in err.message, err.message


def test_text_parts_are_joined_by_a_line_break_as_vllm_joins_them():
    req = ChatCompletionRequest.model_validate(CHAT | {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Question:"}, {"type": "text", "text": "What is 2+2?"}]}]})
    assert req.messages[0].text() == "Question:\nWhat is 2+2?"


def test_union_members_are_not_named_in_param():
    assert _refusal(CompletionRequest, {"model": "m", "prompt": [1.5]}).param == "prompt"
    assert _refusal(CompletionRequest, {"model": "m", "prompt": [True, False]}).param == "prompt"   # not ids
    assert _refusal(ChatCompletionRequest, CHAT | {"messages": [{"role": "user", "content": 5}]}).param == \
        "messages.0.content"


def test_accepted_fields_and_engine_params():
    req = ChatCompletionRequest.model_validate(CHAT | {
        "user": "u", "metadata": {"a": "b"}, "store": False, "response_format": {"type": "text"}, "tool_choice": "none",
        "tools": [], "logprobs": True, "top_logprobs": 3, "n": 2, "seed": 2**63 - 1,
        "messages": [{"role": "assistant", "content": "x", "refusal": None, "tool_calls": None, "audio": None}]})
    assert set(HARMLESS) <= set(CompletionRequest.model_fields) & set(ChatCompletionRequest.model_fields)
    params = req.sampling_params(8, sample=1)
    assert params["seed"] == 0 and params["logprobs"] == 3   # seed + i wraps inside [0, 2**63)
    assert "presence_penalty" not in params and "logit_bias" not in params   # defaults are not sent
    comp = CompletionRequest.model_validate({"model": "m", "prompt": "x", "echo": True, "logprobs": 2,
                                                "logit_bias": {"7": -5}, "frequency_penalty": 0.5})
    params = comp.sampling_params(4)
    assert params["prompt_logprobs"] == 2 and params["logit_bias"] == {7: -5.0} and params["frequency_penalty"] == 0.5
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "num_logprobs": 3})  # not a field


def test_null_means_not_given_as_the_openai_client_sends_it():
    """`create(temperature=None, ...)` sends `"temperature": null`: each optional field keeps its
    default; an unserved OpenAI field that is null asks for nothing; a null required field, an unknown
    field, or an unserved field with a value is still a 400."""
    nulls = dict.fromkeys(("temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty", "seed",
                           "max_tokens", "stop", "top_k", "min_p", "repetition_penalty", "ignore_eos", "priority"))
    comp = CompletionRequest.model_validate({"model": "m", "prompt": "x", "echo": None, "logprobs": None, **nulls})
    assert comp.sampling_params(4) | {"seed": 0} == CompletionRequest.model_validate(
        {"model": "m", "prompt": "x"}).sampling_params(4) | {"seed": 0}
    assert (comp.temperature, comp.n, comp.stream, comp.echo) == (1.0, 1, False, False)
    chat = ChatCompletionRequest.model_validate(CHAT | nulls | {"logprobs": None, "audio": None, "modalities": None,
                                                                "reasoning_effort": None, "max_completion_tokens": None})
    assert chat.logprobs is False and chat.num_logprobs is None and chat.requested_max_tokens is None
    streamed = ChatCompletionRequest.model_validate(CHAT | {"stream": True, "stream_options": {"include_usage": None}})
    assert streamed.include_usage is False
    for bad in ({"model": None}, {"messages": None}, {"temprature": None}, {"modalities": ["text", "audio"]},
                {"stream": True, "stream_options": {"include_usag": None}}):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate(CHAT | bad)


def test_vllms_stop_string_and_special_token_switches():
    req = CompletionRequest.model_validate({"model": "m", "prompt": "x", "stop": "y", "include_stop_str_in_output": True,
                                            "skip_special_tokens": True})
    assert req.sampling_params(4)["include_stop_str_in_output"] is True
    assert "include_stop_str_in_output" not in CompletionRequest.model_validate({"model": "m", "prompt": "x"}).sampling_params(4)
    with pytest.raises(ValidationError, match="skip_special_tokens"):
        ChatCompletionRequest.model_validate(CHAT | {"skip_special_tokens": False})


def test_whitespace_is_a_prompt_and_only_nothing_is_empty():
    assert CompletionRequest.model_validate({"model": "m", "prompt": "\n "}).prompt == "\n "
    for empty in ("", [], [""]):
        with pytest.raises(ValidationError, match="must not be empty"):
            CompletionRequest.model_validate({"model": "m", "prompt": empty})


class _Request:
    def __init__(self, body: bytes, headers: dict | None = None, chunk: int = 4096):
        self.headers, self._body, self._chunk = {"content-type": "application/json"} | (headers or {}), body, chunk

    async def stream(self):
        for i in range(0, len(self._body), self._chunk):
            yield self._body[i:i + self._chunk]


def _read(body: bytes, headers: dict | None = None, cap: int = 10_000):
    return asyncio.run(read_json_object(_Request(body, headers), cap))


@pytest.mark.parametrize("body,headers,status,needle", [
    (b"x" * 20_000, {"content-length": "20000"}, 413, "limit"),
    (b"x" * 20_000, {}, 413, "limit"),                                   # no Content-Length: counted while read
    (b"[" * 5000 + b"]" * 5000, {}, 400, "nested"),
    (b"[1]", {}, 400, "JSON object"),
    (b"{oops", {}, 400, "not valid JSON"),
    (b"\xff{}", {}, 400, "not valid JSON"),
    (b'{"max_tokens": 5, "max_tokens": 500}', {}, 400, "'max_tokens' appears twice"),   # one would be dropped
    (b'{"messages": [{"role": "user", "role": "system", "content": "x"}]}', {}, 400, "'role' appears twice"),
    (b"{}", {"content-type": "application/x-www-form-urlencoded"}, 415, "Content-Type"),
    (b"\x1f\x8b\x08", {"content-encoding": "gzip"}, 415, "Content-Encoding 'gzip' is not supported"),
])
def test_read_json_object_refusals(body, headers, status, needle):
    with pytest.raises(APIError) as ei:
        _read(body, headers)
    assert ei.value.status == status and needle in ei.value.message
    assert set(ei.value.body()["error"]) == {"message", "type", "param", "code"}


def test_a_body_that_stalls_is_a_408_and_frees_its_slot():
    """Headers, half a body, then nothing: answered after the timeout instead of holding one of the
    ingress's open-request slots for as long as the client likes (a slow-loris client)."""
    class Stalled(_Request):
        async def stream(self):
            yield b'{"model":'
            await asyncio.sleep(3600)

    with pytest.raises(APIError) as ei:
        asyncio.run(read_json_object(Stalled(b""), 10_000, timeout_s=0.2))
    assert ei.value.status == 408 and ei.value.code == "request_timeout" and "0.2 s" in ei.value.message


def test_a_client_that_hangs_up_mid_body_is_a_499_not_a_server_error():
    from starlette.requests import ClientDisconnect

    class HungUp(_Request):
        async def stream(self):
            yield b'{"model":'
            raise ClientDisconnect()

    with pytest.raises(APIError) as ei:
        asyncio.run(read_json_object(HungUp(b""), 10_000))
    assert ei.value.status == 499 and ei.value.code == "client_closed"


def test_read_json_object_accepts_json_types():
    assert _read(b'{"a": 1}', {"content-type": "application/json; charset=utf-8"}) == {"a": 1}
    assert _read(b'{"a": 1}', {"content-type": ""}) == {"a": 1}


def _lp(tok: int, k: int = 2) -> TokenLogprob:
    return TokenLogprob(tok, -0.25, [(tok, -0.25), (ord("z"), -3.0)][:k])


def _out(rid="r", new=b"de", text="de", finished=False, prompt=b"abc", prompt_lps=None, so_far=b"") -> RequestOutput:
    toks = list(so_far + new)
    return RequestOutput(rid, list(prompt), toks, text, list(new), text[-len(new):], finished,
                         "length" if finished else None, logprobs=[_lp(t) for t in toks],
                         new_logprobs=[_lp(t) for t in new], prompt_logprobs=prompt_lps)


def test_completion_render_n_echo_logprobs():
    req = CompletionRequest.model_validate({"model": "m", "prompt": "abc", "echo": True, "logprobs": 1, "n": 2})
    render = CompletionRender("m", PromptTokenizer(), req, ["abc"], [list(b"abc")])
    prompt_lps = [None, _lp(ord("b")), _lp(ord("c"))]
    body = render.full("id", [_out(finished=True), _out(finished=True)], [prompt_lps] * 2).model_dump()
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["usage"]["completion_tokens"] == 4
    lp = body["choices"][1]["logprobs"]
    assert body["choices"][1]["text"] == "abcde" and lp["tokens"] == list("abcde")
    assert lp["token_logprobs"] == [None, -0.25, -0.25, -0.25, -0.25] and lp["text_offset"] == [0, 1, 2, 3, 4]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][3] == {"d": -0.25, "z": -3.0}
    # streamed: the prompt (and its logprobs) with each choice's first chunk, offsets continue across chunks
    first = render.chunk("id", 1, _out(new=b"d", text="d", prompt_lps=prompt_lps)).model_dump()["choices"][0]
    assert first["index"] == 1 and first["text"] == "abcd" and first["logprobs"]["text_offset"] == [0, 1, 2, 3]
    nxt = render.chunk("id", 1, _out(new=b"e", text="de", so_far=b"d", finished=True)).model_dump()["choices"][0]
    assert nxt["text"] == "e" and nxt["logprobs"]["text_offset"] == [4] and nxt["finish_reason"] == "length"


def test_a_batch_of_prompts_is_n_choices_per_prompt_indexed_prompt_by_prompt():
    """vLLM's layout: choice p*n + j is sample j of prompt p; usage counts each prompt once."""
    req = CompletionRequest.model_validate({"model": "m", "prompt": ["abc", "xy"], "echo": True, "logprobs": 0,
                                            "n": 2})
    assert req.prompts == ["abc", "xy"] and req.sampling_params(4, 1)["seed"] == req.sampling_params(4, 0)["seed"] + 1
    seeds = {req.sampling_params(4, j, p)["seed"] for p in range(2) for j in range(2)}
    assert len(seeds) == 4                          # no seed given: the same prompt twice samples twice
    seeded = CompletionRequest.model_validate({"model": "m", "prompt": ["abc", "abc"], "seed": 5})
    assert [seeded.sampling_params(4, 0, p)["seed"] for p in range(2)] == [5, 5]   # vLLM: each prompt as alone
    render = CompletionRender("m", PromptTokenizer(), req, ["abc", "xy"], [list(b"abc"), list(b"xy")])
    outs = [_out(finished=True), _out(finished=True), _out(finished=True, prompt=b"xy"), _out(finished=True, prompt=b"xy")]
    body = render.full("id", outs, [None] * 4).model_dump()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "abcde"), (1, "abcde"), (2, "xyde"), (3, "xyde")]
    assert body["choices"][3]["logprobs"]["tokens"] == list("xyde")
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
    assert render.chunk("id", 2, _out(new=b"d", text="d", prompt=b"xy")).choices[0].text == "xyd"   # echo: its own prompt
    for batch in (["a", ""], [[5], []]):
        with pytest.raises(ValidationError, match="prompt 1 must not be empty"):
            CompletionRequest.model_validate({"model": "m", "prompt": batch})
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[5, 6], [7]]}).prompts == [[5, 6], [7]]
    assert CompletionRequest.model_validate({"model": "m", "prompt": [5, 6]}).prompts == [[5, 6]]


def test_every_chunk_of_a_request_carries_one_created_time(monkeypatch):
    import time

    clock = iter(range(1_000, 2_000, 7))
    monkeypatch.setattr(time, "time", lambda: next(clock))
    render = ChatRender("m", PromptTokenizer(), ChatCompletionRequest.model_validate(CHAT | {"n": 2}))
    chunks = render.head("id") + [render.chunk("id", i % 2, _out(new=b"d", text="d")) for i in range(4)]
    chunks.append(render.usage_chunk("id", [_out(finished=True)] * 2))
    assert {c.created for c in chunks} == {render.created}
    req = CompletionRequest.model_validate({"model": "m", "prompt": "abc"})
    render = CompletionRender("m", PromptTokenizer(), req, ["abc"], [list(b"abc")])
    assert {render.chunk("id", 0, _out(new=b"d", text="d")).created for _ in range(3)} == {render.created}


def test_chat_render_logprobs_and_heads():
    req = ChatCompletionRequest.model_validate(CHAT | {"logprobs": True, "top_logprobs": 1, "n": 2})
    render = ChatRender("m", PromptTokenizer(), req)
    assert [h.choices[0].index for h in render.head("id")] == [0, 1]
    chunk = render.chunk("id", 1, _out(new="é".encode(), text="é")).model_dump()["choices"][0]
    content = chunk["logprobs"]["content"]
    assert len(content) == 2 and [c["bytes"] for c in content] == [[0xC3], [0xA9]]   # each token's own byte
    assert bytes(content[0]["bytes"] + content[1]["bytes"]).decode() == "é"
    assert content[0]["top_logprobs"][0]["logprob"] == -0.25
    full = render.full("id", [_out(finished=True), _out(finished=True)]).model_dump()
    assert [t["token"] for t in full["choices"][0]["logprobs"]["content"]] == ["d", "e"]


def test_prompt_length_checked_in_characters_before_tokenizing():
    class Counting(PromptTokenizer):
        calls = 0

        def tokenize(self, prompt):
            Counting.calls += 1
            return super().tokenize(prompt)

    prompts = IngressPrompts(Counting())
    with pytest.raises(APIError) as ei:
        asyncio.run(prompts.completion("x" * 101, max_model_len=100, need_text=False))
    assert ei.value.param == "prompt" and Counting.calls == 0 and ei.value.code == "context_length_exceeded"
    assert ei.value.message.startswith("This model's maximum context length is 100 tokens. However, your prompt")
    with pytest.raises(APIError) as ei:
        asyncio.run(prompts.chat([{"role": "user", "content": "x" * 101}], max_model_len=100))
    assert ei.value.param == "messages" and Counting.calls == 0
    assert asyncio.run(prompts.completion("abc", max_model_len=100, need_text=False)) == (list(b"abc"), "abc")
    assert asyncio.run(prompts.completion([97, 98], max_model_len=100, need_text=True)) == ([97, 98], "ab")
    with pytest.raises(APIError) as ei:
        asyncio.run(prompts.completion([5, -1], max_model_len=100, need_text=True))
    assert ei.value.param == "prompt" and ">= 0" in ei.value.message
    with pytest.raises(APIError, match="token id 4294967296 is beyond any vocabulary"):
        asyncio.run(prompts.completion([2 ** 32], max_model_len=100, need_text=False))


def test_merge_streams_interleaves_and_stops_readers():
    async def gen(i, n, fail=False):
        for k in range(1, n + 1):
            await asyncio.sleep(0.001 * (i + 1))
            if fail and k == 2:
                raise RuntimeError("boom")
            yield _out(rid=f"r{i}", finished=k == n)

    async def run(fail: bool):
        its = [gen(0, 4), gen(1, 3, fail)]
        firsts = [await it.__anext__() for it in its]
        seen = []
        merged = merge_streams(its, firsts)
        try:
            async for i, out in merged:
                seen.append((i, out.finished))
        finally:
            await merged.aclose()
            for it in its:
                await it.aclose()
        return seen

    seen = asyncio.run(run(False))
    assert [i for i, _ in seen].count(0) == 4 and [i for i, _ in seen].count(1) == 3
    assert sum(done for _, done in seen) == 2
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(run(True))


def test_replica_merge_keeps_logprobs_and_prompt_logprobs():
    a = _out(new=b"d", text="d", prompt_lps=[None, _lp(98)])
    b = _out(new=b"e", text="de", so_far=b"d")
    merged = merge_outputs([a, b])
    assert merged.new_token_ids == list(b"de") and merged.delta_text == "de"
    assert [e.token_id for e in merged.new_logprobs] == list(b"de") and merged.prompt_logprobs == a.prompt_logprobs


def test_a_client_that_disconnects_is_logged_as_such_not_as_a_server_error(caplog):
    """Serve cancels a request whose client went away; that is a normal event (an info line), not an
    unhandled error with a traceback, while a real bug still is one."""
    from ray.exceptions import TaskCancelledError

    from cluster import ingress

    class Req:
        class url:
            path = "/v1/completions"

    caplog.set_level("INFO", logger="cluster.ingress")
    res = asyncio.run(ingress._unexpected(Req(), TaskCancelledError()))
    assert res.status_code == 499 and not any(r.exc_info for r in caplog.records)
    assert "client disconnected" in caplog.text
    res = asyncio.run(ingress._unexpected(Req(), KeyError("bug")))
    assert res.status_code == 500 and any(r.exc_info for r in caplog.records if r.levelname == "ERROR")


def test_min_tokens_and_allowed_token_ids_are_sent_when_set_and_checked():
    given = CompletionRequest.model_validate({"model": "m", "prompt": "x", "min_tokens": 3, "allowed_token_ids": [4, 9]})
    assert given.sampling_params(8)["min_tokens"] == 3 and given.sampling_params(8)["allowed_token_ids"] == [4, 9]
    plain = CompletionRequest.model_validate({"model": "m", "prompt": "x"}).sampling_params(8)
    assert "min_tokens" not in plain and "allowed_token_ids" not in plain
    for model, body, param, needle in [
        (CompletionRequest, {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens", "5 is more than max_tokens (4)"),
        (CompletionRequest, {"prompt": "x", "max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens", "max_tokens (0)"),
        (ChatCompletionRequest, CHAT | {"max_completion_tokens": 2, "min_tokens": 3}, "min_tokens",
         "more than max_completion_tokens (2)"),
        (CompletionRequest, {"prompt": "x", "min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
        (CompletionRequest, {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids", "at least 1 item"),
        (ChatCompletionRequest, CHAT | {"allowed_token_ids": list(range(1025))}, "allowed_token_ids", "at most 1024"),
        (ChatCompletionRequest, CHAT | {"allowed_token_ids": ["a"]}, "allowed_token_ids.0", "valid integer"),
    ]:
        err = _refusal(model, {"model": "m"} | body)
        assert err.param == param and needle in str(err), err


def test_bad_words_and_truncate_prompt_tokens_are_sent_when_set_and_checked():
    given = ChatCompletionRequest.model_validate(CHAT | {"bad_words": ["foo", "bar baz"], "truncate_prompt_tokens": -1})
    sent = given.sampling_params(8)
    assert sent["bad_words"] == ["foo", "bar baz"] and sent["truncate_prompt_tokens"] == -1
    plain = CompletionRequest.model_validate({"model": "m", "prompt": "x", "bad_words": []}).sampling_params(8)
    assert "bad_words" not in plain and "truncate_prompt_tokens" not in plain
    for model, body, param, needle in [
        (CompletionRequest, {"prompt": "x", "bad_words": ["ok", " "]}, "bad_words", "must be words: ' ' is blank"),
        (CompletionRequest, {"prompt": "x", "bad_words": "foo"}, "bad_words", "valid list"),
        (ChatCompletionRequest, CHAT | {"bad_words": ["w"] * 1025}, "bad_words", "at most 1024"),
        (CompletionRequest, {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "got 0"),
        (CompletionRequest, {"prompt": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "or equal to -1"),
        (CompletionRequest, {"prompt": "x", "truncate_prompt_tokens": 3.0}, "truncate_prompt_tokens", "valid integer"),
    ]:
        err = _refusal(model, {"model": "m"} | body)
        assert err.param == param and needle in str(err), err


def test_max_tokens_and_max_completion_tokens_that_agree_are_one_limit():
    req = ChatCompletionRequest.model_validate(CHAT | {"max_tokens": 7, "max_completion_tokens": 7})
    assert req.requested_max_tokens == 7
    ok = ChatCompletionRequest.model_validate(CHAT | {"messages": [{"role": "assistant", "content": None},
                                                                   {"role": "user", "content": "go on"}]})
    assert ok.template_messages()[0] == {"role": "assistant", "content": ""}


def test_a_stream_with_a_deadline_cancelled_twice_ends_cleanly():
    """limits.request_timeout_s set and the client gone: Serve cancels the stream's task, and anyio's
    cancel scope cancels it again while the first cancellation is being handled. The stream ends by
    cancellation with its engine stream closed, not with "aclose(): asynchronous generator is already
    running" (counted a 500, with a traceback in the replica's log)."""
    from types import SimpleNamespace

    from cluster.ingress import OpenAIIngress
    from cluster.stream_response import Release

    closed = []

    async def engine_stream():
        try:
            while True:
                await asyncio.sleep(0.005)
                yield _out(new=b"d", text="d")
        finally:
            closed.append("engine stream")

    class Render:
        def head(self, rid):
            return []

        def chunk(self, rid, i, out):
            return {"choice": i}

    ingress = SimpleNamespace(config=SimpleNamespace(limits=SimpleNamespace(request_timeout_s=60.0)),
                              metrics=SimpleNamespace(tokens=lambda n: None))

    async def run():
        it = engine_stream()
        first = await it.__anext__()

        async def release():
            closed.append("released")
            await it.aclose()

        when = asyncio.get_running_loop().time() + 60.0
        body = OpenAIIngress._sse(ingress, [it], [first], "rid", SimpleNamespace(include_usage=False), Render(),
                                  0.0, 0.0, when, Release(release))
        got = []

        async def consume():
            try:
                async for event in body:
                    got.append(event)
            finally:
                await body.aclose()

        task = asyncio.create_task(consume())
        while len(got) < 3:
            await asyncio.sleep(0.001)
        task.cancel()
        await asyncio.sleep(0)      # the first cancellation is being handled inside the stream
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert sorted(closed) == ["engine stream", "released"]


def test_a_request_without_a_seed_gets_its_own_random_one():
    """Every replica's engine seeds unseeded requests from the same sequence (EngineConfig.seed 0), so
    the k-th on each replica would draw the same text: the ingress draws each request's seed instead,
    once (a retry and the n samples use it), and a seed the client gives is kept."""
    a, b = (CompletionRequest.model_validate({"model": "m", "prompt": "hi", "n": 3}) for _ in range(2))
    seeds = [a.sampling_params(4, i)["seed"] for i in range(3)]
    assert seeds == [(seeds[0] + i) % 2**63 for i in range(3)] and a.sampling_params(4, 0)["seed"] == seeds[0]
    assert b.sampling_params(4, 0)["seed"] != seeds[0] and 0 <= seeds[0] < 2**63
    chat = ChatCompletionRequest.model_validate(CHAT | {"seed": 7, "n": 2})
    assert [chat.sampling_params(4, i)["seed"] for i in range(2)] == [7, 8]



@pytest.mark.parametrize("extra, spec", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": True}}},
     {"json": {"type": "object"}}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}}, {"json_object": True}),   # no schema: any
    ({"structured_outputs": {"regex": "[0-9]+", "json": None}}, {"regex": "[0-9]+"}),
    ({"structured_outputs": {"choice": ["a", "b"]}, "response_format": {"type": "text"}}, {"choice": ["a", "b"]}),
    ({"structured_outputs": {"json": '{"type": "string"}', "disable_any_whitespace": True}},
     {"json": '{"type": "string"}', "disable_any_whitespace": True}),
    ({"structured_outputs": {"grammar": 'root ::= "x" | "y"'}}, {"grammar": 'root ::= "x" | "y"'}),
])
def test_structured_outputs_reach_the_engine_as_its_fields(extra, spec):
    """Both endpoints take OpenAI's response_format and vLLM's structured_outputs; the engine gets the
    StructuredOutputs fields (a dict: SamplingParams is built on the replica), and they build."""
    from eagle_worker import SamplingParams

    for model, base in ((ChatCompletionRequest, CHAT), (CompletionRequest, {"model": "m", "prompt": "x"})):
        params = model.model_validate(base | extra).sampling_params(4)
        assert params.get("structured_outputs") == spec
        assert SamplingParams(**params).structured_outputs == (None if spec is None else
                                                                SamplingParams(structured_outputs=spec).structured_outputs)
