"""Exact greedy argmax over a wide LM head, screened in int8 first (CPU).

The LM head of a 262K-token vocabulary is half of a CPU decode step and memory-bound (671 MB of
fp32 read per token); at 4-32 rows (batched decode, tree verification) the float GEMMs are slower
still. An int8 copy of the weight (per-row scales) is read in a quarter of the bytes and multiplied
by an exact integer GEMM against the hidden rows, split into two int8 levels (about 15 bits). The
error of the result has a rigorous bound, so every token whose screened logit could still be the
maximum is kept as a candidate (a dozen to a few hundred a row) and only those are scored exactly in the
model's own dtype: the argmax is the exact logits' argmax, and greedy output does not change.
"""
from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F

_int_mm = getattr(torch, "_int_mm", None)


class Int8ArgmaxScreen:
    """Built once from an LM-head weight [V, H]; `argmax(hidden [M, H], weight)` -> [M] token ids."""

    # the integer GEMM and its [rows, vocab] passes grow with rows until the float LM head is as fast:
    # stay below that. Measured on the 262K-vocab LM head with the model's own hidden rows (2-core
    # AVX512-BF16 EPYC): a float32 weight gains up to ~12 rows (the float32 GEMM is 4x slower); a bf16
    # weight only up to ~3, as its ties to bf16 rounding keep hundreds of candidates a row and a bf16
    # GEMM plus `max` takes 14-25 ms at 1-12 rows (the screen 14 ms at 1 row, 22-32 at 8).
    MAX_ROWS = {torch.float32: 12, torch.bfloat16: 3}

    def __init__(self, weight: torch.Tensor):
        w = weight.detach()
        qweight = torch.empty(w.shape, dtype=torch.int8, device=w.device)
        self.scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
        for rows in _chunks(w.shape[0]):        # a block at a time: no full-size float temporaries
            c = w[rows].float()
            row_max = c.abs().amax(1)
            scale = torch.where(row_max > 0, row_max / 127 * (1 + 1e-6), torch.ones_like(row_max))
            qweight[rows] = torch.round(c / scale[:, None]).clamp_(-127, 127).to(torch.int8)
            self.scale[rows] = scale
        # [H, V] view of a [V, H] int8 tensor: the layout the CPU integer GEMM reads fastest (measured)
        self.qweight_t = qweight.t()
        self.scale_max = float(self.scale.max())
        self.rounds_to_bf16 = weight.dtype == torch.bfloat16
        self.source = weight

    @staticmethod
    def serves(weight: torch.Tensor) -> bool:
        return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
                and fast_int8_gemm())

    @staticmethod
    def usable(weight: torch.Tensor, hidden: torch.Tensor) -> bool:
        rows = hidden.numel() // hidden.shape[-1]
        return (Int8ArgmaxScreen.serves(weight) and hidden.device.type == "cpu"
                and 1 <= rows <= Int8ArgmaxScreen.MAX_ROWS[weight.dtype] and not torch.is_grad_enabled())

    def screen(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Screened logits [M, V] (float32) of hidden rows [M, H], and their error bound: within
        half[r] * self.scale[v] of the exact float logit (half: [M, 1])."""
        h = hidden.reshape(-1, hidden.shape[-1]).float()
        M = h.shape[0]
        # h = a1*q1 + a2*q2 + e, per row, with q1, q2 int8 and |e| <= a2/2 (about 2^-15 of max|h|)
        a1 = h.abs().amax(1, keepdim=True).clamp_min(1e-30) / 127
        q1 = torch.round(h / a1)
        r = h - a1 * q1
        a2 = r.abs().amax(1, keepdim=True).clamp_min(1e-30) / 127
        q2 = torch.round(r / a2)
        e = r - a2 * q2
        dots = _int_mm(torch.cat([q1, q2]).to(torch.int8), self.qweight_t)    # exact, [2M, V] int32
        approx = dots[:M] * a1
        approx.add_(dots[M:] * a2).mul_(self.scale)                                   # screened logits
        # |exact - approx| <= half * scale per logit: int8 rounding of w (scale/2 per element,
        # against |a1*q1 + a2*q2| <= |h| + |e|), the residual e (times row_max <= 127*scale), and
        # float rounding here and in the reference GEMM (slack)
        l1, e1 = h.abs().sum(1, keepdim=True), e.abs().sum(1, keepdim=True)
        half = ((l1 + e1) / 254 * (1 + 1e-3) + e1 + 1e-4 * l1) * 127
        return approx, half

    def bounds(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Screened logits [M, V] and each one's error bound [M, V], the exact logits' rounding to
        the weight's dtype included (for a sampled draw, `sampler.screened_draw`)."""
        approx, half = self.screen(hidden)
        err = half * self.scale
        if self.rounds_to_bf16:
            err.add_((approx.abs() + err) * 2 ** -7)
        return approx, err

    def argmax(self, hidden: torch.Tensor, weight: torch.Tensor, post=None) -> torch.Tensor:
        """`post`: the model's monotone logit transform (softcapping), applied to the exact rows."""
        approx, half = self.screen(hidden)
        M = approx.shape[0]
        top, at = approx.max(1, keepdim=True)
        floor = top - half * self.scale[at]              # the best row's lower end: <= the exact maximum
        if self.rounds_to_bf16:                          # the reference rounds to bf16: values within 2^-8 may tie
            floor = floor - (top.abs() + half * self.scale[at]) * 2 ** -7
        # a row can win only if its upper end reaches the floor; scale_max keeps the test one pass
        cand = (approx >= floor - half * self.scale_max).any(0).nonzero().flatten()   # union over rows
        exact = F.linear(hidden.reshape(M, -1).to(weight.dtype), weight.index_select(0, cand))   # [M, C]
        if post is not None:
            exact = post(exact)
        return cand[exact.argmax(1)].view(hidden.shape[:-1])


class Bf16ArgmaxScreen:
    """Exact greedy argmax of a float32 LM head at more rows than the int8 screen serves, screened
    by a bfloat16 GEMM (about twice as fast as float32 on a CPU with bf16 dot products, at 8-64
    rows) and a rigorous error bound; the candidates are scored exactly in float32.

    With h = hb + eh (hb = bf16(h)) and w = wb + dw per vocabulary row (wb = bf16(w)):
    h.w = hb.wb + hb.dw + eh.w, so |h.w - screened| <= |hb| |dw_v| + |eh| |w_v| (Cauchy-Schwarz)
    + the float32 accumulation of hb.wb (gamma_K |hb| |wb_v|) + the GEMM's bf16 output rounding
    (2^-8 of the screened value), and the float32 reference differs from h.w by gamma_K |h| |w_v|.
    One bound per hidden row, from the largest row norms of the weight: a little looser than per
    logit, but the screen then reads its [rows, vocab] output three times (max, min, the candidate
    test) instead of building a bound of that size."""

    BLOCK_BYTES = 8 << 20

    def __init__(self, weight: torch.Tensor):
        w = weight.detach()
        k = w.shape[1]
        gamma = k * 2.0 ** -24 / (1 - k * 2.0 ** -24)
        self.weight_bf16 = torch.empty(w.shape, dtype=torch.bfloat16, device=w.device)
        max_dw = max_w = 0.0
        for rows in _chunks(w.shape[0]):        # a block at a time: no full-size float temporaries
            c = w[rows].float()
            cb = c.to(torch.bfloat16)
            self.weight_bf16[rows] = cb
            cbf = cb.float()
            # the largest |dw_v| + gamma |wb_v|: what rounding w to bf16 and summing in float32 can move a logit, per |hb|
            max_dw = max(max_dw, float(((c - cbf).norm(dim=1) + gamma * cbf.norm(dim=1)).max()))
            max_w = max(max_w, float(c.norm(dim=1).max()))
        self.max_dw, self.max_w = max_dw, max_w
        self.gamma = gamma
        self.source = weight

    @staticmethod
    def serves(weight: torch.Tensor) -> bool:
        return weight.dtype == torch.float32 and weight.device.type == "cpu" and native_bf16()

    @staticmethod
    def usable(weight: torch.Tensor, hidden: torch.Tensor) -> bool:
        return Bf16ArgmaxScreen.serves(weight) and hidden.device.type == "cpu" and not torch.is_grad_enabled()

    def _screen(self, hidden: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Screened logits of hidden rows [M, H] in vocabulary blocks ([M, V/n] bf16 each), each row's
        largest, and the bound [M, 1] within which every one is of the exact float32 logit."""
        h = hidden.reshape(-1, hidden.shape[-1]).float()
        hb = h.to(torch.bfloat16)
        n_h, n_hb = h.norm(dim=1, keepdim=True), hb.float().norm(dim=1, keepdim=True)
        n_eh = (h - hb.float()).norm(dim=1, keepdim=True)
        # the [rows, vocab] output in vocabulary blocks of at most BLOCK_BYTES: every temporary
        # stays below glibc's 32 MB mmap threshold (past it, each call maps and faults in fresh pages)
        n = max(1, -(-h.shape[0] * self.weight_bf16.shape[0] * 2 // self.BLOCK_BYTES))
        approx = [F.linear(hb, w) for w in self.weight_bf16.tensor_split(n)]          # [M, V/n] bf16 each
        top = torch.stack([a.amax(1) for a in approx], 1).amax(1, keepdim=True).float()
        low = torch.stack([a.amin(1) for a in approx], 1).amin(1, keepdim=True).float()
        big = torch.maximum(top.abs(), low.abs())                                    # max |screened| per row
        bound = ((n_hb * self.max_dw + (n_eh + self.gamma * n_h) * self.max_w + big * 2.0 ** -8)
                 * (1 + 1e-3) + 1e-6)
        return approx, top, bound

    def bounds(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Screened logits [M, V] (bfloat16, half a float32 copy's bytes) and their error bound
        [M, 1] (for a sampled draw, `sampler.screened_draw`)."""
        approx, _, bound = self._screen(hidden)
        return torch.cat(approx, 1), bound

    def argmax(self, hidden: torch.Tensor, weight: torch.Tensor, post=None) -> torch.Tensor:
        approx, top, bound = self._screen(hidden)
        # a logit can be the reference maximum only if its upper end reaches the best lower end;
        # compared in bf16 against the floor rounded down (a float32 threshold would promote the
        # output to a float32 temporary twice its size)
        floor = top - 2 * bound
        floor_bf16 = floor.to(torch.bfloat16)
        floor_bf16 = torch.where(floor_bf16.float() > floor, torch.nextafter(floor_bf16, torch.full_like(floor_bf16, -torch.inf)),
                                 floor_bf16)
        starts = [0, *itertools.accumulate(a.shape[1] for a in approx)]
        cand = torch.cat([(a >= floor_bf16).any(0).nonzero().flatten() + start     # union over rows
                          for a, start in zip(approx, starts)])
        exact = F.linear(hidden.reshape(-1, hidden.shape[-1]).float(), weight.index_select(0, cand))   # [M, C], float32
        if post is not None:
            exact = post(exact)
        return cand[exact.argmax(1)].view(hidden.shape[:-1])


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)`, the same ids (first of ties, NaN wins): CPU argmax over bfloat16 is about 3x
    slower than `max(-1)` (17 vs 5 ms for [32, 262K]), float64 too (0.33 vs 0.12 ms for [262K]),
    float32 the same."""
    return x.max(-1).indices


def _chunks(n: int, size: int = 16384):
    return (slice(i, min(i + size, n)) for i in range(0, n, size))


@functools.cache
def fast_int8_gemm() -> bool:
    """torch's CPU integer GEMM is fast where oneDNN has int8 dot products (AVX512-VNNI, AVX-VNNI,
    AMX); elsewhere it falls back to a plain loop, measured here on an AVX2-only EPYC at 1.2 s for the
    262K-row LM head at 8 rows against about 0.1 s in float32: a screen 10x slower than no screen.
    Measured once per process on a slice of that shape: the int8 product must be no slower than the
    float one (where it is fast it is 2-4x faster: a quarter of the bytes)."""
    if _int_mm is None:
        return False
    import time

    q, qw = torch.ones(16, 640, dtype=torch.int8), torch.ones(640, 8192, dtype=torch.int8)
    f, fw = q.float(), qw.float()

    def best(fn) -> float:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            if times[-1] > 0.05:   # a reference loop: no need to time it again
                break
        return min(times)

    with torch.inference_mode():
        best(lambda: _int_mm(q, qw))     # first calls: oneDNN primitive creation
        return best(lambda: _int_mm(q, qw)) <= best(lambda: f @ fw)


@functools.cache
def native_bf16() -> bool:
    """The CPU has bf16 dot products (AVX512-BF16 or AMX): without them oneDNN emulates bf16 GEMMs,
    which then lose their edge over float32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"}) and torch.backends.mkldnn.is_available()


def fast_bf16(device: torch.device) -> bool:
    """`device` has bf16 arithmetic: a CUDA GPU that supports it, or a CPU with bf16 dot products."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return device.type == "cpu" and native_bf16()
