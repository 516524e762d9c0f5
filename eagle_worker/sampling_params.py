"""Per-request sampling parameters (the vLLM names and ranges), validated when built so bad input
fails early with a message naming the field (the engine takes a validated copy of each request's:
a field changed after building is checked again, and cannot move a request in flight)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

# Temperatures below this sample like greedy decoding (vLLM's _SAMPLING_EPS): dividing logits by a
# subnormal temperature overflows to inf and the probabilities to NaN.
MIN_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20          # top alternatives a request may ask for per token (OpenAI's limit)
MAX_SEED = 2**63           # seeds are 0 <= seed < 2**63 (a signed 64-bit integer)
# Characters a prompt that is truncated (truncate_prompt_tokens) may have at least: it is tokenized
# whole before its last tokens are kept, so this bounds that work (`prompt_chars_limit`).
MAX_TRUNCATED_PROMPT_CHARS = 1 << 22


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def is_int(x) -> bool:
    """An integer, not a bool (True is an int to Python, and `max_tokens=True` is a mistake); the
    engine's one check of integer settings (SamplingParams, EngineConfig, SpecConfig)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_token_id(x) -> bool:
    """An integer token id as a prompt may hold it: Python's or numpy's, never a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _topn(x) -> bool:
    return x is None or (is_int(x) and 0 <= x <= MAX_LOGPROBS)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1          # -1 or 0: no top-k
    min_p: float = 0.0
    seed: int | None = None  # None: the engine draws one; either way the text is a function of it
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None          # None: none; k: the chosen token's plus the top k (raw target)
    prompt_logprobs: int | None = None   # the same for every prompt token (first one None)
    presence_penalty: float = 0.0        # minus this for every token already in the output
    frequency_penalty: float = 0.0       # minus this times the token's count in the output
    repetition_penalty: float = 1.0      # tokens in prompt or output: positive logits / r, negative * r
    logit_bias: dict[int, float] | None = None   # token id -> added to its raw logit
    include_stop_str_in_output: bool = False
    min_tokens: int = 0                  # no EOS / stop id within the first this many, and stop strings must end after them
    allowed_token_ids: list[int] | None = None   # only these tokens can be drawn (vLLM's)
    structured_outputs: object = None    # StructuredOutputs (or its fields as a dict): the output matches a grammar
    truncate_prompt_tokens: int | None = None    # keep the prompt's last k tokens; -1: as many as leave max_tokens room
    bad_words: list[str] | None = None   # words the output cannot hold (vLLM's: their last token is banned after the rest)
    # derived, not set by callers: what the engine reads per token, built once per request
    stop_id_set: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)
    _bias_rows: tuple | None = field(default=None, init=False, repr=False, compare=False)
    _allowed_rows: object = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        stop_ok = self.stop is None or (isinstance(self.stop, (list, tuple)) and all(isinstance(x, str) for x in self.stop))
        ids_ok = isinstance(self.stop_token_ids or [], (list, tuple)) and all(
            is_int(t) and t >= 0 for t in self.stop_token_ids or [])
        if stop_ok:
            self.stop = list(self.stop or [])
        if ids_ok:
            self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or []))   # each id once
        bad_ok = self.bad_words is None or (isinstance(self.bad_words, (list, tuple)) and all(
            isinstance(w, str) and w.strip() for w in self.bad_words))
        if bad_ok:
            self.bad_words = list(dict.fromkeys(self.bad_words)) or None if self.bad_words is not None else None
        allowed_ok = self.allowed_token_ids is None or (
            isinstance(self.allowed_token_ids, (list, tuple)) and len(self.allowed_token_ids) > 0
            and all(is_int(t) and t >= 0 for t in self.allowed_token_ids))
        if allowed_ok and self.allowed_token_ids is not None:
            self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))
        if self.logit_bias is not None and isinstance(self.logit_bias, dict):
            self.logit_bias = {_int_key(k): v for k, v in self.logit_bias.items()} or None
        bias = self.logit_bias or {}
        self.structured_outputs = _structured(self.structured_outputs)
        structured = self.structured_outputs is not None
        checks = [
            (stop_ok, "stop", f"must be a string or a list of strings, got {_short(self.stop)}"),
            (not stop_ok or all(self.stop), "stop", "must not hold an empty string (it would match at once; "
             "leave stop out for none)"),
            (ids_ok, "stop_token_ids", f"must be a list of token ids (integers >= 0), got {_short(self.stop_token_ids)}"),
            (bad_ok, "bad_words", f"must be None or a list of words (strings that are not blank), got {_short(self.bad_words)}"),
            (allowed_ok, "allowed_token_ids", "must be None or a non-empty list of token ids (integers >= 0), "
             f"got {_short(self.allowed_token_ids)}"),
            (is_int(self.max_tokens) and self.max_tokens > 0, "max_tokens",
             f"must be a positive integer, got {self.max_tokens!r}"),
            (is_int(self.min_tokens) and 0 <= self.min_tokens
             and (not is_int(self.max_tokens) or self.min_tokens <= self.max_tokens),
             "min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens!r}], got {self.min_tokens!r}"),
            (not structured or not (self.min_tokens or self.allowed_token_ids), "structured_outputs",
             "cannot be combined with min_tokens or allowed_token_ids (the grammar alone says which tokens may come)"),
            (_number(self.temperature) and self.temperature >= 0,
             "temperature", f"must be a finite number >= 0, got {self.temperature!r}"),
            (_number(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}"),
            (is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1), "top_k",
             f"must be -1 (off) or >= 0, got {self.top_k!r}"),
            (_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}"),
            (self.seed is None or (is_int(self.seed) and 0 <= self.seed < MAX_SEED), "seed",
             f"must be an integer in [0, 2**63), got {self.seed!r}"),
            (_topn(self.logprobs), "logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"),
            (_topn(self.prompt_logprobs), "prompt_logprobs",
             f"must be None or an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}"),
            (_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
             f"must be in [-2, 2], got {self.presence_penalty!r}"),
            (_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
             f"must be in [-2, 2], got {self.frequency_penalty!r}"),
            (_number(self.repetition_penalty) and 0 < self.repetition_penalty <= 2, "repetition_penalty",
             f"must be in (0, 2], got {self.repetition_penalty!r}"),
            (isinstance(self.ignore_eos, bool), "ignore_eos", f"must be true or false, got {self.ignore_eos!r}"),
            (self.truncate_prompt_tokens is None or (is_int(self.truncate_prompt_tokens) and (
                self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1)), "truncate_prompt_tokens",
             f"must be None, -1 (as many as fit) or an integer >= 1, got {self.truncate_prompt_tokens!r}"),
            (isinstance(self.include_stop_str_in_output, bool), "include_stop_str_in_output",
             f"must be true or false, got {self.include_stop_str_in_output!r}"),
            (self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
                is_int(k) and k >= 0 and _number(v) and -100 <= v <= 100 for k, v in bias.items())),
             "logit_bias", "must map token ids (integers >= 0) to numbers in [-100, 100], "
             f"got {_short(self.logit_bias)}"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} {why}")
        self.stop_id_set = frozenset(self.stop_token_ids)
        self._bias_rows = self._allowed_rows = None

    def logit_bias_rows(self):
        """logit_bias as (token ids, biases) tensors on the CPU, built once: the sampler adds them to
        every row this request samples."""
        if self._bias_rows is None and self.logit_bias:
            import torch

            self._bias_rows = (torch.tensor(list(self.logit_bias), dtype=torch.long),
                               torch.tensor(list(self.logit_bias.values()), dtype=torch.float32))
        return self._bias_rows

    def allowed_rows(self):
        """allowed_token_ids as a tensor on the CPU, built once."""
        if self._allowed_rows is None and self.allowed_token_ids:
            import torch

            self._allowed_rows = torch.tensor(self.allowed_token_ids, dtype=torch.long)
        return self._allowed_rows

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def uses_output_counts(self) -> bool:
        """Presence or frequency penalty: the draw depends on the output so far."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def processes_logits(self) -> bool:
        """Bias, a penalty, min_tokens (its first rows forbid the stop tokens), allowed_token_ids, bad_words
        or a structured output changes the raw logits before temperature and the filters."""
        return (bool(self.logit_bias) or self.uses_output_counts or self.repetition_penalty != 1 or self.min_tokens > 0
                or bool(self.allowed_token_ids) or self.structured_outputs is not None or bool(self.bad_words))


