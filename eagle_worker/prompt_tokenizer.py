"""The text side of a model without its weights: prompt tokenization, the chat template, token texts.

One code path for the engine (`LLMEngine.tokenize` / `apply_chat_template`) and the serving ingress,
which tokenizes and templates before a request reaches a replica, so a long prompt never costs the
engine thread (where every running request's next step waits) its tokenization time.
"""
from __future__ import annotations

import re
from functools import cache, lru_cache

from eagle_worker.chat_template import render_chat, resolve_chat_template
from eagle_worker.tokenizer_loader import load_tokenizer


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Prompt text -> token ids, with the tokenizer's BOS unless the text already starts with it
    (a chat template may hold BOS)."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:      # a lone surrogate ("\\ud800" in JSON): the tokenizer's TypeError names nothing
        raise ValueError(f"prompt is not valid Unicode text ({e.reason} at character {e.start})") from None
    bos = tokenizer.bos_token
    add_special = not (bos and prompt.startswith(bos))
    return tokenizer.encode(prompt, add_special_tokens=add_special)


class PromptTokenizer:
    """A model's tokenizer and chat template, as the engine uses them."""

    def __init__(self, tokenizer, chat_template: str | None, model_name: str):
        self.tokenizer, self.chat_template, self.model_name = tokenizer, chat_template, model_name
        # No token decodes to more characters than its vocabulary piece has (byte-level and
        # sentencepiece pieces map one character to one character or more), so a text longer than
        # n * this bound has more than n tokens: long prompts are refused before tokenizing.
        pieces = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.max_chars_per_token = max((len(p) for p in pieces), default=1) or 1
        self.token_text = lru_cache(maxsize=65536)(self._token_text)
        self.token_bytes = lru_cache(maxsize=65536)(self._token_bytes)
        self._byte_level = _byte_level(tokenizer)
        self._added = set(tokenizer.get_added_vocab()) if hasattr(tokenizer, "get_added_vocab") else set()   # as written

    @classmethod
    def load(cls, model: str, chat_template: str | None = None) -> "PromptTokenizer":
        """From a model name or folder as the engine resolves it (built-in names materialised once)."""
        from transformers import AutoConfig

        from eagle_worker.model_runner import resolve_model

        path = resolve_model(model)
        tokenizer = load_tokenizer(path)
        template = resolve_chat_template(tokenizer, AutoConfig.from_pretrained(path), chat_template)
        return cls(tokenizer, template, model)

    def tokenize(self, prompt: str) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    @property
    def bos_token(self) -> str | None:
        return getattr(self.tokenizer, "bos_token", None)

    def bad_word_token_ids(self, words: list[str]) -> list[tuple[int, ...]]:
        """The token sequences of `bad_words`, vLLM's rule: each word as it starts a text and, where a
        leading space makes it a different first token of as many tokens, as it follows a space."""
        seqs: list[tuple[int, ...]] = []
        for word in words:
            alone = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            seqs += [s for s in (alone, spaced) if s and s not in seqs
                     and (s is alone or (len(s) == len(alone) and s[0] != alone[0]))]
        return seqs

    def apply_chat_template(self, messages: list[dict]) -> str:
        return render_chat(self.tokenizer, self.chat_template, messages, self.model_name)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def _token_text(self, token_id: int) -> str:
        """One token as text, as vLLM reports it in logprobs (special tokens included)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _token_bytes(self, token_id: int) -> list[int]:
        """One token's own bytes (OpenAI's logprobs `bytes`): a byte-fallback piece (`<0xF0>`) or a
        byte-level BPE piece is part of a character, which its text alone shows as U+FFFD."""
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            m = _BYTE_PIECE.fullmatch(piece)
            if m:
                return [int(m.group(1), 16)]
            table = _byte_decoder()
            if self._byte_level and piece not in self._added and all(c in table for c in piece):
                return [table[c] for c in piece]
        return list(self.token_text(token_id).encode("utf-8", errors="replace"))


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")     # sentencepiece's byte fallback (Gemma, Llama 2)


def _byte_level(tokenizer) -> bool:
    """A byte-level BPE tokenizer (Llama 3, Qwen): each piece character stands for one byte."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return "ByteLevel(" in repr(decoder)       # alone or in a Sequence (the object's repr shows its parts)


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character of each byte, inverted (the table byte-level BPE uses)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def load_prompt_tokenizer(config) -> PromptTokenizer:
    """The engine module's entry point (eagle_worker/engine_api.py): the prompt side of the model an
    `EngineConfig` names, for callers that tokenize off the engine thread."""
    return PromptTokenizer.load(config.model, config.chat_template)
