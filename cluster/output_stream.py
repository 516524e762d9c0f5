"""A request's way back from the engine thread to its `submit` generator: held, merged outputs.

When the consumer lags, consecutive outputs are merged (deltas concatenated) so a slow reader costs
one item, not one per step.
"""
from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class OutputStream:
    """One request's way back to its `submit` generator. The engine thread holds outputs back until
    one is due (`due`): the first at once (the prompt's ids, an early error), then one per
    `interval` new tokens (0: none until the last), and the last. Held outputs are merged as they
    come (each carries the whole output so far: a list of them would grow with the square of its
    length)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    interval: int = 1
    held: list = dataclasses.field(default_factory=list)   # engine thread only: at most one output
    held_tokens: int = 0
    sent: bool = False

    def due(self, out: Any) -> bool:
        self.held = [merge_outputs([*self.held, out])]
        self.held_tokens += len(getattr(out, "new_token_ids", None) or ())
        if (getattr(out, "finished", True) or not self.sent
                or (self.interval and self.held_tokens >= self.interval)):
            self.sent, self.held_tokens = True, 0
            return True
        return False


def put_all(deliveries: list[tuple[asyncio.Queue, list]]) -> None:
    for q, items in deliveries:
        for item in items:
            q.put_nowait(item)


def merge_outputs(outs: list) -> Any:
    """Collapse consecutive outputs of one request into one (deltas and their logprobs concatenated;
    the prompt's logprobs, sent with the first output only, kept)."""
    if len(outs) == 1 or not dataclasses.is_dataclass(outs[-1]):
        return outs[-1]
    extra = {}
    if hasattr(outs[-1], "new_logprobs"):
        new = [o.new_logprobs for o in outs]
        extra["new_logprobs"] = None if all(n is None for n in new) else [e for n in new for e in n or []]
    if hasattr(outs[-1], "prompt_logprobs"):
        extra["prompt_logprobs"] = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
    return dataclasses.replace(
        outs[-1],
        new_token_ids=[t for o in outs for t in o.new_token_ids],
        delta_text="".join(o.delta_text for o in outs),
        **extra,
    )
