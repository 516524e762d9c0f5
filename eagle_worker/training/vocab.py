"""EAGLE-3 draft vocabulary: the most frequent response tokens, as published `d2t`/`t2d`.

Why reduced: one draft step through a 262k-row LM head costs most of a target forward on CPU;
a few thousand rows cover most of what the target actually says. Counted on the response tokens
of the training examples (what the head must predict; SpecForge counts the same), before any
target forward, so extraction can score only these rows (see `features.FeatureSpec.label_ids`).
"""
from __future__ import annotations

import torch

from eagle_worker.training.render import Example


def token_counts(examples: list[Example], vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for e in examples:
        r = torch.tensor(e.ids[e.loss_start:], dtype=torch.long)
        counts += torch.bincount(r, minlength=vocab_size)
    return counts


def draft_vocab(counts: torch.Tensor, size: int) -> torch.Tensor:
    """Ascending target ids of the `size` most frequent tokens (ties and unseen tokens: lowest id first)."""
    size = min(int(size), counts.numel())
    order = torch.argsort(-counts.double() + torch.arange(counts.numel()) * 1e-12, stable=True)
    return order[:size].sort().values


def coverage(counts: torch.Tensor, ids: torch.Tensor) -> float:
    """Share of counted tokens the vocabulary holds (an upper bound on first-step acceptance)."""
    total = int(counts.sum())
    return float(counts[ids].sum()) / total if total else 0.0


def d2t_t2d(ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = ids.long()
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(len(ids)), t2d
