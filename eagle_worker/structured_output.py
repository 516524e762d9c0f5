"""Structured outputs (vLLM's `structured_outputs`, OpenAI's `response_format`): the output must match
a JSON schema, a regex, one of given strings or a grammar.

The grammar is a mask on each draw, after the other processing (sampler.py): tokens that cannot
continue a match are -inf, and once the match is complete only EOS is left. llguidance's matcher
(an Earley parser over the tokenizer's byte strings, no per-vocabulary precompilation) gives the mask of
the tokens so far. Tree verification asks it at each node the acceptance walk visits, with the node's
path pushed and rolled back, so speculation stays lossless: a draft token the grammar forbids is simply
never the target's token. Drafts themselves are not constrained (they may waste tree rows, never text).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from eagle_worker.sampling_params import _short

MAX_CHOICES = 1024
MAX_GRAMMAR_CHARS = 1 << 20     # a schema, regex or grammar's text (the HTTP body is 2 MiB at most)


@dataclass
class StructuredOutputs:
    """Exactly one of: `json` (a JSON schema, as a dict or its JSON text), `regex`, `choice` (the output
    is one of these strings), `grammar` (Lark, or llama.cpp's GBNF), `json_object=True` (any JSON object).
    `disable_any_whitespace`: JSON without whitespace between tokens (vLLM's option; a small model
    left free to indent may spend its tokens on it)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        def bad(why: str):
            return ValueError(f"SamplingParams.structured_outputs {why}")

        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be true or false, got {getattr(self, name)!r}")
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise bad(f"must set exactly one of json, regex, choice, grammar, json_object; got {given or 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as e:
                    raise bad(f"json is not valid JSON: {e}") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise bad(f"json must be a JSON schema (an object), got {type(schema).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise bad(f"{name} must be a non-empty string, got {_short(v)}")
        if self.choice is not None:
            ok = isinstance(self.choice, (list, tuple)) and 0 < len(self.choice) <= MAX_CHOICES
            if not ok or not all(isinstance(c, str) and c for c in self.choice):
                raise bad(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings, got {_short(self.choice)}")
            self.choice = list(self.choice)
        if len(self.grammar_spec()[1]) > MAX_GRAMMAR_CHARS:
            raise bad(f"{given[0]} is longer than {MAX_GRAMMAR_CHARS} characters")

    def grammar_spec(self) -> tuple[str, str]:
        """(llguidance format, text) of what was asked."""
        if self.json is not None:
            return "json_schema", self.json if isinstance(self.json, str) else json.dumps(self.json)
        if self.json_object:
            return "json_schema", '{"type": "object"}'
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return "grammar", self.grammar

    def compile(self) -> str:
        """The llguidance grammar, or ValueError naming what is wrong with it (checked without a
        tokenizer: the ingress refuses a bad regex before any replica sees it)."""
        import llguidance

        form, text = self.grammar_spec()
        try:
            if form == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    text, defaults={"whitespace_flexible": not self.disable_any_whitespace})
            else:
                grammar = llguidance.grammar_from(form, text)
        except ValueError as e:
            raise ValueError(f"SamplingParams.structured_outputs: {e}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            raise ValueError(f"SamplingParams.structured_outputs {form}: {error.strip()[:500]}")
        return grammar


# llguidance's index of a tokenizer, per process: (name_or_path, len, vocab, eos ids) -> LLTokenizer
_INDEXES: dict[tuple, object] = {}


class GrammarCompiler:
    """One engine's matchers. The tokenizer's byte strings are indexed once per process, on the first
    structured request (about 6 s at a 262K vocabulary, holding the GIL), not at start: engines that
    never see one never pay."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if t < vocab_size]

    def _index(self):
        import llguidance.hf

        n_vocab = max(self.vocab_size, len(self.tokenizer))   # the tokenizer may hold ids the model never draws
        key = (getattr(self.tokenizer, "name_or_path", None), len(self.tokenizer), n_vocab, tuple(self.eos_token_ids))
        if key[0] is None or key not in _INDEXES:
            try:
                _INDEXES[key] = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=n_vocab,
                                                             eos_token=self.eos_token_ids or None)
            except ValueError as e:
                raise ValueError(f"structured outputs need a fast (tokenizers) tokenizer: {e}") from None
        return _INDEXES[key]

    def matcher(self, spec: StructuredOutputs) -> GrammarMatcher:
        import llguidance

        grammar = spec.compile()
        index = self._index()
        m = llguidance.LLMatcher(index, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"SamplingParams.structured_outputs {spec.grammar_spec()[0]}: {m.get_error().strip()[:500]}")
        return GrammarMatcher(m, self.vocab_size, index.vocab_size)


_BITS = torch.arange(32, dtype=torch.int32)


class GrammarMatcher:
    """One request's matcher: it has consumed the request's output tokens."""

    def __init__(self, matcher, vocab_size: int, matcher_vocab_size: int):
        self._m, self.vocab_size = matcher, vocab_size
        self._words = torch.zeros((matcher_vocab_size + 31) // 32, dtype=torch.int32)

    def allowed(self, draft=()) -> torch.Tensor:
        """[V] bool: the tokens that may follow the output (and a tree node's `draft` path below the
        root). Never raises: a matcher in error, or a path it does not take, allows nothing, and the
        request fails when its next token is consumed (`advance`), not the step it shares."""
        m, draft = self._m, list(draft)
        pushed = m.try_consume_tokens(draft) if draft else 0
        if pushed == len(draft) and not m.is_error():
            m.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
            words = self._words
        else:
            words = torch.zeros_like(self._words)
        if pushed:
            m.rollback(pushed)
        return ((words[:, None] >> _BITS) & 1).flatten()[:self.vocab_size].bool()

    def advance(self, token: int) -> None:
        """Consume an output token; ValueError if the grammar does not allow it."""
        if not self._m.consume_token(token):
            why = (self._m.get_error().strip().splitlines() or ["no reason given"])[0][:300]
            raise ValueError(f"the structured output's grammar refused token {token}: {why}")

    @property
    def is_finished(self) -> bool:
        """The match is complete and nothing but EOS can follow (or EOS came)."""
        return self._m.is_stopped()
