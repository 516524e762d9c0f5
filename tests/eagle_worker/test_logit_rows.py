"""The LM head run only for the rows a step asks about: temperature-only draws screened like greedy
argmax give exactly the full draw's tokens, near-ties included, and need no full logits."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from eagle_worker import LLM, SamplingParams, SpecConfig
from eagle_worker.layers.argmax_screen import fast_int8_gemm, native_bf16
from eagle_worker.layers.embedding import ParallelLMHead
from eagle_worker.logit_rows import LogitRows
from eagle_worker.sampler import SampleRow, draw_tokens, filtered_logits, gumbel_of, gumbel_upper, keyed_bits

SCREENS = fast_int8_gemm() or native_bf16()     # a CPU where some screen serves a float32 head


class HeadOnly:
    """The four LM-head methods LogitRows uses, over one head (no softcapping)."""

    def __init__(self, head: ParallelLMHead):
        self.lm_head = head
        self.full_calls = 0

    def compute_logits(self, hidden):
        self.full_calls += 1
        return self.lm_head(hidden)

    def greedy_tokens(self, hidden):
        return self.lm_head.greedy(hidden)

    def screen_bounds(self, hidden):
        return self.lm_head.screen_bounds(hidden)

    def logits_at(self, hidden, ids):
        return self.lm_head.logits_at(hidden, ids)


def _head(V=20000, H=64, seed=0, dtype=torch.float32) -> tuple[HeadOnly, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    head = ParallelLMHead(V, H)
    head.weight.data.copy_(torch.randn(V, H, generator=g) * 0.08)
    head.to(dtype)
    hidden = (torch.randn(24, H, generator=g) * torch.linspace(0.5, 6, 24)[:, None]).to(dtype)
    return HeadOnly(head), hidden


def _near_tie(model: HeadOnly, h: torch.Tensor, row: SampleRow, eps: float) -> None:
    """Move the runner-up's weight so that it wins row `row`'s full draw by `eps` (in score units),
    far below what the screened logits resolve."""
    w = model.lm_head.weight.data
    T = row.params.temperature
    x = filtered_logits(torch.nn.functional.linear(h, w).float(), row.params)
    score = x + gumbel_of(keyed_bits(row.seed, row.position, w.shape[0]))
    top2 = score.topk(2).indices
    gap = float(score[top2[0]] - score[top2[1]])
    hf = h.float()
    w[top2[1]] = (w[top2[1]].float() + (gap + eps) * T * hf / hf.dot(hf)).to(w.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_screened_draws_are_the_full_draws_tokens(dtype, rows):
    model, hidden = _head(dtype=dtype)
    with torch.inference_mode():
        for T in (0.05, 0.7, 1.0, 3.0):
            draws = [SampleRow(SamplingParams(temperature=T), seed, 7 + i) for i, seed in enumerate(range(rows))]
            idx = list(range(rows))
            lazy = LogitRows(model, hidden[:rows], full=[])
            model.full_calls = 0
            got = lazy.tokens(idx, draws)
            used_screen = model.full_calls == 0
            want = draw_tokens(model.lm_head(hidden[:rows]), draws)
            assert got == want, T
            # the screen decides wherever one serves this head at this row count
            assert used_screen == (model.screen_bounds(hidden[:rows]) is not None)
    if dtype == torch.float32 and SCREENS:
        assert used_screen


@pytest.mark.parametrize("dtype,eps", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_near_ties_of_the_perturbed_scores_go_as_the_full_draw(dtype, eps):
    """Each row's runner-up is moved to win by eps: the screened logits alone (with the exact noise)
    cannot tell the two apart, the exactly rescored candidates do."""
    flips = 0
    for seed in range(6):
        model, hidden = _head(seed=seed, dtype=dtype)
        h = hidden[seed + 3]
        row = SampleRow(SamplingParams(temperature=[0.3, 1.0, 2.0][seed % 3]), seed, 11)
        _near_tie(model, h, row, eps)
        with torch.inference_mode():
            want = draw_tokens(model.lm_head(h[None]), [row])
            assert LogitRows(model, h[None], full=[]).tokens([0], [row]) == want
            screen = model.screen_bounds(h[None])
            if screen is not None:              # negative control: the screened logits' own draw
                approx = screen[0][0].double() / row.params.temperature
                flips += int((approx + gumbel_of(keyed_bits(row.seed, row.position, len(approx)))).argmax()) != want[0]
    if SCREENS and dtype == torch.float32:
        assert flips > 0


def test_gumbel_upper_bounds_the_noise_at_the_edges():
    top = (1 << 53) - 1
    bits = torch.tensor([0, 1, (1 << 29) - 1, 1 << 29, 12345678901234, top - (1 << 29), top - (1 << 29) + 1, top])
    bits = torch.cat([bits, torch.randint(0, top, (100000,), generator=torch.Generator().manual_seed(0))])
    upper, exact = gumbel_upper(bits), gumbel_of(bits)
    assert (upper.double() + 2.0 ** -15 >= exact).all()       # with screened_draw's slack
    assert torch.isinf(upper[-100001]) and torch.isinf(upper[-100002])   # the last 24-bit step: +inf
    assert torch.isfinite(upper[:6]).all()
    large = torch.isfinite(upper) & (exact > 1.0)                 # where a winner's noise lies: tight
    assert float((upper.double() - exact)[large].max()) < 0.05


def test_non_finite_rows_fall_back_to_the_full_draw():
    model, hidden = _head()
    bad = hidden[:2].clone()
    bad[1, 3] = float("nan")
    draws = [SampleRow(SamplingParams(temperature=1.0), 1, 0), SampleRow(SamplingParams(temperature=1.0), 1, 1)]
    with torch.inference_mode():
        assert LogitRows(model, bad, full=[]).tokens([0, 1], draws) == draw_tokens(model.lm_head(bad), draws)


def test_sampled_rows_need_full_logits_only_for_logprobs(copying_target, monkeypatch):
    """Through the engine, a head's trees included: temperature-1 rows never compute full logits
    where a screen serves; asking for logprobs does, and the tokens stay the same."""
    target, head = copying_target
    llm = LLM(model=str(target), spec=SpecConfig(draft=str(head), lookup=False, adaptive=False, depth=3, top_k=3,
                                                 num_draft_tokens=6), block_size=4, num_kv_blocks=256)
    calls = []                                  # full logits of verification rows, with the forward or asked
    init, logits = LogitRows.__init__, LogitRows.logits

    def spy_init(self, model, hidden, full):
        calls.append(len(full))
        init(self, model, hidden, full)

    def spy_logits(self, rows):
        calls.append(len(rows))
        return logits(self, rows)
    monkeypatch.setattr(LogitRows, "__init__", spy_init)
    monkeypatch.setattr(LogitRows, "logits", spy_logits)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    plain = llm.generate(["The quick brown fox", "Bonjour"], params)
    assert llm.engine.stats()["spec_steps"] > 0
    assert (sum(calls) == 0) == SCREENS
    calls.clear()
    with_lp = llm.generate(["The quick brown fox", "Bonjour"], replace(params, logprobs=2))
    assert sum(calls) >= 12
    assert [o.token_ids for o in with_lp] == [o.token_ids for o in plain]
