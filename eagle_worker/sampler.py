"""Token sampling as a pure function of (seed, output position, the target's processed distribution).

A seed is a text: the token at output position t of a request with seed s is the Gumbel-max draw
from the processed distribution at t with noise keyed by (s, t, token) (`keyed_uniforms`, a
counter-based hash: splitmix64). Nothing else is consumed, so the draw does not depend on the batch, on how many tokens a
step produced, on whether a draft tree (head, lookup, hybrid) or plain decoding reached t, on
preemption or on which replica runs it. Speculative acceptance (speculative/acceptance.py) asks
the same `draw_tokens` for each tree node it visits.

Processing order (vLLM's): logit_bias, repetition penalty (prompt + output), frequency and presence
penalties (output), allowed_token_ids, min_tokens and a structured output's grammar (the tokens
they exclude at that row: -inf), then temperature, top-k, top-p, min-p. Greedy is the argmax of the processed logits. Reported
logprobs are always the raw target distribution's (`token_logprobs`).
Whatever the input, a token is drawn: a distribution with no finite mass falls back to the argmax
of the processed logits (never NaN probabilities, never an exception from the draw).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eagle_worker.layers.argmax_screen import row_argmax
from eagle_worker.outputs import TokenLogprob
from eagle_worker.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15        # splitmix64's increment
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _splitmix64(x: int) -> int:
    """One splitmix64 output for state x (Steele, Lea & Flood 2014): a bijective 64-bit mixer."""
    x = (x + _GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * _M1) & _MASK64
    x = ((x ^ (x >> 27)) * _M2) & _MASK64
    return x ^ (x >> 31)


def draw_key(seed: int, position: int) -> int:
    """The 64-bit key of (seed, output position): splitmix64(splitmix64(seed) ^ position)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ position)


def keyed_uniform(seed: int, position: int, token: int) -> float:
    """Token `token`'s uniform in (0, 1) at (seed, position): the token-th output of a splitmix64
    stream started at draw_key(seed, position), top 53 bits, centred. The reference for
    `keyed_uniforms`, which computes a whole vocabulary of them at once."""
    return ((_splitmix64((draw_key(seed, position) + token * _GAMMA) & _MASK64) >> 11) + 0.5) * 2.0 ** -53


def _i64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_STRIDES: dict[tuple[int, str], torch.Tensor] = {}


