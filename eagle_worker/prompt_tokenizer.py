"""The text side of a model without its weights: prompt tokenization, the chat template, token texts.

One code path for the engine (`LLMEngine.tokenize` / `apply_chat_template`) and the serving ingress,
which tokenizes and templates before a request reaches a replica, so a long prompt never costs the
engine thread (where every running request's next step waits) its tokenization time.
"""
from __future__ import annotations

from functools import lru_cache

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
