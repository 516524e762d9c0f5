"""Structured outputs (vLLM's `structured_outputs`, OpenAI's `response_format`): the output must match
a JSON schema, a regex, one of given strings or a grammar.

The grammar is a mask on each draw, after the other processing (sampler.py): tokens that cannot
continue a match are -inf, and once the match is complete only EOS is left. llguidance's matcher
(an Earley parser over the tokenizer's byte strings, no per-vocabulary precompilation) gives the mask of
the tokens so far. Tree verification asks it at each node the acceptance walk visits, with the node's
path pushed on a copy, so speculation stays lossless: a draft token the grammar forbids is simply
never the target's token. Drafts themselves are not constrained (they may waste tree rows, never text).
A grammar that cannot run (left recursion without a base, a `$ref` loop, a parser limit at its first
token) is refused when the request is added; one that fails later fails its own request ("error").
This module is the request's spec (light: the ingress checks bodies with it); grammar.py runs it.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from eagle_worker.sampling_params import _short

MAX_CHOICES = 1024
# A schema, regex, grammar or choice list's text. Compiling takes about 1 s per 100 KB of a large
# grammar, on the thread that adds the request, so each request's is bounded.
MAX_GRAMMAR_CHARS = 64 * 1024


@dataclass
class StructuredOutputs:
    """Exactly one of: `json` (a JSON schema, as a dict or its JSON text), `regex`, `choice` (the output
    is one of these strings), `grammar` (Lark, or llama.cpp's GBNF), `json_object=True` (any JSON object).
    `disable_any_whitespace` (json, json_object): no whitespace between JSON tokens (vLLM's option; a
    small model left free to indent may spend its tokens on it)."""

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
                    schema = loads_strict(self.json)
                except ValueError as e:
                    raise bad(f"json is not valid JSON: {e}") from None
                except RecursionError:
                    raise bad("json is nested too deeply") from None
            else:
                schema = self.json
            if not isinstance(schema, dict):
                raise bad(f"json must be a JSON schema object, got {type(schema).__name__}")
        if self.disable_any_whitespace and given[0] not in ("json", "json_object"):
            raise bad(f"disable_any_whitespace applies to json and json_object, not {given[0]}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise bad(f"{name} must be a non-empty string, got {_short(v)}")
        if self.choice is not None:
            ok = isinstance(self.choice, (list, tuple)) and 0 < len(self.choice) <= MAX_CHOICES
            if not ok or not all(isinstance(c, str) and c for c in self.choice):
                raise bad(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings, got {_short(self.choice)}")
            self.choice = list(self.choice)
        try:
            text = self.grammar_spec()[1]
        except (ValueError, TypeError) as e:     # a dict schema json cannot write (a set, a non-finite number)
            raise bad(f"json is not JSON: {e}") from None
        except RecursionError:
            raise bad("json is nested too deeply") from None
        if len(text) > MAX_GRAMMAR_CHARS:
            raise bad(f"{given[0]} is longer than {MAX_GRAMMAR_CHARS} characters")

    def grammar_spec(self) -> tuple[str, str]:
        """(llguidance format, text) of what was asked."""
        if self.json is not None:
            return "json_schema", self.json if isinstance(self.json, str) else json.dumps(self.json, allow_nan=False)
        if self.json_object:
            return "json_schema", '{"type": "object"}'
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return "grammar", self.grammar

    def compile(self) -> str:
        """The llguidance grammar, or ValueError naming what is wrong with it (checked without a
        tokenizer: the ingress refuses a bad regex or schema before any replica sees it; one that
        compiles but cannot produce anything is the engine's refusal). Cached: the ingress checks every
        request, and many bring the same spec."""
        return _compile(*self.grammar_spec(), self.disable_any_whitespace)


@functools.lru_cache(maxsize=64)
def _compile(form: str, text: str, disable_any_whitespace: bool) -> str:
    import llguidance

    try:
        if form == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                text, defaults={"whitespace_flexible": not disable_any_whitespace})
        else:
            grammar = llguidance.grammar_from(form, text)
    except ValueError as e:
        raise ValueError(f"SamplingParams.structured_outputs: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"SamplingParams.structured_outputs {form}: {error.strip()[:500]}")
    return grammar


def loads_strict(text: str | bytes):
    """json.loads, refusing (ValueError) a key twice in one object: one value would be dropped unseen
    (a schema's second "type"). The one reading of request JSON: HTTP bodies, batch files, schema
    text. (NaN and Infinity parse; the request models refuse them per field.)"""
    return json.loads(text, object_pairs_hook=_object_once)


def _object_once(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice in one object")
        out[key] = value
    return out
