"""What the engine hands back per request and step (the vLLM `RequestOutput` shape, flattened)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """A token's log-probability under the target's raw distribution (log_softmax of the logits
    before bias, penalties, temperature and filters), with the k most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)   # (token_id, logprob), most likely first


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
    logprobs: list[TokenLogprob] | None = None       # with SamplingParams.logprobs: aligned with token_ids
    new_logprobs: list[TokenLogprob] | None = None   # aligned with new_token_ids
    prompt_logprobs: list[TokenLogprob | None] | None = None   # aligned with prompt_token_ids (first None);
                                                               # in the first output only
    error: str | None = None          # with finish_reason "error": why the engine failed this request
    metrics: dict = field(default_factory=dict)
