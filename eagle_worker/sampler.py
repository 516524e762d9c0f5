"""Token sampling: greedy, temperature, top-k, top-p, min-p, with one generator per request.

Each request draws from its own `torch.Generator`, so a seeded request samples the same tokens
whatever else shares its batch. `target_probs` is also what lossless speculative acceptance
uses, so drafts are judged against exactly the distribution plain sampling draws from.
"""
from __future__ import annotations

import torch

from eagle_worker.sampling_params import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [..., V] after temperature, top-k, top-p and min-p (float32)."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    V = logits.shape[-1]
    if 0 < params.top_k < V:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > params.top_p   # keep the smallest set reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
    return probs / probs.sum(-1, keepdim=True)


def argmax_suffices(params: list[SamplingParams]) -> bool:
    """Every row is greedy without logprobs: the target's argmax is all the step needs."""
    return bool(params) and all(p.greedy and not p.logprobs for p in params)


def sample_from(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator]) -> tuple[list[int], list[float] | None]:
    """Sample one token per row of `logits` [B, V]; log-probs (raw model distribution) when asked."""
    greedy_ids = logits.argmax(-1).tolist()
    tokens = []
    for i, p in enumerate(params):
        if p.greedy:
            tokens.append(greedy_ids[i])
        else:
            tokens.append(sample_from(target_probs(logits[i], p), generators[i]))
    logprobs = None
    if any(p.logprobs for p in params):
        lp = torch.log_softmax(logits.float(), dim=-1)
        logprobs = lp.gather(-1, torch.tensor(tokens, device=logits.device)[:, None]).squeeze(-1).tolist()
    return tokens, logprobs
