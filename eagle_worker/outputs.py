"""What the engine hands back per request and step (the vLLM `RequestOutput` shape, flattened)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]              # all generated so far
    text: str                         # all generated text so far
    new_token_ids: list[int]          # generated this step
    delta_text: str                   # text that became final this step
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None
    logprobs: list[float] | None = None
    error: str | None = None          # with finish_reason "error": why the engine failed this request
    metrics: dict = field(default_factory=dict)
