"""Per-request sampling parameters (the vLLM names), validated when built so bad input fails early."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# Temperatures below this sample like greedy decoding (vLLM's _SAMPLING_EPS): dividing logits by a
# subnormal temperature overflows to inf and the probabilities to NaN.
MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1          # -1 or 0: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False   # return the log-probability of each chosen token
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens > 0, "max_tokens",
             f"must be a positive integer, got {self.max_tokens!r}"),
            (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0,
             "temperature", f"must be a finite number >= 0, got {self.temperature!r}"),
            (0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}"),
            (isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1), "top_k",
             f"must be -1 (off) or >= 0, got {self.top_k!r}"),
            (0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}"),
            (self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} {why}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1
