"""The training loop: packed rows from feature shards, AdamW with warm-up + cosine decay,
gradient clipping, bf16 autocast where the CPU/GPU has it, checkpoints every N steps, resume.

Why a checkpoint holds the data position (epoch, batch) and the settings that decide it: epochs
are shuffled from a seeded generator and packed from the sequence lengths alone, so resuming
replays the same order and skips what was done -- the same command continues a killed run
exactly; a rerun with settings that pack other batches (or build another head) is refused.
Why the time budget is counted across invocations and schedules the cosine: a killed run resumes
with what is left of it, a finished one is not trained again, and a run the budget cuts ends at
its low rate however its pace changed.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eagle_worker.layers.argmax_screen import fast_bf16
from eagle_worker.speculative.heads import DraftHead
from eagle_worker.training.batches import count_batches, epoch_batches, estimate_steps_per_epoch, pack_rows, rows_per_batch
from eagle_worker.training.features import FeatureStore, OnlineFeatures, load_shard
from eagle_worker.training.ttt import Rows, chain_accepted, unrolled_forward

PACKING = 2      # how batches are packed from the lengths; a checkpoint of another packing is refused


@dataclass
class TrainConfig:
    steps: int | None = None          # optimizer steps; None: `epochs` over the data
    epochs: float = 1.0
    seconds: float | None = None      # time budget, over every invocation: the cosine runs over it too
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


def lr_at(step: int, total: int, cfg: TrainConfig, spent: float = 0.0) -> float:
    """Warm-up, then cosine to `min_lr_ratio` over whichever runs out first: the planned steps or
    the time budget (`spent`: its used fraction), so a run the budget stops ends at its low rate
    whatever its pace was. A budget spent during warm-up caps the warm-up too."""
    warm = (step + 1) / cfg.warmup_steps if step < cfg.warmup_steps else 1.0
    frac = min(1.0, max(0.0, spent, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)))
    return cfg.lr * min(warm, cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Trainer:
    def __init__(self, head: DraftHead, train: FeatureStore, heldout: FeatureStore | None, cfg: TrainConfig,
                 out_dir: str | Path, target_to_draft: torch.Tensor, on_checkpoint=None, produce=None, log=_stderr):
        self.head, self.train_store, self.heldout, self.cfg = head, train, heldout, cfg
        self.out = Path(out_dir)
        self.ckpt_dir = self.out / "checkpoints"
        self.device = next(head.parameters()).device      # the head trains where it lives (CPU or CUDA)
        self.t2d_index = target_to_draft.to(self.device)
        self.on_checkpoint = on_checkpoint       # called with (step, metrics) after each checkpoint
        self.produce = produce                   # extracts the next feature shard (streaming epoch 0)
        self.log = log
        self.params = [p for p in head.parameters()]
        for p in self.params:
            p.requires_grad_(True)
        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
        vocab = (target_to_draft >= 0).nonzero().flatten().cpu().numpy().astype("int64").tobytes()
        self.settings = {"packing": PACKING, "batch_tokens": cfg.batch_tokens, "row_len": cfg.row_len,
                         "online": isinstance(train, OnlineFeatures),
                         "draft_vocab": hashlib.sha256(vocab).hexdigest()[:16]}
        self._batches: dict[int, int] = {}
        self.spe = self.steps_in_epoch(0)
        self.total = self.planned_steps()
        self.step, self.epoch, self.batch_in_epoch = 0, 0, 0
        self.budget_used = 0.0                   # seconds of the time budget spent up to the last checkpoint
        self._t0: float | None = None            # when this invocation's fit() started
        self.finished = False
        self.history: list[dict] = []
        self.autocast = cfg.bf16 == "on" or (cfg.bf16 == "auto" and self.device.type == "cuda" and fast_bf16(self.device))

    # ------------------------------------------------------------------ plan and budget
    def steps_in_epoch(self, epoch: int) -> int:
        """Exact once every length is known (online; a complete store); estimated while extracting."""
        if not self.train_store.complete:
            return estimate_steps_per_epoch(self.train_store, self.cfg)
        if epoch not in self._batches:
            self._batches[epoch] = max(1, count_batches(self.train_store, self.cfg, epoch))
        return self._batches[epoch]

    def planned_steps(self) -> int:
        if self.cfg.steps:
            return self.cfg.steps
        whole = int(self.cfg.epochs)
        n = sum(self.steps_in_epoch(e) for e in range(whole))
        return max(1, n + int((self.cfg.epochs - whole) * self.steps_in_epoch(whole)))

    @property
    def epochs_seen(self) -> float:
        return self.epoch + self.batch_in_epoch / self.steps_in_epoch(self.epoch)

    def _plan(self) -> dict:
        return {"steps": self.cfg.steps, "epochs": self.cfg.epochs, "seconds": self.cfg.seconds}

    def seconds_used(self) -> float:
        return self.budget_used + (time.monotonic() - self._t0 if self._t0 is not None else 0.0)

    def spent(self) -> float:
        """Used fraction of the time budget (0 without one); the last 10% is kept for the evaluations
        and checkpoints around the last step."""
        return 0.0 if self.cfg.seconds is None else self.seconds_used() / (0.9 * self.cfg.seconds)

    def done(self) -> bool:
        return self.step >= self.total or self.spent() >= 1.0

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        path = self.ckpt_dir / f"step-{self.step:07d}.pt"
        state = {"head": self.head.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                 "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "history": self.history,
                 "config": asdict(self.cfg), "torch_rng": torch.get_rng_state(), "settings": self.settings,
                 "plan": self._plan(), "total": self.total, "budget_used": self.seconds_used(),
                 "finished": self.finished}
        torch.save(state, str(path) + ".tmp")
        Path(str(path) + ".tmp").replace(path)
        pointer = self.ckpt_dir / "latest.tmp"
        pointer.write_text(path.name + "\n")
        os.replace(pointer, self.ckpt_dir / "latest")
        # keep this one and the newest before it; later steps are of a run this one replaced
        found = sorted(self.ckpt_dir.glob("step-*.pt"))
        keep = [p for p in found if p.name <= path.name][-self.cfg.keep_checkpoints:]
        for old in found:
            if old not in keep:
                old.unlink()
        return path

    def checkpoints(self) -> list[Path]:
        """Resume candidates, best first: the one `latest` names, then every step-*.pt, newest first
        (a `latest` left empty or partial by a kill names none)."""
        try:
            name = (self.ckpt_dir / "latest").read_text().strip()
        except (OSError, UnicodeDecodeError):
            name = ""
        named = [self.ckpt_dir / name] if name.startswith("step-") and name.endswith(".pt") else []
        found = sorted(self.ckpt_dir.glob("step-*.pt"), reverse=True)
        return [p for p in dict.fromkeys(named + found) if p.is_file()]

    def latest_checkpoint(self) -> Path | None:
        return next(iter(self.checkpoints()), None)

    def _check(self, state: dict, path: Path) -> None:
        """Refuse a checkpoint whose batches or head differ from this run's: resuming it would skip
        the wrong data or fail on a size mismatch."""
        saved = state.get("settings")
        if not isinstance(saved, dict) or saved.get("packing") != PACKING:
            raise ValueError(f"{path}: a checkpoint of an earlier train-head, which packed its batches otherwise "
                             "or did not record its settings; use a fresh --work-dir")
        now = self.settings
        said = {"batch_tokens": f"with --batch-tokens {saved.get('batch_tokens')}, not {now['batch_tokens']}",
                "row_len": f"with packed rows of {saved.get('row_len')} tokens (--max-tokens), not {now['row_len']}",
                "online": "with --online" if saved.get("online") else "without --online",
                "draft_vocab": "with another draft vocabulary (--draft-vocab-size, --init-head)"}
        fix = "rerun with that setting, or use a fresh --work-dir"
        for k, why in said.items():
            if saved.get(k) != now[k]:
                raise ValueError(f"{path}: this checkpoint was trained {why}; {fix}")
        mine = {k: tuple(v.shape) for k, v in self.head.state_dict().items()}
        if mine != {k: tuple(v.shape) for k, v in state["head"].items()}:
            raise ValueError(f"{path}: this checkpoint is of a head of another shape (--format, --init-head); {fix}")

    def resume(self, path: Path | None = None) -> bool:
        """Continue from `path`, or the newest readable checkpoint; False when there is none."""
        state = None
        for p in [path] if path else self.checkpoints():
            try:
                state = torch.load(p, map_location="cpu", weights_only=False)
            except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
                self.log(f"{p}: unreadable checkpoint ({type(e).__name__}), trying an older one")
                continue
            path = p
            break
        if state is None:
            return False
        self._check(state, path)
        self.head.load_state_dict(state["head"])
        self.opt.load_state_dict(state["opt"])
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        self.history = state.get("history", [])
        self.budget_used, self.finished = state["budget_used"], state["finished"]
        if state["plan"] == self._plan():
            self.total = state["total"]           # a plan refined while extracting stays as it ran
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
            g["lr"] = lr_at(self.step, self.total, self.cfg, self.spent())
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
        for i, p in enumerate(store.shards):
            for j, rows in enumerate(pack_rows(load_shard(p), cfg.row_len, rows_per_batch(cfg))):
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

    def _trim_log(self, path: Path) -> None:
        """Keep the log of the steps up to where this run starts: a killed run logged steps past its
        last checkpoint, which are trained again now (and a line cut by the kill)."""
        if not path.exists():
            return
        keep = []
        for line in path.read_text().split("\n"):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= self.step:
                keep.append(line + "\n")
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)

    def fit(self, progress: bool = True) -> dict:
        from tqdm import tqdm

        cfg = self.cfg
        self._trim_log(self.out / "train_log.jsonl")
        log = open(self.out / "train_log.jsonl", "a")
        bar = tqdm(total=self.total, initial=self.step, desc="train", disable=not progress, mininterval=5)
        self._t0 = t0 = time.monotonic()
        tokens, start_step, self.finished = 0, self.step, False
        metrics: dict = {}
        while not self.done():
            trained = False
            for b, rows in epoch_batches(self.train_store, cfg, self.epoch, self.produce, skip=self.batch_in_epoch):
                m = self.train_step(rows)
                trained = True
                self.batch_in_epoch = b + 1
                last = self.done()
                tokens += m["tokens"]
                rec = {"step": self.step, "epoch": self.epoch, **m, "lr": self.opt.param_groups[0]["lr"],
                       "s_per_step": (time.monotonic() - t0) / max(1, self.step - start_step)}
                bar.update(1)
                bar.set_postfix(loss=f"{m['loss']:.3f}", acc="/".join(f"{a:.2f}" for a in m["acc"]), refresh=False)
                if self.step % cfg.eval_every == 0 or last:
                    rec.update(self.evaluate())
                    metrics = rec
                    bar.write(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()}))
                log.write(json.dumps(rec) + "\n")
                log.flush()
                if self.step % cfg.checkpoint_every == 0 or last:
                    self.finished = last
                    self.history.append(rec)
                    self.save_checkpoint()
                    if self.on_checkpoint:
                        self.on_checkpoint(self.step, rec)
                if last:
                    break
            else:
                if not trained and self.batch_in_epoch == 0:
                    raise RuntimeError(f"epoch {self.epoch} has no batch to train on")
                self.epoch += 1
                self.batch_in_epoch = 0
                if self.epoch == 1 and not self.cfg.steps:     # an estimate while extracting: the lengths are known now
                    self.total = bar.total = max(self.step, self.planned_steps())
                continue
            break
        if self.step > start_step and not self.finished:    # the budget ran out between two epochs
            self.finished = True
            metrics = {**rec, **self.evaluate()}
            self.history.append(metrics)
            self.save_checkpoint()
            if self.on_checkpoint:
                self.on_checkpoint(self.step, metrics)
        bar.close()
        log.close()
        return {**metrics, "train_tokens_seen": tokens, "wall_s": time.monotonic() - t0}
