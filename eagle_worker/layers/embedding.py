"""Vocab-parallel input embedding and LM head.

Each rank owns a contiguous slice of ceil(V / tp) vocabulary rows (the last one padded). The
embedding zeroes rows it does not own and all-reduces; the head computes local logits and
all-gathers them along the vocab dimension, then drops the padding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eagle_worker.layers.argmax_screen import Bf16ArgmaxScreen, Int8ArgmaxScreen, row_argmax
from eagle_worker.layers.linear import check_shape, linear
from eagle_worker.parallel import all_gather_last_dim, all_reduce, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.shard_size = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, num_embeddings)
        if self.vocab_end <= self.vocab_start:   # a toy vocabulary: the last ranks would hold no token
            raise ValueError(f"a vocabulary of {num_embeddings} tokens cannot be split over {self.tp_size} ranks "
                             f"(shards of {self.shard_size} leave rank {self.tp_rank} none)")
        # Loaded (or initialised) before use: only the last shard's padding rows need a value. Not
        # zeros: writing a 262K-row table costs an engine's start about 1 s a copy on a CPU.
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.data[self.vocab_end - self.vocab_start:].zero_()
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        check_shape(loaded_weight, (self.num_embeddings, self.embedding_dim))
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(loaded_weight.narrow(0, self.vocab_start, n))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mask, input_ids - self.vocab_start, 0)
        y = F.embedding(local, self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> full-vocab logits. `tie_to(embedding)` shares the embedding's weight."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self._screen: Int8ArgmaxScreen | None = None
        self._bf16_screen: Bf16ArgmaxScreen | None = None   # more rows than the int8 screen serves

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits
        return all_gather_last_dim(logits)[..., : self.num_embeddings]

    def greedy(self, hidden: torch.Tensor, post=None) -> torch.Tensor:
        """argmax of `post(self(hidden))` per row, exactly; on CPU through the int8 screen (no
        full-vocabulary logits)."""
        if self.tp_size == 1 and Int8ArgmaxScreen.usable(self.weight, hidden):
            return self._int8().argmax(hidden, self.weight, post)
        if self.tp_size == 1 and len(hidden) and Bf16ArgmaxScreen.usable(self.weight, hidden):
            return self._bf16().argmax(hidden, self.weight, post)
        if self.tp_size > 1 and len(hidden):
            return self._sharded_argmax(hidden, post)
        logits = self(hidden)
        return row_argmax(post(logits) if post is not None else logits)

    def screen_bounds(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Screened logits of `hidden` rows and their error bounds (see `Int8ArgmaxScreen.bounds`),
        where a screen serves this head and that many rows; None where only full logits do."""
        if self.tp_size == 1 and Int8ArgmaxScreen.usable(self.weight, hidden):
            return self._int8().bounds(hidden)
        if self.tp_size == 1 and len(hidden) and Bf16ArgmaxScreen.usable(self.weight, hidden):
            return self._bf16().bounds(hidden)
        return None

    def logits_at(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The exact logits of tokens `ids` for hidden rows [M, H]: [M, len(ids)] (one rank's head)."""
        return F.linear(hidden.to(self.weight.dtype), self.weight.index_select(0, ids))

    def prepare_greedy(self) -> None:
        """Build the screens `greedy` uses on this device now (at load, about 1.2 s for a 262K
        vocabulary), not inside the first requests' steps."""
        if self.tp_size == 1 and Int8ArgmaxScreen.serves(self.weight):
            self._int8()
        if self.tp_size == 1 and Bf16ArgmaxScreen.serves(self.weight):
            self._bf16()

    def _int8(self) -> Int8ArgmaxScreen:
        if self._screen is None or self._screen.source is not self.weight:
            self._screen = Int8ArgmaxScreen(self.weight)
        return self._screen

    def _bf16(self) -> Bf16ArgmaxScreen:
        if self._bf16_screen is None or self._bf16_screen.source is not self.weight:
            self._bf16_screen = Bf16ArgmaxScreen(self.weight)
        return self._bf16_screen

    def _sharded_argmax(self, hidden: torch.Tensor, post) -> torch.Tensor:
        """Each rank's best token of its own vocabulary slice, then the best of those: two numbers a
        row cross the group instead of the full logits. `post` is elementwise (softcapping), so it is
        applied to the slice exactly as to the full logits; ties go to the lowest id, as argmax's."""
        logits = linear(hidden, self.weight)[:, : self.vocab_end - self.vocab_start]
        if post is not None:
            logits = post(logits)
        local = row_argmax(logits)[:, None]
        best = all_gather_last_dim(logits.gather(-1, local).float())        # [rows, tp]
        ids = all_gather_last_dim(local + self.vocab_start)
        return ids.gather(-1, best.argmax(-1, keepdim=True))[:, 0]