def keyed_bits(seed: int, position: int, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[vocab] int64: the top 53 bits of every token's splitmix64 output at (seed, position), in
    int64 tensor arithmetic (multiplication wraps mod 2**64 on every backend torch supports; shifts
    are masked to be logical). In place on one scratch tensor: at a 262K vocabulary each new
    temporary is 2 MB, and allocating a dozen of them per row was most of a sampled row's cost."""
    key = (vocab, str(device))
    if key not in _STRIDES:
        _STRIDES[key] = torch.arange(vocab, dtype=torch.long, device=device) * _i64(_GAMMA)
    return _mixed_bits(_STRIDES[key] + _i64((draw_key(seed, position) + _GAMMA) & _MASK64))


def _mixed_bits(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output mix of states `x` (int64, overwritten), top 53 bits."""
    y = torch.empty_like(x)
    for shift, mult in ((30, _M1), (27, _M2)):
        torch.bitwise_right_shift(x, shift, out=y).bitwise_and_((1 << (64 - shift)) - 1)
        x.bitwise_xor_(y).mul_(_i64(mult))
    torch.bitwise_right_shift(x, 31, out=y).bitwise_and_((1 << 33) - 1)
    return x.bitwise_xor_(y).bitwise_right_shift_(11).bitwise_and_((1 << 53) - 1)


def keyed_uniforms(seed: int, position: int, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[vocab] float64: keyed_uniform(seed, position, i) for every token i."""
    return keyed_bits(seed, position, vocab, device).double().add_(0.5).mul_(2.0 ** -53)


def gumbel_of(bits: torch.Tensor) -> torch.Tensor:
    """Float64 Gumbel noise G = -log(-log u) of keyed bits (u = (bits + 0.5) / 2**53)."""
    return bits.double().add_(0.5).mul_(2.0 ** -53).log_().neg_().log_().neg_()


def gumbel_upper(bits: torch.Tensor) -> torch.Tensor:
    """Float32 upper bounds of gumbel_of(bits), cheaper: u is rounded up to 24 bits (G grows with u;
    the last step of u, up to 1, gives +inf) and the float32 logs' error is covered by the
    caller's slack."""
    u = bits.bitwise_right_shift(29).add_(1).float().mul_(2.0 ** -24)
    return u.log_().neg_().log_().neg_()


def keyed_gumbel_argmax(scores: torch.Tensor, seeds: list[int], positions: list[int]) -> torch.Tensor:
    """Row r's argmax of float64 `scores` [R, V] (log-weights; -inf: never) plus the Gumbel noise of
    (seeds[r], positions[r]); -1 for a row with NaN or +inf, or nothing finite."""
    V = scores.shape[-1]
    out = []
    for x, s, t in zip(scores, seeds, positions):
        score = gumbel_of(keyed_bits(s, t, V, x.device)).add_(x)
        out.append(torch.where(torch.isfinite(x.max()), row_argmax(score), -1))   # max: NaN if any
    return torch.stack(out) if out else torch.empty(0, dtype=torch.long, device=scores.device)


def keyed_choice(probs: torch.Tensor, seeds: list[int], positions: list[int]) -> torch.Tensor:
    """Row r's token drawn from `probs` [R, V] (non-negative weights) with the noise of
    (seeds[r], positions[r]): the Gumbel-max argmax of log p + G, G = -log(-log u) per token. A
    float32 wobble of the distribution (another batch shape, a tree row instead of a plain one)
    changes the token only if the top two perturbed scores are that close, unlike an inverse CDF,
    where every one of a 262k vocabulary's tiny tail intervals is a boundary to fall across.
    Rows without finite positive mass answer -1 (the caller falls back)."""
    mass = probs.sum(-1, dtype=torch.float64)        # NaN or inf anywhere makes it non-finite (weights >= 0)
    drawn = keyed_gumbel_argmax(probs.double().log(), seeds, positions)
    return torch.where(torch.isfinite(mass) & (mass > 0), drawn, -1)


@dataclass
class SampleRow:
    """What one logit row's token depends on besides the logits."""

    params: SamplingParams
    seed: int
    position: int                  # output index of the token this row yields (0 = first generated)
    prompt: Sequence[int] = ()     # prompt ids (repetition penalty)
    output: Sequence[int] = ()     # tokens before this row: the output so far (+ a tree node's ancestors)
    banned: Sequence[int] = ()     # token ids this row cannot yield (the stop tokens before min_tokens)
    allowed: torch.Tensor | None = None   # [V] bool: the tokens a structured output's grammar lets come next


def argmax_suffices(params: list[SamplingParams]) -> bool:
    """Every row is plain greedy without logprobs: the target's argmax is all the step needs."""
    return bool(params) and all(p.greedy and p.logprobs is None and not p.processes_logits for p in params)


def processed_logits(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """Raw logits [V] after logit_bias, the penalties, allowed_token_ids and the row's banned tokens
    (float32; the input is not modified)."""
    p, x = row.params, logits.float()
    if not p.processes_logits:
        return x
    x, dev = x.clone(), x.device
    if p.logit_bias:
        ids, biases = p.logit_bias_rows()
        x.index_add_(0, ids.to(dev), biases.to(device=dev, dtype=x.dtype))
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(list(row.prompt) + list(row.output), dtype=torch.long, device=dev).unique()
        v = x[seen]
        x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if p.uses_output_counts and len(row.output):
        ids, counts = torch.tensor(list(row.output), dtype=torch.long, device=dev).unique(return_counts=True)
        x.index_add_(0, ids, -(p.frequency_penalty * counts.to(x.dtype) + p.presence_penalty))
    if p.allowed_token_ids:
        keep = p.allowed_rows().to(dev)
        x = torch.full_like(x, float("-inf")).index_copy_(0, keep, x[keep])
    if row.banned:
        x[torch.tensor(list(row.banned), dtype=torch.long, device=dev)] = float("-inf")
    if row.allowed is not None:
        x.masked_fill_(~row.allowed.to(dev), float("-inf"))
    return x


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-weights [..., V] of the distribution a sampled row draws from (float64): the logits over
    the temperature, -inf where top-k, top-p or min-p drop a token. Always keeps the most likely
    token, so finite logits give a distribution with mass."""
    z = logits.double() / max(params.temperature, 1e-5)
    V = z.shape[-1]
    if 0 < params.top_k < V:
        kth = torch.topk(z, params.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if params.top_p < 1.0 or params.min_p > 0.0:
        probs = torch.softmax(z.float(), dim=-1)
        drop = torch.zeros_like(probs, dtype=torch.bool)
        if params.top_p < 1.0:
            sorted_p, idx = probs.sort(dim=-1, descending=True)
            drop.scatter_(-1, idx, sorted_p.cumsum(-1) - sorted_p >= params.top_p)   # keep the smallest set reaching top_p
        if params.min_p > 0.0:
            drop |= probs < params.min_p * probs.amax(-1, keepdim=True)
        z = z.masked_fill(drop, float("-inf"))
    return z


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [..., V] after temperature, top-k, top-p and min-p (float32)."""
    return torch.softmax(filtered_logits(logits, params), dim=-1).float()


def screenable(params: SamplingParams) -> bool:
    """A row whose token the LM head's screen can decide without full logits: no logprobs and no
    processing, and greedy or a temperature-only draw (`screened_draw`)."""
    return (params.logprobs is None and not params.processes_logits
            and (params.greedy or (params.top_k in (0, -1) and params.top_p == 1.0 and params.min_p == 0.0)))


def draw_tokens(logits: torch.Tensor, rows: list[SampleRow]) -> list[int]:
    """The token of each row of raw `logits` [R, V]: greedy rows the processed argmax, the others the
    keyed Gumbel-max draw from their filtered log-weights."""
    if all(r.params.greedy and not r.params.processes_logits for r in rows):
        return logits.argmax(-1).tolist()
    out = []
    for raw, row in zip(logits, rows):
        x = processed_logits(raw, row)
        if row.params.greedy:
            tok = int(torch.nan_to_num(x, nan=float("-inf")).argmax())
        else:
            tok = int(keyed_gumbel_argmax(filtered_logits(x, row.params)[None], [row.seed], [row.position])[0])
            if tok < 0:    # no finite mass (non-finite logits): the processed argmax still answers
                tok = int(torch.nan_to_num(x, nan=float("-inf")).argmax())
        out.append(tok)
    return out


def screened_draw(approx: torch.Tensor, err: torch.Tensor, exact, row: SampleRow) -> int | None:
    """`draw_tokens`' token for a temperature-only row, from screened logits: `approx` [V] (float32, bf16)
    within `err` ([V] or [1]) of the exact logits, and `exact(ids)`, the exact logits of those tokens.
    Every token's score has an upper bound (screened logit, its error and `gumbel_upper`, over the
    temperature); the exact score of the highest bound is a floor the winner reaches, so
    only tokens whose bound reaches it are scored exactly, in float64 as the full draw scores them:
    the same token, without the [V] logits, their float64 pass or a float64 noise per token.
    None when the screen cannot decide (non-finite logits): the caller draws from full logits."""
    T = max(row.params.temperature, 1e-5)
    top_abs = float(approx.abs().max())
    if not math.isfinite(top_abs):
        return None
    bits = keyed_bits(row.seed, row.position, approx.shape[-1], approx.device)
    upper = (approx + err).div_(T).add_(gumbel_upper(bits))
    # float32 rounding of the bound's terms (logits over T; noise bounds under 17 unless +inf)
    upper.add_((top_abs + float(err.max())) / T * 2.0 ** -20 + 2.0 ** -15)

    def scores(ids: torch.Tensor) -> torch.Tensor:
        return exact(ids).double().div_(T).add_(gumbel_of(bits[ids]))

    floor = scores(row_argmax(upper)[None])[0]
    cand = (upper >= floor).nonzero().flatten()
    best = scores(cand)
    if not torch.isfinite(best.max()):
        return None
    return int(cand[row_argmax(best)])


def token_logprobs(logits: torch.Tensor, tokens: list[int], tops: list[int | None]) -> list[TokenLogprob | None]:
    """Raw-distribution logprob of tokens[i] under logits[i] and its top tops[i] alternatives (None
    where tops[i] is None)."""
    want = [i for i, k in enumerate(tops) if k is not None]
    out: list[TokenLogprob | None] = [None] * len(tokens)
    if not want:
        return out
    idx = torch.tensor(want, device=logits.device)
    lp = torch.log_softmax(logits[idx].float(), dim=-1)
    chosen = lp.gather(-1, torch.tensor([tokens[i] for i in want], device=lp.device)[:, None]).squeeze(-1).tolist()
    k = max(tops[i] for i in want)
    top_v, top_i = (lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
    top_v, top_i = top_v.tolist(), top_i.tolist()
    for j, i in enumerate(want):
        out[i] = TokenLogprob(tokens[i], chosen[j], list(zip(top_i[j][:tops[i]], top_v[j][:tops[i]])))
    return out
