"""Prompts made ready in the ingress: chat templating and tokenization happen here, in a worker
thread of the ingress, so a replica receives token ids and its engine thread (where every running
request's next step waits) never spends time on a long prompt.

A prompt is first measured in characters: one longer than the context could hold at the
tokenizer's longest piece per token is refused without tokenizing it. The exact check in tokens
(prompt + one generated token within the context) stays with the engine, the one place that knows
its context length for sure.
"""
from __future__ import annotations

import asyncio

from cluster.openai_errors import APIError, chars_context_error
from eagle_worker.engine_api import prompt_chars_limit

CONTEXT_BOUND = 32768  # tokens assumed for the character check until a replica reports max_model_len


class IngressPrompts:
    """The engine module's prompt tokenizer (engine_api `load_prompt_tokenizer`) behind async calls."""

    def __init__(self, prompts):
        self.prompts = prompts

    def token_text(self, token_id: int) -> str:
        return self.prompts.token_text(token_id)

    def token_bytes(self, token_id: int) -> list[int]:
        return self.prompts.token_bytes(token_id)

    @property
    def bos_token(self) -> str | None:
        return getattr(self.prompts, "bos_token", None)

    def _check_length(self, chars: int, max_model_len: int | None, param: str, truncating: bool) -> None:
        context = max_model_len or CONTEXT_BOUND
        limit = prompt_chars_limit(context, self.prompts.max_chars_per_token, truncating)
        if truncating and chars > limit:     # tokenized whole, then its last tokens kept: bounded all the same
            raise APIError(400, f"{param}: {chars} characters; a prompt cut by truncate_prompt_tokens may have at "
                                f"most {limit}", param=param)
        if chars > limit:
            raise APIError(400, chars_context_error(chars, limit, context, param), param=param,
                           code="context_length_exceeded")

    async def completion(self, prompt: str | list[int], max_model_len: int | None,
                         need_text: bool, truncating: bool = False) -> tuple[list[int], str]:
        """(token ids, prompt text); the text of a token-id prompt is decoded only if `need_text`."""
        if isinstance(prompt, list):
            if min(prompt) < 0:
                raise APIError(400, f"prompt: token ids must be >= 0, got {min(prompt)}", param="prompt")
            if max(prompt) >= 2 ** 31:   # beyond any vocabulary; a tokenizer's decode overflows on it
                raise APIError(400, f"prompt: token id {max(prompt)} is beyond any vocabulary", param="prompt")
            try:   # ids beyond the vocabulary are the engine's to refuse; decoding must not fail first
                text = await asyncio.to_thread(self.prompts.decode, prompt) if need_text else ""
            except Exception as e:
                raise APIError(400, f"prompt: cannot decode these token ids: {e}", param="prompt") from None
            return prompt, text
        self._check_length(len(prompt), max_model_len, "prompt", truncating)
        return await self._tokenize(prompt, "prompt"), prompt

    async def chat(self, messages: list[dict], max_model_len: int | None, truncating: bool = False) -> list[int]:
        self._check_length(sum(len(m["content"]) for m in messages), max_model_len, "messages", truncating)
        try:
            text = await asyncio.to_thread(self.prompts.apply_chat_template, messages)
        except Exception as e:  # no template, malformed messages, a template's raise_exception()
            raise APIError(400, f"messages: cannot apply the chat template: {e}", param="messages") from None
        self._check_length(len(text), max_model_len, "messages", truncating)
        return await self._tokenize(text, "messages")

    async def _tokenize(self, text: str, param: str) -> list[int]:
        """Token ids of `text`; text no tokenizer takes (a lone surrogate from a JSON escape) is a 400."""
        try:
            return await asyncio.to_thread(self.prompts.tokenize, text)
        except (UnicodeError, TypeError, ValueError) as e:
            raise APIError(400, f"{param}: cannot be tokenized: {e}", param=param) from None
