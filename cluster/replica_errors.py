"""What a replica answers in place of outputs (`Rejected`, `Failed`) and the errors it raises.

Its own module because every caller of a replica (the ingress, the router's retries, jobs) tells
them apart without the replica's engine code.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# Fields an engine ValueError may name; used to fill the OpenAI error's `param`.
_PARAMS = ("structured_outputs", "truncate_prompt_tokens", "bad_words", "allowed_token_ids", "min_tokens", "max_tokens",
           "temperature", "top_p", "top_k", "min_p",
           "seed", "stop_token_ids", "stop", "prompt_logprobs", "logprobs", "ignore_eos", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "logit_bias", "messages", "prompt", "max_model_len")


@dataclass
class Rejected:
    """The engine refused the request (bad input); maps to HTTP 400."""

    message: str
    param: str | None = None
    code: str | None = None     # OpenAI's error code, where the engine's error carries one


@dataclass
class Failed:
    """The engine failed this request (a step that raised fails its own requests); maps to HTTP 500.
    Not a replica death, so never resubmitted elsewhere: it would fail there too."""

    message: str


class EngineDiedError(RuntimeError):
    """The replica's engine loop crashed; the request may be retried on another replica.
    `node_loss` (`preempted` / `node_lost`): a tensor-parallel rank went with a node the cluster took
    away (cluster/death_cause.py), which counts as no death of the requests; set by this code only."""

    def __init__(self, message: str = "", node_loss: str | None = None):
        if node_loss:      # (unpickled: the message has it already, node_loss comes back with the state)
            message += f" (a tensor-parallel rank's node was {'preempted' if node_loss == 'preempted' else 'taken away'})"
        super().__init__(message)
        self.node_loss = node_loss


class ReplicaStoppedError(EngineDiedError):
    """Serve stopped the replica (scale-down, a rolling update, its node drained) while the request ran,
    just before it would kill it: no request's doing, so callers count it as a free loss
    (cluster/death_cause.py). Raised only by the replica itself (cluster/replica_stop.py)."""


class ReplicaConfigError(ValueError):
    """The engine refused the replica's settings (a model or head that is not there or does not
    fit, a TP size the model cannot split into): a restart cannot fix it, so callers fail the
    deployment or job at once with this message instead of starting replicas again."""


def guess_param(message: str) -> str | None:
    """The request field an engine error message talks about, if any."""
    lead = re.match(r"\s*(?:SamplingParams\.)?(\w+)", message)
    if lead and lead.group(1) in _PARAMS:
        return "prompt" if lead.group(1) == "max_model_len" else lead.group(1)
    for name in _PARAMS:
        if re.search(rf"\b{name}\b", message):
            return "prompt" if name == "max_model_len" else name
    return None
