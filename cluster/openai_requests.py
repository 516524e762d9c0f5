"""The OpenAI API's request bodies (completions, chat), validated at the edge.

A field we do not serve is refused with a 400 naming it, never silently ignored: unknown fields,
`tools`; the few that OpenAI clients send and that change nothing (`HARMLESS`) are accepted.
`response_format` (text, json_object, json_schema) on both endpoints, as vLLM takes it. Extensions
beyond OpenAI (vLLM's names): top_k, min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids,
allowed_token_ids, bad_words, structured_outputs, include_stop_str_in_output, truncate_prompt_tokens,
skip_special_tokens (true only) and `priority` (0 = online, the default; 1 = offline/batch work that yields to online requests).
"""
from __future__ import annotations

import re
import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from eagle_worker.engine_api import MAX_CHOICES, StructuredOutputs, echoed_empty, join_text_parts

MAX_LOGPROBS = 20      # vLLM's default max_logprobs
MAX_N = 16             # parallel samples per request (each is an engine request)
MAX_SEED = 2**63       # seeds are in [0, 2**63)
# Entries in logit_bias / stop_token_ids: the engine works each request's lists into every step it
# runs, so one request with a million entries would slow everyone's (a 2 MiB body holds ~400k ids).
MAX_TOKEN_LIST = 1024
# Fields OpenAI clients send that change nothing here, accepted as vLLM accepts them.
HARMLESS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
            "safety_identifier")
# OpenAI fields this server does not serve, taken when null (they then ask for nothing); any value is a 400.
UNSERVED_NULLABLE = ("audio", "modalities", "prediction", "reasoning_effort", "verbosity", "web_search_options")


def format_refusal(field: str, engine_message: str) -> str:
    """An engine refusal of a format (SamplingParams.structured_outputs ...) in the field the client
    asked with: `response_format` or `structured_outputs` (HTTP requests and job rows alike)."""
    return f"{field}: {engine_message.removeprefix('SamplingParams.structured_outputs').lstrip(': ')}"


def truncation_given(v: int | None) -> int | None:
    """truncate_prompt_tokens at an edge (HTTP bodies, job configs): 0 keeps nothing, so it is refused."""
    if v == 0:
        raise ValueError("must be -1 (keep as many tokens as fit beside max_tokens) or at least 1, got 0")
    return v


def _null_is_not_given(model: type[BaseModel], data: Any) -> Any:
    """OpenAI's optional fields are nullable: an explicit null (the official client sends one for a
    None argument) means "not given", so the field keeps its default, as OpenAI and vLLM read it. A
    required field's null, or an unknown field's, is still refused."""
    if not isinstance(data, dict):
        return data
    fields = model.model_fields
    return {k: v for k, v in data.items()
            if v is not None or (fields[k].is_required() if k in fields else k not in UNSERVED_NULLABLE)}


