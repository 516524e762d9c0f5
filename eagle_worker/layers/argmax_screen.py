"""Exact greedy argmax over a wide LM head, screened through an int8 copy first (CPU).

At batch 1 the LM head of a 262K-token vocabulary is half of a CPU decode step and memory-bound
(671 MB of fp32 read per token). An int8 copy with per-row scales is read in about half the time.
Its error has a rigorous bound, so every token whose screened logit could still be the maximum is
kept as a candidate (a dozen or so) and those rows are re-scored exactly in the model's own
dtype: the argmax is the exact logits' argmax (first index on ties), so greedy output is unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_int8_mm = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
_UNIT = 2.0 ** -8          # bfloat16 unit roundoff (8 significant bits)


class Int8ArgmaxScreen:
    """Built once from an LM-head weight [V, H]; `argmax(hidden [M, H], weight)` -> [M] token ids."""

    MAX_ROWS = 2           # the int8 kernel's time grows with rows; from 4 on a plain GEMM is as fast (measured)

    def __init__(self, weight: torch.Tensor):
        w = weight.detach().float()
        row_max = w.abs().amax(1)
        # bf16 scale rounded up, so |w / scale| <= 127 for every element
        scale = (row_max / 127 * (1 + 2 * _UNIT)).to(torch.bfloat16)
        scale = torch.where(row_max > 0, scale, torch.ones_like(scale))
        self.qweight = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        self.scale = scale
        self.row_max = row_max          # |w| per row; |w - scale*q| <= scale/2 <= row_max/254 (+ rounding up)
        self.source = weight

    @staticmethod
    def usable(weight: torch.Tensor, hidden: torch.Tensor) -> bool:
        rows = hidden.numel() // hidden.shape[-1]
        return (_int8_mm is not None and weight.device.type == "cpu" and hidden.device.type == "cpu"
                and weight.dtype in (torch.float32, torch.bfloat16) and 1 <= rows <= Int8ArgmaxScreen.MAX_ROWS
                and not torch.is_grad_enabled())

    def argmax(self, hidden: torch.Tensor, weight: torch.Tensor, post=None) -> torch.Tensor:
        """`post`: the model's monotone logit transform (softcapping), applied to the exact rows."""
        h = hidden.reshape(-1, hidden.shape[-1])
        hb = h.to(torch.bfloat16)
        approx = _int8_mm(hb, self.qweight, self.scale).float()                    # [M, V]
        # |exact - approx| <= bound per logit: bf16 rounding of h, int8 rounding of w, fp32
        # accumulation (slack), the kernel's bf16 output and the reference's own rounding.
        hbf = hb.float()
        l1 = hbf.abs().sum(1, keepdim=True)
        per_row_max = ((h.float() - hbf).abs().sum(1, keepdim=True)              # h rounded to bf16
                       + l1 * ((1 + 3 * _UNIT) / 254 * (1 + 1e-3))               # w rounded to int8
                       + l1 * 1e-4)                                              # fp32 accumulation
        bound = torch.addcmul(approx.abs() * (4 * _UNIT), per_row_max, self.row_max[None])   # + bf16 outputs
        floor = (approx - bound).amax(1, keepdim=True)
        cand = (approx + bound >= floor).any(0).nonzero().flatten()                 # union over rows
        exact = F.linear(h.to(weight.dtype), weight.index_select(0, cand))          # [M, C]
        if post is not None:
            exact = post(exact)
        return cand[exact.argmax(1)].view(hidden.shape[:-1])
