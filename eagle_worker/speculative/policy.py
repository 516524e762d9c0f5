"""How many draft tokens to verify this step, from measured throughput at this batch size.

Speculation pays at small batches and loses at large ones (verification multiplies the tokens
the target processes). For each batch-size bucket the policy keeps moving averages of the tokens a
step produces and of its seconds (their ratio: throughput) for each budget it tried, always picks the
best, measures budgets from no speculation upwards and stops climbing as soon as a larger budget
is slower (so a losing, expensive tree is tried only once or twice), and re-checks a neighbour of
the best now and then, less often each time the best holds: the choice follows the real costs of
this machine, model and head, down to no speculation at all.
"""
from __future__ import annotations

from collections import defaultdict


def bucket(batch_size: int) -> int:
    return 1 << max(0, (batch_size - 1).bit_length())


class StepMeans:
    """Per key (batch bucket, choice): moving averages of a step's measurements, a plain mean over
    the first samples and then exponential. The first step of each key runs cold (kernel selection,
    allocation) and is not a measurement."""

    def __init__(self, ema: float):
        self.ema = ema
        self.samples: dict[tuple, int] = defaultdict(int)
        self.means: dict[tuple, tuple[float, ...]] = {}
        self._warm: set[tuple] = set()

    def observe(self, key: tuple, *values: float) -> None:
        if key not in self._warm:
            self._warm.add(key)
            return
        self.samples[key] += 1
        a = max(self.ema, 1.0 / self.samples[key])
        old = self.means.get(key, values)
        self.means[key] = tuple((1 - a) * o + a * v for o, v in zip(old, values))


class SpecPolicy:
    def __init__(self, num_draft_tokens: int, adaptive: bool = True, explore_every: int = 40, ema: float = 0.05,
                 min_samples: int = 3):
        self.full = num_draft_tokens
        self.adaptive = adaptive
        self.options = sorted({0, *(max(1, num_draft_tokens // d) for d in (8, 4, 2)), num_draft_tokens})
        self.explore_every = explore_every
        self.min_samples = min_samples            # measurements per budget before trusting the average
        self.steps = StepMeans(ema)               # (bucket, budget) -> (tokens, seconds) per step
        self.decisions: dict[int, int] = defaultdict(int)
        self.best: dict[int, int] = {}                 # per bucket: current best budget,
        self.interval: dict[int, int] = {}             # decisions between re-checks of a neighbour,
        self.next_check: dict[int, int] = {}           # and when the next one is due
        self.checks: dict[int, int] = defaultdict(int)

    def choose(self, batch_size: int) -> int:
        if not self.adaptive:
            return self.full
        b = bucket(batch_size)
        self.decisions[b] += 1
        measured = [n for n in self.options if self.steps.samples[(b, n)] >= self.min_samples]
        pending = [n for n in self.options if self.steps.samples[(b, n)] < self.min_samples]
        # climb from no speculation upwards while each larger budget is still faster: a budget
        # that loses at this batch size is never followed by a (more expensive) larger one
        climbing = len(measured) < 2 or self.rate(b, measured[-1]) >= self.rate(b, measured[-2])
        if pending and (not measured or (climbing and pending[0] > measured[-1])):
            return pending[0]
        best = max(measured, key=lambda n: self.rate(b, n))
        if best != self.best.get(b):              # the best moved: look around it again soon
            self.best[b], self.interval[b] = best, self.explore_every
            self.next_check[b] = self.decisions[b] + self.explore_every
        if self.decisions[b] >= self.next_check[b]:   # re-check a neighbour; each re-check that leaves
            self.checks[b] += 1                       # the best in place makes the next one twice as rare
            self.interval[b] = min(2 * self.interval[b], 16 * self.explore_every)
            self.next_check[b] = self.decisions[b] + self.interval[b]
            i = self.options.index(best)
            return self.options[i + 1] if i + 1 < len(self.options) and self.checks[b] % 2 else self.options[max(i - 1, 0)]
        return best

    def rate(self, b: int, budget: int) -> float:
        """Tokens per second: a ratio of moving averages, since a step's accepted tokens vary a lot."""
        tokens, seconds = self.steps.means[(b, budget)]
        return tokens / seconds

    def observe(self, batch_size: int, budget: int, tokens: int, seconds: float) -> None:
        """Record one pure-decode step: `tokens` produced by `batch_size` sequences in `seconds`."""
        if seconds > 0:
            self.steps.observe((bucket(batch_size), budget), tokens, seconds)

    def snapshot(self) -> dict:
        return {f"batch<={b}/draft={n}": round(self.rate(b, n), 2) for b, n in sorted(self.steps.means)}
