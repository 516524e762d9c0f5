"""The training loop: packed rows from feature shards, AdamW with warm-up + cosine decay,
gradient clipping, bf16 autocast where the CPU/GPU has it, checkpoints every N steps, resume.

Why a checkpoint holds the data position (epoch, batch): epochs are shuffled from a seeded
generator, so resuming replays the same order and skips what was done -- the same command
continues a killed run exactly.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eagle_worker.layers.argmax_screen import fast_bf16
from eagle_worker.speculative.heads import DraftHead
from eagle_worker.training.features import FeatureStore, OnlineFeatures, Seq, load_shard
from eagle_worker.training.ttt import Rows, chain_accepted, unrolled_forward


@dataclass
class TrainConfig:
    steps: int | None = None          # optimizer steps; None: `epochs` over the data
    epochs: float = 1.0
    seconds: float | None = None      # time budget: the plan is cut to the steps that fit (cosine included)
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    batch_tokens: int = 4096          # tokens per optimizer step (rows x row_len)
    row_len: int = 512                # packed row length (>= the longest example)
    ttt_steps: int = 3                # unrolled draft steps (EAGLE-3 uses 7; 1 is plain EAGLE-1)
    step_decay: float = 0.8           # loss weight of step k: decay ** k
    feature_noise: float = 0.0
    bf16: str = "auto"                # "auto": autocast on CUDA with bf16; "on"/"off". Not on CPU by
                                      # default: even with AVX512-BF16, autocast made training slower there
    checkpoint_every: int = 200
    eval_every: int = 200
    keep_checkpoints: int = 2
    shards_in_memory: int = 4
    seed: int = 0
    threads: int | None = None


def plan_rows(lengths: list[int], row_len: int) -> list[list[int]]:
    """Indices of the sequences in each row: laid back to back, first fit among the last few rows.
    Depends on lengths only, so a resumed run can count batches without computing features."""
    rows: list[list[int]] = []
    fill: list[int] = []
    for k, n in enumerate(lengths):
        n = min(n, row_len)
        for i in range(max(0, len(rows) - 8), len(rows)):
            if fill[i] + n <= row_len:
                rows[i].append(k)
                fill[i] += n
                break
        else:
            rows.append([k])
            fill.append(n)
    return rows


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


def epoch_batches(store, cfg: TrainConfig, epoch: int, produce=None, skip: int = 0):
    """(index, Rows) of one epoch, deterministic in `epoch`, from index `skip` on.

    Disk store: epoch 0 streams the shards in extraction order (shuffled within each), calling
    `produce()` for the next one while the store is still growing, so training starts with the
    first shard; later epochs shuffle across shards. Online store: chunks in order (epoch 0) or
    shuffled, features computed per chunk; chunks before `skip` are counted, not computed."""
    rng = random.Random(cfg.seed * 1000003 + epoch)
    per = max(1, cfg.batch_tokens // cfg.row_len)
    b = 0

    def emit(seqs):
        nonlocal b
        rng.shuffle(seqs)
        for rows in pack_rows(seqs, cfg.row_len, per):
            if b >= skip:
                yield b, rows
            b += 1

    if isinstance(store, OnlineFeatures):
        order = list(range(len(store.chunks)))
        if epoch:
            rng.shuffle(order)
        for c in order:
            lengths = store.lengths(c)
            idx = list(range(len(lengths)))
            r = random.Random(rng.random())
            r.shuffle(idx)
            n = -(-len(plan_rows([lengths[i] for i in idx], cfg.row_len)) // per)
            if b + n <= skip:
                b += n
                continue
            seqs = store.seqs(c)
            seqs = [seqs[i] for i in idx]
            for rows in pack_rows(seqs, cfg.row_len, per):
                if b >= skip:
                    yield b, rows
                b += 1
        return
    if epoch == 0:
        i = 0
        while True:
            store.refresh()
            if i < len(store.shards):
                yield from emit(load_shard(store.shards[i]))
                i += 1
            elif store.complete:
                return
            elif produce is None or not produce():
                raise RuntimeError(f"{store.folder}: features incomplete and nothing extracts them")
    shards = list(store.shards)
    rng.shuffle(shards)
    for i in range(0, len(shards), cfg.shards_in_memory):
        yield from emit([s for p in shards[i:i + cfg.shards_in_memory] for s in load_shard(p)])


def estimate_steps_per_epoch(store: FeatureStore, cfg: TrainConfig) -> int:
    return max(1, math.ceil(store.num_tokens / (cfg.batch_tokens * 0.92)))


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


class Trainer:
    def __init__(self, head: DraftHead, train: FeatureStore, heldout: FeatureStore | None, cfg: TrainConfig,
                 out_dir: str | Path, target_to_draft: torch.Tensor, on_checkpoint=None, produce=None):
        self.head, self.train_store, self.heldout, self.cfg = head, train, heldout, cfg
        self.out = Path(out_dir)
        self.ckpt_dir = self.out / "checkpoints"
        self.device = next(head.parameters()).device      # the head trains where it lives (CPU or CUDA)
        self.t2d_index = target_to_draft.to(self.device)
        self.on_checkpoint = on_checkpoint       # called with (step, metrics) after each checkpoint
        self.produce = produce                   # extracts the next feature shard (streaming epoch 0)
        self.params = [p for p in head.parameters()]
        for p in self.params:
            p.requires_grad_(True)
        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
        self.spe = estimate_steps_per_epoch(train, cfg)
        self.total = cfg.steps or max(1, int(self.spe * cfg.epochs))
        self.step, self.epoch, self.batch_in_epoch = 0, 0, 0
        self.history: list[dict] = []
        self.autocast = cfg.bf16 == "on" or (cfg.bf16 == "auto" and self.device.type == "cuda" and fast_bf16(self.device))

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        path = self.ckpt_dir / f"step-{self.step:07d}.pt"
        state = {"head": self.head.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                 "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "history": self.history,
                 "config": asdict(self.cfg), "torch_rng": torch.get_rng_state()}
        torch.save(state, str(path) + ".tmp")
        Path(str(path) + ".tmp").replace(path)
        (self.ckpt_dir / "latest").write_text(path.name + "\n")
        for old in sorted(self.ckpt_dir.glob("step-*.pt"))[:-self.cfg.keep_checkpoints]:
            old.unlink()
        return path

    def latest_checkpoint(self) -> Path | None:
        f = self.ckpt_dir / "latest"
        if f.exists() and (self.ckpt_dir / f.read_text().strip()).exists():
            return self.ckpt_dir / f.read_text().strip()
        return None

    def resume(self, path: Path | None = None) -> bool:
        path = path or self.latest_checkpoint()
        if path is None:
            return False
        state = torch.load(path, map_location="cpu", weights_only=False)
        self.head.load_state_dict(state["head"])
        self.opt.load_state_dict(state["opt"])
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        self.history = state.get("history", [])
        torch.set_rng_state(state["torch_rng"])
        return True

    # ------------------------------------------------------------------ steps
    def _forward(self, rows: Rows):
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return unrolled_forward(self.head, rows.to(self.device), self.cfg.ttt_steps, self.t2d_index,
                                    feature_noise=self.cfg.feature_noise)

    def train_step(self, rows: Rows) -> dict:
        self.head.train()
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step, self.total, self.cfg)
        outs = self._forward(rows)
        loss = sum(self.cfg.step_decay ** k * o.loss for k, o in enumerate(outs))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.opt.step()
        self.step += 1
        acc = [float(o.correct.sum()) / max(1, int(o.valid.sum())) for o in outs]
        return {"loss": float(loss.detach()), "acc": acc, "grad_norm": float(gnorm), "tokens": int(outs[0].valid.sum())}

    @torch.no_grad()
    def evaluate(self, store: FeatureStore | None = None, max_batches: int | None = None) -> dict:
        """Held-out per-step accuracy (given the right inputs) and the greedy chain's expected
        accepted tokens per target forward, tau = 1 + E[accepted drafts]."""
        store = store or self.heldout
        if store is None:
            return {}
        self.head.eval()
        cfg = self.cfg
        correct = [0] * cfg.ttt_steps
        valid = [0] * cfg.ttt_steps
        acc_sum = bases = 0
        per = max(1, cfg.batch_tokens // cfg.row_len)
        for i, p in enumerate(store.shards):
            for j, rows in enumerate(pack_rows(load_shard(p), cfg.row_len, per)):
                outs = self._forward(rows)
                for k, o in enumerate(outs):
                    correct[k] += int(o.correct.sum())
                    valid[k] += int(o.valid.sum())
                base = outs[0].valid
                acc_sum += int(chain_accepted(outs)[base].sum())
                bases += int(base.sum())
                if max_batches and j + 1 >= max_batches:
                    break
        return {"heldout_acc": [c / max(1, v) for c, v in zip(correct, valid)],
                "heldout_chain_tau": 1 + acc_sum / max(1, bases), "heldout_positions": bases}

    def _fit_budget(self, elapsed: float, steps_done: int) -> None:
        """With a time budget, cut the plan to the steps the measured pace fits into what is left
        (10% kept for evaluations and checkpoints), so the schedule still ends at its low rate."""
        if self.cfg.seconds is None or steps_done < 10:
            return
        left = 0.9 * self.cfg.seconds - elapsed
        self.total = min(self.total, self.step + max(0, int(left / (elapsed / steps_done))))

    def fit(self, progress: bool = True) -> dict:
        from tqdm import tqdm

        cfg = self.cfg
        log = open(self.out / "train_log.jsonl", "a")
        bar = tqdm(total=self.total, initial=self.step, desc="train", disable=not progress, mininterval=5)
        t0, tokens, start_step = time.time(), 0, self.step
        metrics: dict = {}
        while self.step < self.total:
            for b, rows in epoch_batches(self.train_store, cfg, self.epoch, self.produce, skip=self.batch_in_epoch):
                m = self.train_step(rows)
                self.batch_in_epoch = b + 1
                self._fit_budget(time.time() - t0, self.step - start_step)
                tokens += m["tokens"]
                rec = {"step": self.step, "epoch": self.epoch, **m, "lr": self.opt.param_groups[0]["lr"],
                       "s_per_step": (time.time() - t0) / max(1, self.step - start_step)}
                bar.update(1)
                bar.set_postfix(loss=f"{m['loss']:.3f}", acc="/".join(f"{a:.2f}" for a in m["acc"]), refresh=False)
                if self.step % cfg.eval_every == 0 or self.step == self.total:
                    rec.update(self.evaluate())
                    metrics = rec
                    bar.write(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()}))
                log.write(json.dumps(rec) + "\n")
                log.flush()
                if self.step % cfg.checkpoint_every == 0 or self.step == self.total:
                    self.history.append(rec)
                    self.save_checkpoint()
                    if self.on_checkpoint:
                        self.on_checkpoint(self.step, rec)
                if self.step >= self.total:
                    break
            else:
                self.epoch += 1
                self.batch_in_epoch = 0
                continue
            break
        bar.close()
        log.close()
        return {**metrics, "train_tokens_seen": tokens, "wall_s": time.time() - t0}
