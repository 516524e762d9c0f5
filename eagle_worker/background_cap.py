"""How much offline work a step may carry while online requests share it.

Priority only orders admission and preemption: once an offline row runs, it is in every step, and
each row makes the step slower for the online requests beside it (on a CPU almost linearly; a job's
prefill chunks most of all). Measured on 2 cores before this cap: a job through the serving app
tripled online TPOT (100 -> 313 ms) while its own rows/s did not drop at all.

So while a priority-0 (online) request is running or waiting, offline (priority > 0) decodes and
prefill chunks join a step only while the modelled step time stays within (1 + slowdown) x that of
the online part alone. The model is the engine's measured `StepCost` over sequences, logit rows and
prefill tokens, fitted from every step, so the same setting gives a GPU (where a row costs almost
nothing) most of its batch and a CPU a few rows. One offline item always runs, so a job never
stalls under continuous online load; its prefill chunk is cut to what fits (at least one block).
Offline sequences left out keep their KV and run in the next step that has room.

A request arriving mid-step waits for that step to end. So for `ONLINE_GRACE_S` after the last
step with online work, offline steps stay within that step's limit too: without it, the moment a
closed-loop client's requests all finish, the engine runs a full offline step (16 rows and 1024
prompt tokens: 1-1.6 s on 2 cores) and the client's next requests wait for it (measured: 0.6-1.7 s
between the HTTP request and the engine seeing it).
"""
from __future__ import annotations

from eagle_worker.speculative.step_cost import StepCost, StepWork

ONLINE_GRACE_S = 2.0     # seconds after the last online step during which offline steps stay capped


def step_work(items: list[tuple[int, bool]]) -> StepWork:
    """The coarse shape of a step from its (tokens fed, samples a token) items: a sequence each,
    a logit row for each that samples, and the tokens of multi-token chunks as prefill."""
    return StepWork(sequences=len(items), target_rows=sum(1 for _, samples in items if samples),
                    prefill_tokens=sum(n for n, _ in items if n > 1))


class BackgroundCap:
    """One step's allowance for offline items, set once the online part is planned."""

    def __init__(self, cost: StepCost, slowdown: float, min_chunk: int, recent_limit_s: float | None = None):
        """`recent_limit_s`: no online work in this step, but some a moment ago: the limit then."""
        self.cost = cost
        self.recent_limit_s = recent_limit_s
        self.slowdown = slowdown
        self.min_chunk = min_chunk
        self.items: list[tuple[int, bool]] = []
        self.limit_s = 0.0
        self.admitted = 0          # offline items this step
        self.held = 0              # offline items left out or cut short this step

    def start(self, online_items: list[tuple[int, bool]]) -> None:
        self.items = list(online_items)
        if self.recent_limit_s is not None:
            self.limit_s = self.recent_limit_s
        else:
            self.limit_s = (1 + self.slowdown) * self.cost.seconds(step_work(self.items))

    def tokens(self, pending: int, budget: int, samples_at_end: bool) -> int:
        """Tokens an offline item with `pending` tokens may feed now (0: not this step). A decode
        (one token) runs or not; a prefill chunk is cut to fit. `samples_at_end`: whether feeding
        all of them samples a token."""
        want = min(pending, budget)
        if want <= 0:
            return 0
        n = want if self._fits(want, samples_at_end and want == pending) else self._largest_fit(want)
        if n == 0 and self.admitted == 0:     # progress: one offline item a step, however costly
            n = min(want, self.min_chunk)
        if n < want:
            self.held += 1
        return n

    def take(self, n: int, samples: bool) -> None:
        self.items.append((n, samples))
        self.admitted += 1

    def _fits(self, n: int, samples: bool) -> bool:
        return self.cost.seconds(step_work([*self.items, (n, samples)])) <= self.limit_s

    def _largest_fit(self, want: int) -> int:
        """The longest chunk shorter than `want` that fits (the model is linear in tokens); 0 if
        none. A cut chunk does not reach the prompt's end, so it samples nothing."""
        if want <= 1 or not self._fits(2, False):
            return 0
        lo, hi = 2, want - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self._fits(mid, False) else (lo, mid - 1)
        return lo
