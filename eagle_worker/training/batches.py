"""Batches for the training loop: examples packed into rows of `row_len` tokens, `rows_per_batch`
rows a step, in a seeded order per epoch (from the stored shards, or produced on the fly with
`--online`).

Why rows carry over between chunks: online features come a chunk at a time, and packing each
chunk alone made about half the steps tiny leftovers (and capped a batch at a chunk); carried over,
every step but an epoch's last is full, and `count_batches` counts an epoch's steps exactly from
the lengths alone, which a resumed run uses to skip what it did.
"""
from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING

import torch

from eagle_worker.training.features import FeatureStore, OnlineFeatures, Seq, load_shard
from eagle_worker.training.ttt import Rows

if TYPE_CHECKING:
    from eagle_worker.training.trainer import TrainConfig


def rows_per_batch(cfg: TrainConfig) -> int:
    return max(1, cfg.batch_tokens // cfg.row_len)


class _Packer:
    """Rows of sequence keys, each sequence laid first fit among the last 8 open rows. `take()`
    hands out whole batches and keeps the rest open: the rows a group of sequences leaves short of
    a batch are filled and batched with the next group's."""

    def __init__(self, row_len: int, per: int):
        self.row_len, self.per = row_len, per
        self.rows: list[list] = []
        self.fill: list[int] = []

    def add(self, keys, lengths) -> None:
        for k, n in zip(keys, lengths):
            n = min(n, self.row_len)
            for i in range(max(0, len(self.rows) - 8), len(self.rows)):
                if self.fill[i] + n <= self.row_len:
                    self.rows[i].append(k)
                    self.fill[i] += n
                    break
            else:
                self.rows.append([k])
                self.fill.append(n)

    def take(self, final: bool = False) -> list[list[list]]:
        n = len(self.rows) if final else len(self.rows) - len(self.rows) % self.per
        out = [self.rows[i:i + self.per] for i in range(0, n, self.per)]
        del self.rows[:n], self.fill[:n]
        return out


def plan_rows(lengths: list[int], row_len: int) -> list[list[int]]:
    """Indices of the sequences in each row: laid back to back, first fit among the last few rows.
    Depends on lengths only, so a resumed run can count batches without computing features."""
    packer = _Packer(row_len, 1)
    packer.add(range(len(lengths)), lengths)
    return packer.rows


def _truncate(s: Seq, n: int) -> Seq:
    return s if len(s) <= n else Seq(*(getattr(s, f)[:n] for f in ("features", "tokens", "topk_ids", "topk_logp", "label_mask")))


def pack_rows(seqs: list[Seq], row_len: int, rows_per_batch: int):
    """Yield `Rows` batches of `rows_per_batch` packed rows of `row_len`."""
    rows = plan_rows([len(s) for s in seqs], row_len)
    for b in range(0, len(rows), rows_per_batch):
        yield _to_rows([[_truncate(seqs[k], row_len) for k in r] for r in rows[b:b + rows_per_batch]], row_len)


def _to_rows(groups: list[list[Seq]], L: int) -> Rows:
    B = len(groups)
    s0 = groups[0][0]
    F, K = s0.features.shape[1], s0.topk_ids.shape[1]
    feats = torch.zeros(B, L, F, dtype=s0.features.dtype)
    tokens = torch.zeros(B, L, dtype=torch.long)
    seq_id = torch.full((B, L), -1, dtype=torch.long)
    pos = torch.zeros(B, L, dtype=torch.long)
    tids = torch.zeros(B, L, K, dtype=torch.long)
    tlp = torch.full((B, L, K), float("-inf"))
    lm = torch.zeros(B, L, dtype=torch.bool)
    for b, g in enumerate(groups):
        o = 0
        for j, s in enumerate(g):
            n = len(s)
            feats[b, o:o + n] = s.features
            tokens[b, o:o + n] = s.tokens.long()
            seq_id[b, o:o + n] = j
            pos[b, o:o + n] = torch.arange(n)
            tids[b, o:o + n] = s.topk_ids.long()
            tlp[b, o:o + n] = s.topk_logp.float()
            lm[b, o:o + n] = s.label_mask
            o += n
    return Rows(feats, tokens, seq_id, pos, tids, tlp, lm)


def _epoch_groups(store, cfg: TrainConfig, epoch: int, produce=None):
    """The epoch's groups of sequences in order, each `(lengths, load)` in a seeded shuffled
    order; `load()` returns its sequences in that order. Online: the chunks, in order (epoch 0) or
    shuffled. Disk: epoch 0 streams the shards in extraction order, calling `produce()` for the
    next one while the store is still growing; later epochs shuffle across shards. The lengths
    need no features (the examples; a shard's offsets)."""
    rng = random.Random(cfg.seed * 1000003 + epoch)

    def group(lengths, load):
        idx = list(range(len(lengths)))
        random.Random(rng.random()).shuffle(idx)

        def shuffled():
            seqs = load()
            return [seqs[i] for i in idx]
        return [lengths[i] for i in idx], shuffled

    if isinstance(store, OnlineFeatures):
        order = list(range(len(store.chunks)))
        if epoch:
            rng.shuffle(order)
        for c in order:
            yield group(store.lengths(c), lambda c=c: store.seqs(c))
        return
    if epoch == 0:
        i = 0
        while True:
            store.refresh()
            if i < len(store.shards):
                yield group(store.lengths(i), lambda p=store.shards[i]: load_shard(p))
                i += 1
            elif store.complete:
                return
            elif produce is None or not produce():
                raise RuntimeError(f"{store.folder}: features incomplete and nothing extracts them")
    shards = list(range(len(store.shards)))
    rng.shuffle(shards)
    for i in range(0, len(shards), cfg.shards_in_memory):
        part = [store.shards[s] for s in shards[i:i + cfg.shards_in_memory]]
        yield group([n for s in shards[i:i + cfg.shards_in_memory] for n in store.lengths(s)],
                    lambda part=part: [x for p in part for x in load_shard(p)])


def epoch_batches(store, cfg: TrainConfig, epoch: int, produce=None, skip: int = 0):
    """(index, Rows) of one epoch, deterministic in `epoch`, from index `skip` on. Rows a group
    (online chunk, shard, shards in memory) leaves short of a batch carry into the next, so every
    batch but the epoch's last is full, whatever the group and batch sizes. A group's features
    are computed (online) or read only when a batch from `skip` on holds one of its sequences."""
    packer = _Packer(cfg.row_len, rows_per_batch(cfg))
    loads: dict = {}
    have: dict = {}
    b = 0

    def emit(batches):
        nonlocal b
        for batch in batches:
            if b >= skip:
                for g in sorted({g for row in batch for g, _ in row} - have.keys()):
                    have[g] = loads[g]()
                yield b, _to_rows([[_truncate(have[g][i], cfg.row_len) for g, i in row] for row in batch], cfg.row_len)
            b += 1
        still = {g for row in packer.rows for g, _ in row}      # groups with sequences in open rows
        for g in [g for g in loads if g not in still]:
            del loads[g]
            have.pop(g, None)

    for g, (lengths, load) in enumerate(_epoch_groups(store, cfg, epoch, produce)):
        loads[g] = load
        packer.add([(g, i) for i in range(len(lengths))], lengths)
        yield from emit(packer.take())
    yield from emit(packer.take(final=True))


def count_batches(store, cfg: TrainConfig, epoch: int) -> int:
    """Batches of one epoch, from the lengths alone: the packing of `epoch_batches`."""
    packer = _Packer(cfg.row_len, rows_per_batch(cfg))
    n = 0
    for lengths, _ in _epoch_groups(store, cfg, epoch):
        packer.add(range(len(lengths)), lengths)
        n += len(packer.take())
    return n + len(packer.take(final=True))


def estimate_steps_per_epoch(store: FeatureStore, cfg: TrainConfig) -> int:
    """For a store still being extracted (not every length known yet): rows fill to ~0.9 (measured)."""
    return max(1, math.ceil(store.num_tokens / (rows_per_batch(cfg) * cfg.row_len * 0.9)))
