"""The argmax screens (int8, and bf16 for more rows) return exactly the full logits' argmax, near-ties
and exact ties included."""
from __future__ import annotations

import pytest
import torch

from eagle_worker.layers import argmax_screen
from eagle_worker.layers.argmax_screen import Bf16ArgmaxScreen, Int8ArgmaxScreen, fast_int8_gemm, native_bf16, row_argmax
from eagle_worker.layers.embedding import ParallelLMHead


def _near_tie_weight(V=4096, H=64, seed=0, eps=1e-5):
    """Random rows plus pairs of rows whose logits differ far below the int8 copy's error."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=g) * 0.05
    h = torch.randn(8, H, generator=g) * 3
    for i in range(8):
        best = int((h[i] @ w.T).argmax())
        twin = (best * 7 + 1000 + i) % V
        w[twin] = w[best] + eps * h[i] / h[i].norm()   # a hair above the best row, a different int8 row
    return w, h


@pytest.mark.parametrize("dtype,eps", [(torch.float32, 1e-5), (torch.bfloat16, 4e-3)])
def test_screen_equals_full_argmax_on_near_ties(dtype, eps):
    w, h = _near_tie_weight(eps=eps)
    w, h = w.to(dtype), h.to(dtype)
    screen = Int8ArgmaxScreen(w)
    for rows in (h[:1], h[1:3]):
        want = torch.nn.functional.linear(rows, w).argmax(-1)
        assert torch.equal(screen.argmax(rows, w), want)
    # negative control: the int8 logits alone pick the wrong row on some of these near-ties
    approx = (h.float() @ screen.qweight_t.float()) * screen.scale     # int8 weights, exact activations
    if dtype == torch.float32:
        assert not torch.equal(approx.argmax(-1), torch.nn.functional.linear(h, w).argmax(-1))


def test_exact_tie_keeps_the_first_index_and_softcap_applies():
    w, h = _near_tie_weight(seed=1)
    best = int((h[0] @ w.T).argmax())
    w[-1] = w[best]                                   # an exact copy at the last index
    screen = Int8ArgmaxScreen(w)
    assert int(screen.argmax(h[:1], w)) == best
    cap = lambda x: torch.tanh(x / 30.0) * 30.0       # noqa: E731  (Gemma 2 style softcapping)
    assert int(screen.argmax(h[:1], w, cap)) == int(cap(h[:1] @ w.T).argmax())


def test_lm_head_greedy_uses_the_screen_only_where_it_applies():
    w, h = _near_tie_weight()
    head = ParallelLMHead(*w.shape)
    head.weight.data.copy_(w)
    with torch.inference_mode():
        assert torch.equal(head.greedy(h[:1]), head(h[:1]).argmax(-1))
        assert (head._screen is not None) == fast_int8_gemm()          # only where the integer GEMM is fast
        assert torch.equal(head.greedy(h), head(h).argmax(-1))        # 8 rows
        many = torch.cat([h, h, h])
        assert torch.equal(head.greedy(many), head(many).argmax(-1))  # 24 rows: the bf16 screen
        assert (head._bf16_screen is not None) == native_bf16()      # only where the CPU has bf16 dot products


@pytest.mark.parametrize("block_bytes", [Bf16ArgmaxScreen.BLOCK_BYTES, 40_000])   # one vocabulary block; seven
def test_bf16_screen_equals_full_argmax_on_near_ties_and_ties(block_bytes, monkeypatch):
    monkeypatch.setattr(Bf16ArgmaxScreen, "BLOCK_BYTES", block_bytes)
    w, h = _near_tie_weight(seed=0, eps=1e-5)        # 8 rows, each with a twin a hair above its best
    h = torch.cat([h * (1 + k) for k in range(4)])   # 32 rows: past the int8 screen's 12
    w[-1] = w[int((h[0] @ w.T).argmax())]              # and an exact copy of row 0's best at the last index
    screen = Bf16ArgmaxScreen(w)
    want = torch.nn.functional.linear(h, w).argmax(-1)
    assert torch.equal(screen.argmax(h, w), want)
    cap = lambda x: torch.tanh(x / 30.0) * 30.0        # noqa: E731
    assert torch.equal(screen.argmax(h, w, cap), cap(torch.nn.functional.linear(h, w)).argmax(-1))
    # negative control: the bf16 logits alone pick the wrong row on some of these near-ties
    approx = torch.nn.functional.linear(h.bfloat16(), w.bfloat16()).float()
    assert not torch.equal(approx.argmax(-1), want)


def test_screens_built_block_by_block_equal_the_whole_tensor_formulas():
    w = torch.randn(40_000, 16, generator=torch.Generator().manual_seed(3)) * 0.05   # three blocks of rows
    w[123] = 0                                                                        # a zero row keeps scale 1
    screen = Int8ArgmaxScreen(w)
    row_max = w.abs().amax(1)
    scale = torch.where(row_max > 0, row_max / 127 * (1 + 1e-6), torch.ones_like(row_max))
    assert torch.equal(screen.scale, scale)
    assert torch.equal(screen.qweight_t.t(), torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
    if native_bf16():
        b = Bf16ArgmaxScreen(w)
        wb = w.to(torch.bfloat16)
        assert torch.equal(b.weight_bf16, wb)
        assert b.max_dw == pytest.approx(float(((w - wb.float()).norm(dim=1) + b.gamma * wb.float().norm(dim=1)).max()))
        assert b.max_w == pytest.approx(float(w.norm(dim=1).max()))


def test_prepare_greedy_builds_the_screens_once_at_load():
    head = ParallelLMHead(4096, 64)
    head.weight.data.copy_(_near_tie_weight()[0])
    head.prepare_greedy()
    int8, bf16 = head._screen, head._bf16_screen
    assert (int8 is not None) == fast_int8_gemm() and (bf16 is not None) == native_bf16()
    h = _near_tie_weight()[1]
    with torch.no_grad():
        assert torch.equal(head.greedy(h[:2]), torch.nn.functional.linear(h[:2], head.weight).argmax(-1))
        head.greedy(torch.cat([h, h]))                                  # 16 rows: the bf16 screen where it serves
    assert head._screen is int8 and head._bf16_screen is bf16          # used as built, not rebuilt


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_argmax_is_argmax_with_ties_and_nan(dtype):
    """row_argmax stands in for argmax on the LM head's logits: same id on exact ties (the first) and
    rows with a NaN (the NaN), at vocabulary widths that are not a multiple of a vector."""
    g = torch.Generator().manual_seed(3)
    for width in (3, 17, 4099, 262144):
        x = torch.randn(6, width, generator=g).to(dtype)
        top = x.max() + 1
        for r, cols in enumerate(([0], [width - 1], [width // 3, width - 1], [width // 2, width // 2 + 1])):
            x[r, cols] = top
        x[4, width // 5] = float("nan")
        assert torch.equal(row_argmax(x), x.argmax(-1)), width


@pytest.mark.parametrize("int_mm_seconds", [0.0, 0.06])
def test_the_int8_screen_serves_only_where_the_integer_gemm_is_fast(int_mm_seconds, monkeypatch):
    """A CPU without int8 dot products runs torch's integer GEMM as a plain loop (1.2 s for Gemma 3's
    LM head on an AVX2-only EPYC): there the screen is never built and greedy stays exact in float."""
    import time

    real = argmax_screen._int_mm

    def timed(a, b):
        t0 = time.perf_counter()
        out = real(a, b)
        time.sleep(max(0.0, int_mm_seconds - (time.perf_counter() - t0)))
        return out
    monkeypatch.setattr(argmax_screen, "_int_mm", timed if int_mm_seconds else lambda a, b: torch.empty(0))
    fast_int8_gemm.cache_clear()
    try:
        assert fast_int8_gemm() == (int_mm_seconds == 0)
        w, h = _near_tie_weight()
        head = ParallelLMHead(*w.shape)
        head.weight.data.copy_(w)
        head.prepare_greedy()
        assert (head._screen is not None) == (int_mm_seconds == 0)
        if int_mm_seconds:
            with torch.inference_mode():
                assert torch.equal(head.greedy(h), head(h).argmax(-1))
    finally:
        fast_int8_gemm.cache_clear()


def test_the_int8_screen_serves_only_the_row_counts_where_it_is_faster():
    """A bfloat16 LM head is screened for 1-3 rows only (from 4 rows its own GEMM plus `max` is as
    fast), a float32 one up to 12 (measured: see Int8ArgmaxScreen.MAX_ROWS)."""
    for dtype, most in ((torch.bfloat16, 3), (torch.float32, 12)):
        w = torch.zeros(64, 16, dtype=dtype)
        served = Int8ArgmaxScreen.serves(w)      # False where the CPU has no fast int8 GEMM
        with torch.inference_mode():
            assert [Int8ArgmaxScreen.usable(w, torch.zeros(m, 16, dtype=dtype)) for m in (0, 1, most, most + 1)] == \
                [False, served, served, False]
