"""The training loop's bookkeeping without a target: batches packed across online chunks (full
batches, exact steps per epoch, resumable by count), the learning-rate schedule under a time
budget, and checkpoints that survive a cut `latest` pointer."""
from __future__ import annotations

import random

import pytest
import torch

from eagle_worker.training.batches import count_batches, epoch_batches
from eagle_worker.training.features import OnlineFeatures, Seq
from eagle_worker.training.render import Example
from eagle_worker.training.trainer import TrainConfig, Trainer, lr_at


class FakeOnline(OnlineFeatures):
    """Online chunks whose 'features' are free: token = example index, so batches can be compared;
    counts the chunks it computes."""

    def __init__(self, lengths: list[int], chunk_tokens: int):
        super().__init__(None, [Example([1] * n, 1, "x") for n in lengths], None, chunk_tokens=chunk_tokens)
        self.computed: list[int] = []

    def seqs(self, c):
        self.computed.append(c)
        i, j = self.chunks[c]
        return [Seq(torch.zeros(len(e.ids), 1), torch.full((len(e.ids),), k, dtype=torch.int32),
                    torch.zeros(len(e.ids), 1, dtype=torch.int32), torch.zeros(len(e.ids), 1),
                    torch.ones(len(e.ids), dtype=torch.bool)) for k, e in enumerate(self.examples[i:j], i)]


def _lengths(n=400, seed=0):
    rnd = random.Random(seed)
    return [min(96, int(rnd.lognormvariate(3.3, 0.9)) + 8) for _ in range(n)]


def _examples_in(rows):
    return sorted(int(rows.tokens[b, p]) for b in range(rows.tokens.shape[0])
                  for p in range(rows.tokens.shape[1]) if rows.positions[b, p] == 0 and rows.seq_id[b, p] >= 0)


@pytest.mark.parametrize("batch_tokens", [512, 4096])      # below and above the chunk size
def test_online_batches_are_full_across_chunks_and_counted_exactly(batch_tokens):
    store = FakeOnline(_lengths(), chunk_tokens=1024)
    cfg = TrainConfig(batch_tokens=batch_tokens, row_len=128)
    per = batch_tokens // 128
    for epoch in (0, 1):
        batches = list(epoch_batches(store, cfg, epoch))
        assert [b for b, _ in batches] == list(range(len(batches)))
        assert all(r.tokens.shape[0] == per for _, r in batches[:-1]), [r.tokens.shape[0] for _, r in batches]
        assert count_batches(store, cfg, epoch) == len(batches)
        seen = sorted(k for _, r in batches for k in _examples_in(r))
        assert seen == list(range(len(store.examples)))          # every example once
    head = torch.nn.Linear(2, 2)
    t = Trainer(head, store, None, TrainConfig(batch_tokens=batch_tokens, row_len=128, epochs=2.5), "/nonexistent",
                torch.arange(4))
    n = [count_batches(store, cfg, e) for e in range(3)]
    assert t.spe == n[0] and t.total == n[0] + n[1] + int(0.5 * n[2])
    t.epoch, t.batch_in_epoch = 1, n[1]
    assert t.epochs_seen == 2.0


def test_a_resumed_epoch_skips_by_count_and_computes_only_the_chunks_it_needs():
    store = FakeOnline(_lengths(), chunk_tokens=1024)
    cfg = TrainConfig(batch_tokens=2048, row_len=128)
    whole = [(b, _examples_in(r)) for b, r in epoch_batches(store, cfg, 1)]
    store.computed.clear()
    skip = len(whole) - 2
    tail = [(b, _examples_in(r)) for b, r in epoch_batches(store, cfg, 1, skip=skip)]
    assert tail == whole[skip:]
    assert 0 < len(set(store.computed)) < len(store.chunks) / 2


def test_the_cosine_ends_low_when_the_time_budget_runs_out_whatever_the_step():
    cfg = TrainConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    low = cfg.lr * cfg.min_lr_ratio
    assert lr_at(5, 1000, cfg) == pytest.approx(0.6)                  # warm-up, as without a budget
    assert lr_at(500, 1000, cfg) == pytest.approx(lr_at(500, 1000, cfg, spent=0.2))   # the steps lead
    assert lr_at(20, 1000, cfg, spent=1.0) == pytest.approx(low)    # the budget leads: low at its end
    assert lr_at(3, 1000, cfg, spent=1.0) == pytest.approx(low)     # even in warm-up
    assert lr_at(1000, 1000, cfg) == pytest.approx(low)
    assert lr_at(20, 1000, cfg, spent=0.5) < lr_at(20, 1000, cfg, spent=0.3) < cfg.lr


def _trainer(tmp_path, **kw):
    return Trainer(torch.nn.Linear(2, 2), FakeOnline([8] * 10, 64), None,
                   TrainConfig(batch_tokens=64, row_len=16, **kw), tmp_path, torch.arange(4))


def test_a_cut_latest_pointer_falls_back_to_the_newest_checkpoint(tmp_path):
    t = _trainer(tmp_path)
    for step in (1, 2, 3):
        t.step = step
        t.save_checkpoint()
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step-*.pt")) == ["step-0000002.pt", "step-0000003.pt"]
    assert (ckpts / "latest").read_text() == "step-0000003.pt\n" and not (ckpts / "latest.tmp").exists()
    for cut in ("", "step-00", "\0\0"):           # a kill while `latest` was written
        (ckpts / "latest").write_text(cut)
        t2 = _trainer(tmp_path)
        assert t2.resume() and t2.step == 3
    (ckpts / "step-0000003.pt").write_bytes(b"not a checkpoint")      # and an unreadable newest one
    t2 = _trainer(tmp_path)
    assert t2.resume() and t2.step == 2


def test_pruning_keeps_the_checkpoint_just_written(tmp_path):
    """A run that restarted below the steps of the checkpoints left in the folder keeps its own."""
    t = _trainer(tmp_path)
    for step in (10, 20, 30):
        t.step = step
        t.save_checkpoint()
    t.step = 5
    t.save_checkpoint()
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*.pt"))
    assert names == ["step-0000005.pt"]
    assert _trainer(tmp_path).latest_checkpoint().name == "step-0000005.pt"


def test_a_checkpoint_of_other_settings_is_refused_by_name(tmp_path):
    t = _trainer(tmp_path)
    t.step = 4
    t.save_checkpoint()
    other = Trainer(torch.nn.Linear(2, 2), FakeOnline([8] * 10, 64), None,
                    TrainConfig(batch_tokens=128, row_len=16), tmp_path, torch.arange(4))
    with pytest.raises(ValueError, match="trained with --batch-tokens 64, not 128; rerun with that setting"):
        other.resume()
    other = Trainer(torch.nn.Linear(2, 2), FakeOnline([8] * 10, 64), None,
                    TrainConfig(batch_tokens=64, row_len=16), tmp_path, torch.arange(5))
    with pytest.raises(ValueError, match="trained with another draft vocabulary"):
        other.resume()
    other = Trainer(torch.nn.Linear(2, 3), FakeOnline([8] * 10, 64), None,
                    TrainConfig(batch_tokens=64, row_len=16), tmp_path, torch.arange(4))
    with pytest.raises(ValueError, match="a head of another shape"):
        other.resume()
    state = torch.load(tmp_path / "checkpoints" / "step-0000004.pt", weights_only=False)
    del state["settings"]                              # written before checkpoints recorded them
    torch.save(state, tmp_path / "checkpoints" / "step-0000004.pt")
    with pytest.raises(ValueError, match="earlier train-head.*use a fresh --work-dir"):
        _trainer(tmp_path).resume()
