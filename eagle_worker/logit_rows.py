"""The LM head over one forward's logit rows, run for the rows a step asks about.

A 262K-token vocabulary makes the LM head about half of a CPU decode step, and full logits are
needed only for logprobs and for processed sampling (bias, penalties, top-k, top-p, min-p).
Greedy rows and temperature-only draws are decided by the head's screen without them
(layers/argmax_screen.py, `sampler.screened_draw`): the same tokens. Rows are computed when asked,
so the rows of a draft tree that acceptance never visits cost no LM head at all. Rows whose full
logits a step will need are computed up front in one pass (and under tensor parallelism all of
them, since the other ranks join the LM head's gather).
"""
from __future__ import annotations

import torch

from eagle_worker.outputs import TokenLogprob
from eagle_worker.sampler import SampleRow, draw_tokens, screenable, screened_draw, token_logprobs


class LogitRows:
    def __init__(self, model, hidden: torch.Tensor, full: list[int]):
        """`hidden`: the final-norm rows [R, H] whose next tokens a step may want; `full`: the rows
        whose full logits are computed now."""
        self.model, self.hidden = model, hidden
        self._where = {r: i for i, r in enumerate(full)}
        self._logits = model.compute_logits(hidden[full]) if full else None

    @torch.inference_mode()
    def logits(self, rows: list[int]) -> torch.Tensor:
        """Full logits [len(rows), V] of these rows."""
        if all(r in self._where for r in rows):
            at = [self._where[r] for r in rows]
            if at and at == list(range(at[0], at[0] + len(at))):     # a view: no copy of R x 262k floats a step
                return self._logits[at[0]:at[0] + len(at)]
            return self._logits[torch.tensor(at, device=self._logits.device)]
        return self.model.compute_logits(self.hidden[torch.tensor(rows, device=self.hidden.device)])

    @torch.inference_mode()
    def tokens(self, rows: list[int], draws: list[SampleRow]) -> list[int]:
        """The token of each row under its draw context, as `draw_tokens` gives it from full logits."""
        out: list[int | None] = [None] * len(rows)
        screened = [j for j, (r, d) in enumerate(zip(rows, draws)) if r not in self._where and screenable(d.params)]
        greedy = [j for j in screened if draws[j].params.greedy]
        sampled = [j for j in screened if not draws[j].params.greedy]
        if greedy:
            ids = self.model.greedy_tokens(self.hidden[torch.tensor([rows[j] for j in greedy], device=self.hidden.device)])
            for j, t in zip(greedy, ids.tolist()):
                out[j] = t
        if sampled:
            h = self.hidden[torch.tensor([rows[j] for j in sampled], device=self.hidden.device)]
            screen = self.model.screen_bounds(h)
            if screen is not None:
                approx, err = screen             # err: [M, V] or [M, 1]
                for k, j in enumerate(sampled):
                    out[j] = screened_draw(approx[k], err[k], lambda ids, k=k: self.model.logits_at(h[k:k + 1], ids)[0].float(),
                                           draws[j])
        rest = [j for j in range(len(rows)) if out[j] is None]
        if rest:
            for j, t in zip(rest, draw_tokens(self.logits([rows[j] for j in rest]), [draws[j] for j in rest])):
                out[j] = t
        return out

    def sample(self, rows: list[int], draws: list[SampleRow]) -> list[tuple[int, TokenLogprob | None]]:
        """(token, logprob entry or None) of each row."""
        tokens = self.tokens(rows, draws)
        tops = [d.params.logprobs for d in draws]
        want = [j for j, k in enumerate(tops) if k is not None]
        lps: list[TokenLogprob | None] = [None] * len(rows)
        if want:
            for j, lp in zip(want, token_logprobs(self.logits([rows[j] for j in want]), [tokens[j] for j in want],
                                                  [tops[j] for j in want])):
                lps[j] = lp
        return list(zip(tokens, lps))
