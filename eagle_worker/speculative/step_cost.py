"""What a decode step costs on this device, as a function of the rows it runs.

Verification rows all need logits (on Gemma 3 the 262k-vocab LM head is most of a row's cost),
so a step's seconds grow with its rows; a row its sequence samples (temperature > 0, logprobs,
penalties) costs more again: the keyed draw at each row acceptance visits (screened for a
temperature-only row, logit_rows.py) and, for logprobs or processed sampling, the full LM head
instead of the screen and the sampler's passes over the vocabulary; each
sequence adds its own attention and bookkeeping, however many rows its tree has, and one that
verifies a tree more (its tree mask, the acceptance walk, compacting its accepted KV); the head's
drafting adds its own rows and one pass per level; the prompt tokens of prefill chunks in the
same step cost the body without the LM head. The model is linear:

    seconds = fixed + per_seq * sequences + per_row * target_rows
              + per_head_row * head_rows + per_head_pass * head_passes + per_prefill_token * prefill_tokens
              + per_sampled_row * sampled_rows + per_tree * trees

fitted by least squares over the latest steps (prefill chunks and all: in a job with requests
arriving, most steps carry one, and a model fitted to pure-decode steps alone would not see the
rows it prices there), pulled towards a prior worth a few
steps so the first steps (and features that have not varied yet) have sane values. Every step
measures it, whatever it chose: no step is spent on exploring, and what an extra row costs at
batch 64 is learned from the rows of every batch size. The prior's shape is this CPU's (an extra
row costs ~1/30 of a batch-1 step), scaled by the first measured step; on a GPU the fit moves
the row costs towards 0 within a few dozen steps.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

FEATURES = ("fixed", "per_seq", "per_row", "per_head_row", "per_head_pass", "per_prefill_token", "per_sampled_row",
            "per_tree")
PRIOR_SHAPE = np.array([1.0, 1 / 32, 1 / 32, 1 / 32, 1 / 16, 1 / 256, 1 / 8, 1 / 32])   # relative to a plain batch-1 step


@dataclass(frozen=True)
class StepWork:
    """The sequences and rows one decode step ran."""

    sequences: int              # sequences in the step
    target_rows: int            # rows with logits: one per decode plus its draft nodes, one per finished prefill
    head_rows: int = 0          # rows through the head's forwards that produced logits
    head_passes: int = 0        # the head's forwards (catch-up and one per level; 0: it sat out)
    prefill_tokens: int = 0     # prompt tokens of prefill chunks (no logits)
    sampled_rows: int = 0       # of target_rows, those of sequences that sample (more than an argmax)
    trees: int = 0              # sequences that verified draft nodes

    def vector(self) -> np.ndarray:
        return np.array([1.0, self.sequences, self.target_rows, self.head_rows, self.head_passes,
                         self.prefill_tokens, self.sampled_rows, self.trees])


class StepCost:
    def __init__(self, window: int = 256, prior_weight: float = 4.0,
                 coefficients: tuple[float, ...] | None = None):
        """`coefficients` (FEATURES' order, missing ones 0) fix the model (tests, or a device
        measured before)."""
        self.window: deque[tuple[np.ndarray, float]] = deque()
        self.window_size = window
        self.xtx = np.zeros((len(FEATURES), len(FEATURES)))     # the window's sums: X'X and X'y
        self.xty = np.zeros(len(FEATURES))
        self.nonzero = np.zeros(len(FEATURES), dtype=int)         # steps in the window where each feature is not 0
        self.prior_weight = prior_weight
        self.fixed = coefficients is not None
        if coefficients is not None:
            coefficients = (*coefficients, *[0.0] * (len(FEATURES) - len(coefficients)))
        self._set(np.array(coefficients if coefficients is not None else PRIOR_SHAPE, dtype=float))
        self._prior: np.ndarray | None = self.theta.copy() if self.fixed else None
        self._warm = False

    def _set(self, theta: np.ndarray) -> None:
        self.theta = theta
        self._by_name = dict(zip(FEATURES, map(float, theta)))   # read per request and step: a dict, not an index

    @property
    def measured(self) -> bool:
        return self.fixed or self._prior is not None

    def seconds(self, work: StepWork) -> float:
        return float(self.theta @ work.vector())

    def coefficient(self, name: str) -> float:
        return self._by_name[name]

    def observe(self, work: StepWork, seconds: float) -> None:
        """One step. The first one runs cold (kernel choice, allocation) and is skipped."""
        if self.fixed or seconds <= 0:
            return
        if not self._warm:
            self._warm = True
            return
        x = work.vector()
        if self._prior is None:          # the prior's scale: this step as if it had run plain at batch 1
            self._prior = PRIOR_SHAPE * seconds / float(PRIOR_SHAPE @ x)
        self.window.append((x, seconds))
        self.xtx += np.outer(x, x)
        self.xty += x * seconds
        self.nonzero += x != 0
        if len(self.window) > self.window_size:
            old, old_s = self.window.popleft()
            self.xtx -= np.outer(old, old)
            self.xty -= old * old_s
            self.nonzero -= old != 0
            gone = self.nonzero == 0         # a feature the window no longer has: exactly 0, not a rounding residue
            self.xtx[gone, :] = self.xtx[:, gone] = self.xty[gone] = 0.0
        self._fit()

    def _fit(self) -> None:
        """Least squares over the window plus the prior worth `prior_weight` steps per feature
        (scaled by each feature's mean square), coefficients kept positive. The window's sums are
        kept as steps come and go, so a step's fit costs the same at any window size."""
        w = self.prior_weight * np.maximum(np.diag(self.xtx) / len(self.window), 1e-9)
        theta = np.linalg.solve(self.xtx + np.diag(w), self.xty + w * self._prior)
        self._set(np.maximum(theta, 1e-3 * self._prior))

    def snapshot(self) -> dict[str, float]:
        return {name: round(float(v), 6) for name, v in zip(FEATURES, self.theta)}
