"""The sampler alone: the keyed uniform, inverse-CDF draws, vLLM's logits processing, raw logprobs,
and that no accepted input makes NaN probabilities or fails to draw a token."""
from __future__ import annotations

import math

import pytest
import torch

from eagle_worker import sampler
from eagle_worker.sampler import (
    SampleRow,
    draw_tokens,
    filtered_probs,
    keyed_choice,
    keyed_uniform,
    keyed_uniforms,
    processed_logits,
)
from eagle_worker.sampling_params import SamplingParams


def row(position: int = 0, seed: int = 0, output=(), prompt=(), **params) -> SampleRow:
    return SampleRow(SamplingParams(**params), seed, position, prompt, output)


KEYS = ((0, 0, 0), (42, 0, 0), (42, 1, 5), (2**63 - 1, 10**6, 262143))


def test_keyed_uniforms_are_pinned_and_uniform():
    # pinned: a seed must give the same text across versions, machines and devices
    pinned = [0.13870941014555432, 0.38697427624004094, 0.723204360261194, 0.47025466851271586]
    assert [keyed_uniform(*k) for k in KEYS] == pinned == _reference(KEYS)
    us = keyed_uniforms(7, 3, 40000)
    assert torch.equal(us[:500], torch.tensor([keyed_uniform(7, 3, i) for i in range(500)], dtype=torch.float64))
    assert (us > 0).all() and (us < 1).all()
    assert abs(float(us.mean()) - 0.5) < 0.01
    hist = torch.histc(us.float(), bins=10, min=0, max=1)
    assert (hist - 4000).abs().max() < 300                       # ~4.8 sigma
    by_seed = torch.stack([keyed_uniforms(s, 0, 4) for s in range(4000)])   # neighbouring seeds and tokens
    assert abs(float(torch.corrcoef(torch.stack([by_seed[:-1, 0], by_seed[1:, 0]]))[0, 1])) < 0.06
    assert abs(float(torch.corrcoef(by_seed.T[:2])[0, 1])) < 0.06
    assert keyed_uniform(1, 2, 3) != keyed_uniform(1, 3, 3) != keyed_uniform(2, 2, 3)


def _reference(keys) -> list[float]:
    """splitmix64 written out independently (the published constants): token i's uniform is the
    i-th output of the stream seeded with splitmix64(splitmix64(seed) ^ position)."""
    m = (1 << 64) - 1

    def mix(x):
        x = (x + 0x9E3779B97F4A7C15) & m
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
        return x ^ (x >> 31)
    return [((mix((mix(mix(s) ^ t) + i * 0x9E3779B97F4A7C15) & m) >> 11) + 0.5) / 2**53 for s, t, i in keys]


def test_keyed_choice_never_draws_a_zero_probability_token():
    p = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]])
    assert {int(keyed_choice(p, [s], [0])[0]) for s in range(200)} == {1, 3}
    assert int(keyed_choice(torch.zeros(1, 4), [0], [0])[0]) == -1
    assert int(keyed_choice(torch.full((1, 4), float("nan")), [0], [0])[0]) == -1


def test_keyed_choice_is_the_gumbel_max_of_the_keyed_uniforms():
    """The in-place vocabulary-wide draw is, token for token, argmax log p + G with G from the
    scalar reference uniform: rows with zeros, peaked and flat rows, an inf and a NaN row (-1)."""
    g = torch.Generator().manual_seed(1)
    V = 301
    probs = torch.softmax(torch.randn(8, V, generator=g) * torch.tensor([0.1, 1, 3, 8, 1, 1, 1, 1])[:, None], -1)
    probs[4, ::2] = 0.0
    probs[6, 7], probs[7, 9] = float("inf"), float("nan")
    seeds, positions = [3, 2**63 - 1, 0, 9, 11, 12, 13, 14], [0, 5, 10**6, 2, 3, 4, 5, 6]
    expected = []
    for p, s, t in zip(probs.tolist(), seeds, positions):
        if not all(math.isfinite(x) for x in p):
            expected.append(-1)
            continue
        score = [math.log(x) - math.log(-math.log(keyed_uniform(s, t, i))) if x > 0 else -math.inf
                 for i, x in enumerate(p)]
        expected.append(max(range(V), key=score.__getitem__))
    assert keyed_choice(probs, seeds, positions).tolist() == expected


