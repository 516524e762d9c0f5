"""A structured output's grammar at run time: llguidance's matcher per request, its mask per draw.

The tokenizer's byte strings are indexed once per process; a compiled spec is kept and copied for the
next request with it; a tree node's mask is computed on a copy of the request's matcher with the
node's path pushed (structured_output.py says what the masks do to the draws).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from eagle_worker.structured_output import StructuredOutputs

MAX_CACHED_GRAMMARS = 32        # per engine: compiled matchers kept for the next request with the same spec
# llguidance's index of a tokenizer loaded from a path or hub id, per process: (name_or_path, len,
# vocab, eos ids) -> LLTokenizer (a tokenizer built in memory has no name: its engine keeps its own)
_INDEXES: dict[tuple, object] = {}


class GrammarCompiler:
    """One engine's matchers. The tokenizer's byte strings are indexed once per process, on the first
    structured request (about 6 s at a 262K vocabulary, holding the GIL), not at start: engines that
    never see one never pay. A spec compiled once is kept (LRU) and copied for the next request with
    it (the `n` samples of one request, a job's rows sharing a schema)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if t < vocab_size]
        self._compiled: OrderedDict[tuple, object] = OrderedDict()
        self._own_index = None

    def _index(self):
        import llguidance.hf

        if self._own_index is not None:
            return self._own_index
        n_vocab = max(self.vocab_size, len(self.tokenizer))   # the tokenizer may hold ids the model never draws
        name = getattr(self.tokenizer, "name_or_path", None)
        key = (name, len(self.tokenizer), n_vocab, tuple(self.eos_token_ids))
        index = _INDEXES.get(key) if isinstance(name, str) and name else None
        if index is None:
            try:
                index = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=n_vocab, eos_token=self.eos_token_ids or None)
            except ValueError as e:
                raise ValueError(f"structured outputs need a fast (tokenizers) tokenizer: {e}") from None
            if isinstance(name, str) and name:
                _INDEXES[key] = index
        self._own_index = index
        return index

    def matcher(self, spec: StructuredOutputs, ignore_eos: bool = False) -> GrammarMatcher:
        """A matcher for a new request; ValueError (naming the field) if the grammar cannot run. Whatever
        llguidance raises becomes that ValueError: on the engine thread, anything else would end the replica."""
        try:
            return self._matcher(spec, ignore_eos)
        except ValueError:
            raise
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:      # noqa: BLE001 - pyo3's PanicException is a BaseException
            raise ValueError(f"SamplingParams.structured_outputs: the grammar could not be built "
                             f"({type(e).__name__}: {_first_line(str(e))})") from None

    def _matcher(self, spec: StructuredOutputs, ignore_eos: bool) -> GrammarMatcher:
        import llguidance

        index = self._index()
        key = (*spec.grammar_spec(), spec.disable_any_whitespace)
        fresh = self._compiled.get(key)
        if fresh is None:
            fresh = llguidance.LLMatcher(index, spec.compile(), log_level=0)
            words = torch.zeros((index.vocab_size + 31) // 32, dtype=torch.int32)
            if not fresh.is_error():        # the first mask: where left recursion or a $ref loop shows
                fresh.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
            if fresh.is_error() or not _unpack(words, self.vocab_size).any():    # ids the model has, not the tokenizer
                why = f"llguidance: {_first_line(fresh.get_error())}" if fresh.is_error() else "it allows no token"
                raise ValueError(f"SamplingParams.structured_outputs {key[0]}: the grammar cannot produce any output ({why})")
            self._compiled[key] = fresh
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        return GrammarMatcher(fresh.deep_copy(), self.vocab_size, index.vocab_size,
                              self.eos_token_ids if ignore_eos else ())


class GrammarMatcher:
    """One request's matcher: it has consumed the request's output tokens."""

    def __init__(self, matcher, vocab_size: int, matcher_vocab_size: int, no_eos=()):
        """`no_eos`: EOS ids kept out of the mask while anything else is allowed (ignore_eos: the
        output goes on where the grammar allows it to, and ends where only EOS could come)."""
        self._m, self.vocab_size, self.no_eos = matcher, vocab_size, list(no_eos)
        self._words = torch.zeros((matcher_vocab_size + 31) // 32, dtype=torch.int32)
        self.error: str | None = None      # why the matcher failed at the output's end

    def allowed(self, draft=()) -> torch.Tensor:
        """[V] bool: the tokens that may follow the output (and a tree node's `draft` path below the
        root, pushed on a copy: an error there stays there). Never raises: a matcher in error allows
        nothing, and the request fails when its next token is consumed (`advance`), not the step it shares."""
        draft = list(draft)
        m = self._m.deep_copy() if draft else self._m
        ok = (m.try_consume_tokens(draft) == len(draft)) if draft else True
        if ok and not m.is_error():
            m.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
        if not ok or m.is_error():
            if not draft and self.error is None:
                self.error = _first_line(m.get_error()) or "the grammar allows no token here"
            return torch.zeros(self.vocab_size, dtype=torch.bool)
        mask = _unpack(self._words, self.vocab_size)
        if self.no_eos and mask[self.no_eos].any():
            without = mask.clone()
            without[self.no_eos] = False
            if without.any():
                mask = without
        return mask

    def advance(self, token: int) -> None:
        """Consume an output token; ValueError if the grammar does not allow it or the matcher failed."""
        if self.error is None and not (self._m.consume_token(token) and not self._m.is_error()):
            self.error = _first_line(self._m.get_error()) or f"token {token} does not continue the match"
        if self.error is not None:
            raise ValueError(f"the structured output's grammar failed: {self.error}")

    @property
    def is_finished(self) -> bool:
        """The match is complete and nothing but EOS can follow (or EOS came)."""
        return self._m.is_stopped()


def _unpack(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab_size] bool of llguidance's bitmask: token i is bit i % 32 of int32 word i // 32 (on a
    little-endian machine, bit i % 8 of byte i // 8: numpy's little bit order)."""
    bits = np.unpackbits(words.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return torch.from_numpy(bits.view(np.bool_))


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:300]