def _structured(x):
    """None, or a StructuredOutputs (built from a dict of its fields, as the HTTP and job edges send it)."""
    from eagle_worker.structured_output import StructuredOutputs

    if x is None or isinstance(x, StructuredOutputs):
        return None if x is None else StructuredOutputs(**vars(x))   # checked again, and the request's own
    if isinstance(x, dict):
        odd = sorted(set(x) - set(StructuredOutputs.__dataclass_fields__), key=str)
        if odd:
            raise ValueError(f"SamplingParams.structured_outputs has unknown field(s) {_short(odd)}; "
                             "it takes json, regex, choice, grammar, json_object and disable_any_whitespace")
        return StructuredOutputs(**x)
    raise ValueError(f"SamplingParams.structured_outputs must be a StructuredOutputs or a dict of its fields, "
                     f"got {type(x).__name__}")


def _int_key(k):
    """JSON objects have string keys ("50256"); a key that is not an integer stays as it is (refused)."""
    if isinstance(k, str) and k.isascii() and k.strip().lstrip("-").isdigit():
        return int(k)
    return k


def _short(x) -> str:
    s = repr(x)
    return s if len(s) <= 80 else s[:77] + "..."


def prompt_chars_limit(max_model_len: int, max_chars_per_token: int, truncating: bool) -> int:
    """The most characters a prompt text may have before it is tokenized: what the context holds at the
    tokenizer's longest piece, or for a prompt truncate_prompt_tokens cuts, at least
    MAX_TRUNCATED_PROMPT_CHARS. The one bound for the engine and the HTTP ingress."""
    limit = max_model_len * max(1, max_chars_per_token)
    return max(limit, MAX_TRUNCATED_PROMPT_CHARS) if truncating else limit


def kept_prompt_tokens(truncate: int | None, num_prompt_tokens: int, max_model_len: int, max_tokens: int) -> int:
    """How many of a prompt's tokens (its last ones) a request keeps: all without truncation; with
    truncate_prompt_tokens k, the last k (k must leave room for a generated token); with -1, as many as
    leave the context room for max_tokens. The one rule for the engine and the HTTP ingress."""
    if truncate is None:
        return num_prompt_tokens
    if truncate == -1:
        if max_tokens >= max_model_len:
            raise ValueError(f"SamplingParams.truncate_prompt_tokens -1 keeps the prompt's last max_model_len - "
                             f"max_tokens tokens, and max_tokens ({max_tokens}) leaves none of max_model_len "
                             f"({max_model_len}); give a smaller max_tokens")
        return min(num_prompt_tokens, max_model_len - max_tokens)
    if truncate >= max_model_len:
        raise ValueError(f"SamplingParams.truncate_prompt_tokens ({truncate}) must be less than max_model_len "
                         f"({max_model_len}), leaving room for a generated token")
    return min(num_prompt_tokens, truncate)
