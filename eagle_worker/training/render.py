"""Samples -> token ids the target sees, with where the response (the trained part) starts.

The prompt is rendered the way the head will meet it at serving time: the target's chat
template (`"chat"`), a plain frame such as `"Question: {prompt}\nAnswer:"` (what a base model
continues, and what our benchmark sends), or the raw prompt (`"{prompt}"`). The response is
tokenized on its own and appended, so the loss boundary is exact.
"""
from __future__ import annotations

from dataclasses import dataclass

from eagle_worker.training.data import Sample


@dataclass
class Example:
    ids: list[int]
    loss_start: int          # first response token; the loss covers predictions of ids[loss_start:]
    source: str


def prompt_ids(tokenizer, sample: Sample, prompt_format: str, chat_template: str | None) -> list[int]:
    if prompt_format == "chat":
        from eagle_worker.chat_template import render_chat
        text = render_chat(tokenizer, chat_template, [{"role": "user", "content": sample.prompt}], "target")
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt_format.format(prompt=sample.prompt.strip()))["input_ids"]


def response_ids(tokenizer, response: str, prompt_format: str) -> list[int]:
    sep = "" if prompt_format == "chat" or prompt_format.endswith(("\n", " ")) else " "
    return tokenizer(sep + response.strip(), add_special_tokens=False)["input_ids"]


def render(tokenizer, sample: Sample, prompt_format: str, chat_template: str | None,
           max_tokens: int, max_prompt_tokens: int | None = None) -> Example | None:
    """Token ids of prompt + response (truncated to `max_tokens`); None when nothing is left to train on."""
    p = prompt_ids(tokenizer, sample, prompt_format, chat_template)
    limit = max_prompt_tokens or max_tokens // 2
    if len(p) > limit:       # keep the prompt's end: it is what the response continues
        p = p[:1] + p[len(p) - limit + 1:]
    if sample.response is None:   # prompt-only text: train on all of it (the target's argmax labels)
        return Example(p[:max_tokens], 1, sample.source) if len(p) > 2 else None
    r = response_ids(tokenizer, sample.response, prompt_format)
    ids = (p + r)[:max_tokens]
    return Example(ids, len(p), sample.source) if len(ids) > len(p) + 1 else None