def _batch(prompt: Any) -> list:
    """A completions `prompt` as its prompts: one, or a batch (a list of strings or of token-id lists)."""
    return list(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        return _null_is_not_given(cls, data)


class StructuredOutputsBody(BaseModel):
    """vLLM's `structured_outputs`: exactly one of json (a JSON schema), regex, choice, grammar (Lark
    or GBNF), json_object; its other options (structural tags, whitespace patterns) are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    def spec(self) -> dict[str, Any]:
        out = dict(json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
                   json_object=bool(self.json_object), disable_any_whitespace=self.disable_any_whitespace)
        return {k: v for k, v in out.items() if v not in (None, False)}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text (free), json_object (any JSON object), json_schema."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type \"json_schema\" and only allowed with it")
        return self

    def spec(self) -> dict[str, Any] | None:
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":   # OpenAI's schema is optional: without one, any JSON object
            schema = self.json_schema.schema_
            return {"json": schema} if schema is not None else {"json_object": True}
        return None


class _SamplingRequest(BaseModel):
    # A field we do not know is refused (400 naming it), never silently ignored; see HARMLESS.
    # NaN and infinities (Python's JSON reads them) are refused as not finite. Types are strict, as
    # OpenAI checks them: "4" or true is not an integer, 4.0 is not either; 4 is a float.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=MAX_SEED)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # accepted and ignored (HARMLESS)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # extensions (vLLM's names)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_TOKEN_LIST)
    allowed_token_ids: list[int] | None = Field(None, min_length=1, max_length=MAX_TOKEN_LIST)
    bad_words: list[str] | None = Field(None, max_length=MAX_TOKEN_LIST)
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(None, ge=-1)   # the prompt's last k tokens; -1: as many as fit
    skip_special_tokens: bool = True       # the engine's text always skips them: false is refused
    structured_outputs: StructuredOutputsBody | None = None
    response_format: ResponseFormat | None = None
    priority: int = Field(0, ge=0, le=1)

    @field_validator("skip_special_tokens")
    @classmethod
    def _special_tokens_skipped(cls, v: bool) -> bool:
        if not v:
            raise ValueError("false is not supported: text never holds special tokens here (logprobs name them)")
        return v

    @field_validator("bad_words")
    @classmethod
    def _words(cls, v: list[str] | None) -> list[str] | None:
        blank = next((w for w in v or () if not w.strip()), None)
        if blank is not None:
            raise ValueError(f"must be words: {blank!r} is blank")
        return v

    _truncation = field_validator("truncate_prompt_tokens")(truncation_given)

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        return _null_is_not_given(cls, data)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        seen: dict[int, str] = {}
        if v and len(v) > MAX_TOKEN_LIST:
            raise ValueError(f"at most {MAX_TOKEN_LIST} token ids may be biased, got {len(v)}")
        for key, bias in (v or {}).items():
            if not re.fullmatch(r"\s*[0-9]+\s*", key):      # ASCII digits: "²".isdigit() too
                raise ValueError(f"keys must be token ids as strings (e.g. \"50256\"), got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"values must be in [-100, 100], got {bias} for token {key}")
            if int(key) in seen:         # "7" and "07": one bias would silently win
                raise ValueError(f"keys {seen[int(key)]!r} and {key!r} are the same token id {int(key)}")
            seen[int(key)] = key
        return v

    @model_validator(mode="after")
    def _min_tokens_fit(self):
        """An explicit limit below min_tokens (with a default limit, the engine's own check answers)."""
        limit = getattr(self, "max_completion_tokens", None)
        field = "max_completion_tokens" if limit is not None else "max_tokens"
        limit = self.max_tokens if limit is None else limit
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens: {self.min_tokens} is more than {field} ({limit})")
        return self

    @model_validator(mode="after")
    def _one_structured_output(self):
        """Both ways of asking for a format, or a spec the engine would refuse: a 400 before any replica
        sees it (a bad regex, a schema that does not compile, min_tokens beside it)."""
        if self.structured_outputs is not None and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("structured_outputs: give it or response_format, not both")
        spec = self.structured_spec
        if spec is not None:
            if self.min_tokens or self.allowed_token_ids:
                raise ValueError(f"{self.structured_field}: cannot be combined with min_tokens or allowed_token_ids")
            try:
                StructuredOutputs(**spec).compile()
            except ValueError as e:
                raise ValueError(self.as_asked(str(e))) from None
        return self

    @property
    def structured_spec(self) -> dict[str, Any] | None:
        """The StructuredOutputs fields the request asks for, or None."""
        if self.structured_outputs is not None:
            return self.structured_outputs.spec()
        return self.response_format.spec() if self.response_format is not None else None

    @property
    def structured_field(self) -> str:
        """The field the client asked for a format with (the engine's is structured_outputs)."""
        return "response_format" if self.structured_outputs is None and self.response_format is not None \
            else "structured_outputs"

    def as_asked(self, engine_message: str) -> str:
        """An engine refusal of the format (SamplingParams.structured_outputs ...) in the client's field."""
        return format_refusal(self.structured_field, engine_message)

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true (as OpenAI answers)")
        return self

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if "" in stops:
            raise ValueError("stop must not hold an empty string (it would match at once; leave stop out for none)")
        return v

    def sampling_params(self, max_tokens: int, sample: int = 0, prompt: int = 0) -> dict[str, Any]:
        """Keyword arguments for the engine's SamplingParams (built on the replica) of sample
        `sample` of n of prompt `prompt` of a batch: sample i uses seed + i (vLLM's rule for n > 1,
        for every prompt alike). Fields left at their defaults are not sent, but the seed always is:
        without one the request gets a random seed here, once, and each prompt of a batch its own
        range of it (the same prompt twice in a batch samples twice). Each replica's engine seeds
        unseeded requests from one sequence (EngineConfig.seed, 0 as in vLLM), so every replica's
        k-th unseeded request would draw the same "random" text."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if self._seed is None:
            self._seed = self.seed if self.seed is not None else secrets.randbelow(MAX_SEED)
        seed = (self._seed + sample + (0 if self.seed is not None else prompt * MAX_N)) % MAX_SEED
        params = dict(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                      min_p=self.min_p, seed=seed, stop=stop or None, stop_token_ids=self.stop_token_ids or [],
                      ignore_eos=self.ignore_eos)
        if self.include_stop_str_in_output:
            params["include_stop_str_in_output"] = True
        optional = dict(presence_penalty=(self.presence_penalty, 0.0), frequency_penalty=(self.frequency_penalty, 0.0),
                        repetition_penalty=(self.repetition_penalty, 1.0), min_tokens=(self.min_tokens, 0),
                        allowed_token_ids=(self.allowed_token_ids, None), structured_outputs=(self.structured_spec, None),
                        truncate_prompt_tokens=(self.truncate_prompt_tokens, None), bad_words=(self.bad_words or None, None),
                        logit_bias=({int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None, None),
                        logprobs=(self.num_logprobs, None), prompt_logprobs=(self.num_prompt_logprobs, None))
        params.update({k: v for k, (v, default) in optional.items() if v != default})
        return params

    _num_logprobs: int | None = PrivateAttr(None)          # per endpoint: the top-k alternatives wanted
    _seed: int | None = PrivateAttr(None)                  # the request's seed, or one drawn for it
    _num_prompt_logprobs: int | None = PrivateAttr(None)   # completions with echo and logprobs

    @property
    def num_logprobs(self) -> int | None:
        return self._num_logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self._num_prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)   # 0 with echo: score the prompt only (vLLM, lm-eval)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        batch = _batch(v)
        for i, p in enumerate(batch):
            if not p:                           # whitespace is a prompt, as OpenAI and vLLM take it
                raise ValueError("prompt must not be empty" if len(batch) == 1 else f"prompt {i} must not be empty")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or a batch (a list of strings or of token-id lists), each
        answered by `n` choices, indexed prompt by prompt as vLLM indexes them (prompt * n + sample)."""
        return _batch(self.prompt)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v):
        if v not in (None, 1):
            raise ValueError("best_of is not supported; use n")
        return v

    @property
    def score_only(self) -> bool:
        """`max_tokens: 0` with `echo`: the prompt and its logprobs, nothing generated."""
        return self.max_tokens == 0

    @model_validator(mode="after")
    def _logprob_counts(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is only allowed with echo (to score the prompt)")
        self._num_logprobs = self.logprobs
        self._num_prompt_logprobs = self.logprobs if self.echo else None
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "developer"]    # no "tool": this server has no tool calling
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None      # refused where the model's chat template does not read it (chat_template.py)

    @model_validator(mode="before")
    @classmethod
    def _empty_extras(cls, data: Any) -> Any:
        """A client that sends a response's message back carries its empty fields (`refusal: null`,
        `tool_calls: []`): those are dropped; one that says something, or any other field, stays and
        is refused."""
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if not echoed_empty(k, v)}
        return data

    @model_validator(mode="after")
    def _text_content(self) -> "ChatMessage":
        """Text parts only, each `{"type": "text", "text": ...}` and nothing else (a `cache_control`
        would be ignored); a message other than the assistant's says something."""
        for i, p in enumerate(self.content if isinstance(self.content, list) else ()):
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ValueError(f"content.{i}: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported")
            extra = sorted(set(p) - {"type", "text"})
            if extra:
                raise ValueError(f"content.{i}: unsupported field(s) {', '.join(map(repr, extra))} in a text part")
        if self.role != "assistant" and self.content in (None, []):
            raise ValueError(f"content: a {self.role} message needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return join_text_parts(self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Refused unless they ask for nothing: this server has no tool calling.
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, v):
        if v:
            raise ValueError("tool calling is not supported by this server")
        return v

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, v):
        if v not in (None, "none"):
            raise ValueError("tool calling is not supported by this server; only \"none\"")
        return v

    @model_validator(mode="after")
    def _logprob_counts(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise ValueError(f"max_tokens: {self.max_tokens} differs from max_completion_tokens "
                             f"{self.max_completion_tokens}; send one of them")
        self._num_logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        """The field the limit came from, for errors that name it."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as plain dicts for the chat template ('developer' is OpenAI's new 'system'; a
        participant's `name` passed on, as vLLM does)."""
        out = []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            out.append({"role": role, "content": m.text(), **({"name": m.name} if m.name else {})})
        return out
