"""The text side of a model without its weights: prompt tokenization, the chat template, token texts.

One code path for the engine (`LLMEngine.tokenize` / `apply_chat_template`) and the serving ingress,
which tokenizes and templates before a request reaches a replica, so a long prompt never costs the
engine thread (where every running request's next step waits) its tokenization time.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path

from eagle_worker.chat_template import render_chat, resolve_chat_template

_TOKENIZER_FILES = (".json", ".model", ".jinja", ".txt")   # what a tokenizer loads besides the weights
_LOADED_KEEP = 4
_loaded: OrderedDict[tuple, object] = OrderedDict()
_loaded_lock = threading.Lock()


def load_tokenizer(path: str | Path):
    """A model folder's tokenizer, loaded once per process and shared.

    transformers 5 reads a 262K-vocabulary tokenizer.json in Python (5-11 s here), and one process
    may hold several engines (the Python API, benchmarks, tests) and an ingress. Keyed by the folder
    and its tokenizer files' size and mtime, so a rewritten folder loads afresh. Nothing here mutates
    a tokenizer; a caller that does (padding side, added tokens) must load its own copy with
    `AutoTokenizer.from_pretrained`.
    """
    from transformers import AutoTokenizer

    folder = Path(path).resolve()
    files = sorted(f for f in folder.iterdir() if f.suffix in _TOKENIZER_FILES and f.is_file())
    key = (str(folder), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    with _loaded_lock:   # one load at a time: two engines starting together parse it once
        tokenizer = _loaded.get(key)
        if tokenizer is None:
            tokenizer = _loaded[key] = AutoTokenizer.from_pretrained(folder)
            while len(_loaded) > _LOADED_KEEP:
                _loaded.popitem(last=False)
        _loaded.move_to_end(key)
        return tokenizer


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Prompt text -> token ids, with the tokenizer's BOS unless the text already starts with it
    (a chat template may hold BOS)."""
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

    def apply_chat_template(self, messages: list[dict]) -> str:
        return render_chat(self.tokenizer, self.chat_template, messages, self.model_name)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def _token_text(self, token_id: int) -> str:
        """One token as text, as vLLM reports it in logprobs (special tokens included)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def load_prompt_tokenizer(config) -> PromptTokenizer:
    """The engine module's entry point (eagle_worker/engine_api.py): the prompt side of the model an
    `EngineConfig` names, for callers that tokenize off the engine thread."""
    return PromptTokenizer.load(config.model, config.chat_template)