def test_keyed_choice_shrugs_off_float32_wobble_in_a_long_tail():
    """A 262k vocabulary with a fifth of the mass in its tail, logits moved by 1e-5 (what another
    batch shape does in float32): an inverse CDF changes 7 of these 200 draws (every tail token's
    tiny interval is a boundary to fall across); the Gumbel-max draw flips only on near-ties of the
    perturbed top two."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(262144, generator=g) * 2
    logits[:20] += 12.0
    wobble = logits + 1e-5 * torch.randn(262144, generator=g)
    p, q = torch.softmax(logits, -1)[None], torch.softmax(wobble, -1)[None]
    same = sum(int(keyed_choice(p, [s], [0])[0]) == int(keyed_choice(q, [s], [0])[0]) for s in range(200))
    assert same >= 199


def test_keyed_draws_follow_the_filtered_distribution():
    logits = torch.randn(12, generator=torch.Generator().manual_seed(0)) * 2
    params = dict(temperature=0.8, top_k=6, top_p=0.9)
    probs = filtered_probs(logits, SamplingParams(**params))
    n = 6000
    toks = torch.tensor([draw_tokens(logits[None], [row(position=3, seed=s, **params)])[0] for s in range(n)])
    counts = torch.bincount(toks, minlength=12).double()
    assert (counts[probs == 0] == 0).all()
    exp = probs.double() * n
    keep = exp > 0
    stat = float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))
    assert p > 1e-3


def test_logit_bias_and_penalties_follow_vllm():
    x = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    out = processed_logits(x, row(output=[3, 3, 2], prompt=[1], logit_bias={0: 1.5, 4: -2.0},
                                  repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25))
    # bias, then repetition over prompt+output ({1, 2, 3}), then frequency/presence over the output
    expected = torch.tensor([3.5, -2.0, 0.25 - 0.5 - 0.25, 1.5 - 1.0 - 0.25, -2.0])
    torch.testing.assert_close(out, expected)
    assert torch.equal(x, torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0]))             # input untouched
    assert processed_logits(x, row()) is not None and torch.equal(processed_logits(x, row()), x)


def test_the_per_token_lookups_follow_the_params_they_were_built_from():
    """stop ids as a set and logit_bias as tensors are built once per request, not per token/step;
    a copy with other values (the engine's validated copy) gets its own."""
    import dataclasses

    p = SamplingParams(stop_token_ids=[5, 3, 5, 3], logit_bias={"2": 1.0, 0: -1.0})
    assert p.stop_token_ids == [5, 3] and p.stop_id_set == {3, 5}
    ids, biases = p.logit_bias_rows()
    assert p.logit_bias_rows() is p.logit_bias_rows() and ids.tolist() == [2, 0] and biases.tolist() == [1.0, -1.0]
    q = dataclasses.replace(p, stop_token_ids=[7], logit_bias={1: 4.0})
    assert q.stop_id_set == {7} and q.logit_bias_rows()[0].tolist() == [1]
    x = torch.zeros(4)
    assert processed_logits(x, row(logit_bias={1: 4.0})).tolist() == [0.0, 4.0, 0.0, 0.0]
    assert SamplingParams().stop_id_set == frozenset() and SamplingParams().logit_bias_rows() is None


def test_greedy_is_the_argmax_of_the_processed_logits():
    x = torch.tensor([[5.0, 4.0, 1.0]])
    assert draw_tokens(x, [row(temperature=0.0)]) == [0]
    assert draw_tokens(x, [row(temperature=0.0, logit_bias={0: -100})]) == [1]
    assert draw_tokens(x, [row(temperature=0.0, output=[0, 0, 0], frequency_penalty=2.0)]) == [1]
    assert draw_tokens(x, [row(temperature=0.0, logit_bias={2: 100})]) == [2]


def test_logprobs_are_the_raw_distribution_with_top_alternatives():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    out = sampler.token_logprobs(logits, [0, 2], [2, None])
    lp = torch.log_softmax(logits, -1)
    assert out[1] is None
    assert out[0].token_id == 0 and math.isclose(out[0].logprob, float(lp[0, 0]), rel_tol=1e-6)
    assert [t for t, _ in out[0].top] == [1, 2] and out[0].top[0][1] >= out[0].top[1][1]
    assert sampler.token_logprobs(logits, [1, 2], [0, 0])[0].top == []


EXTREME = [
    dict(temperature=1e-5),                                      # the smallest sampled temperature
    dict(temperature=1.0, top_p=1e-9),
    dict(temperature=1.0, min_p=1.0),
    dict(temperature=3.0, top_k=1),
    dict(temperature=1.0, logit_bias={i: -100.0 for i in range(64)}),   # every top token pushed down
    dict(temperature=1.0, logit_bias={5: 100.0, 6: 100.0}),
    dict(temperature=1.0, presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=2.0),
    dict(temperature=1.0, presence_penalty=-2.0, frequency_penalty=-2.0, repetition_penalty=1e-6),
    dict(temperature=1e-5, top_p=1e-9, min_p=1.0, top_k=2, logit_bias={0: -100.0}, frequency_penalty=2.0,
         repetition_penalty=2.0),
    dict(temperature=1e6),
]


@pytest.mark.parametrize("params", EXTREME)
@pytest.mark.parametrize("kind", ["normal", "huge", "flat", "nonfinite"])
def test_no_accepted_input_makes_nan_or_fails_to_draw(params, kind):
    V = 64
    g = torch.Generator().manual_seed(1)
    logits = {"normal": torch.randn(2, V, generator=g) * 5, "huge": torch.randn(2, V, generator=g) * 3e4,
              "flat": torch.zeros(2, V)}.get(kind)
    if kind == "nonfinite":
        logits = torch.randn(2, V, generator=g)
        logits[0, 3], logits[1, :] = float("nan"), float("inf")
    rows = [row(position=t, seed=99, output=list(range(V)) * 2, prompt=[1, 2], **params) for t in range(2)]
    toks = draw_tokens(logits, rows)
    assert all(0 <= t < V for t in toks)
    if kind != "nonfinite":
        x = processed_logits(logits[0], rows[0])
        assert torch.isfinite(x).all()
        if not rows[0].params.greedy:
            probs = filtered_probs(x, rows[0].params)
            assert torch.isfinite(probs).all() and float(probs.sum()) == pytest.approx(1.0, abs=1e-4)


def test_top_p_keeps_the_smallest_set_whose_mass_reaches_it():
    """vLLM's and HF's rule: a token goes when the mass before it already reaches top_p, so with
    probabilities [0.5, 0.25, 0.25] and top_p 0.5 only the first is kept (not the first two)."""
    from eagle_worker.sampler import filtered_logits

    logits = torch.tensor([math.log(0.5), math.log(0.25), math.log(0.125), math.log(0.125)])
    kept = lambda p: torch.isfinite(filtered_logits(logits, SamplingParams(top_p=p))).nonzero().flatten().tolist()  # noqa: E731
    assert kept(0.5) == [0] and kept(0.6) == [0, 1] and kept(0.75) == [0, 1] and len(kept(0.76)) == 3
