"""Rerunning `train-head` on its work folder: a run cut by its time budget ended at its low learning
rate and is not trained again; a checkpoint of other batch settings is refused by name; the log
holds each step once after a resume."""
from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from tests.eagle_worker.training.train_cli import train, write_rows


def _train(target, data, out, *args):
    return train("--target", target, "--data", data, "--out", out, "--eval-prompts", "0", "--draft-vocab-size", "64",
                 "--max-tokens", "32", "--batch-tokens", "128", *args)


def _log(out):
    return [json.loads(line) for line in (out / "work" / "train_log.jsonl").read_text().split("\n") if line]


def _data(tmp_path):
    return write_rows(tmp_path / "d.jsonl")


def test_a_budget_cut_run_ends_low_and_a_rerun_trains_no_more(tiny_model_dir, tmp_path, monkeypatch):
    """The first steps are slow (10 s each on a fake clock), the rest fast (1 s): the run uses its
    whole budget, its last steps at the low rate; the same command again is a no-op."""
    from eagle_worker.training import trainer

    clock = [0.0]
    monkeypatch.setattr(trainer, "time", SimpleNamespace(monotonic=lambda: clock[0], time=lambda: clock[0]))
    step = trainer.Trainer.train_step

    def timed_step(self, rows):
        clock[0] += 10.0 if self.step < 5 else 1.0
        return step(self, rows)

    monkeypatch.setattr(trainer.Trainer, "train_step", timed_step)
    target, data, out = tiny_model_dir("llama"), _data(tmp_path), tmp_path / "h"
    args = ("--epochs", "1000", "--train-seconds", "100", "--lr", "1e-2", "--warmup-steps", "8",
            "--checkpoint-every", "10")
    r = _train(target, data, out, *args)
    assert r.exit_code == 0, r.output
    log = _log(out)
    assert len(log) == 45, len(log)             # 5 x 10 s, then 1 s a step until 90% of 100 s
    assert log[-1]["lr"] < 0.11 * 1e-2 and max(x["lr"] for x in log) > 0.4e-2, [x["lr"] for x in log]
    rec = json.loads((out / "training_record.json").read_text())
    assert rec["complete"] and rec["steps"] == len(log)
    ckpt = torch.load(sorted((out / "work" / "checkpoints").glob("step-*.pt"))[-1], weights_only=False)
    assert ckpt["finished"] and ckpt["budget_used"] >= 90 and ckpt["total"] > 1000

    r = _train(target, data, out, *args)
    assert r.exit_code == 0, r.output
    assert f"training finished at step {len(log)}: its 100 s budget (--train-seconds) is spent" in r.output
    assert len(_log(out)) == len(log)
    assert json.loads((out / "training_record.json").read_text())["steps"] == len(log)


def test_a_checkpoint_of_other_batch_settings_is_refused_by_name(tiny_model_dir, tmp_path):
    target, data, out = tiny_model_dir("llama"), _data(tmp_path), tmp_path / "h"
    assert _train(target, data, out, "--steps", "2").exit_code == 0
    before = (out / "work" / "pipeline_config.json").read_text()
    for extra, says in ((["--batch-tokens", "256"], "with --batch-tokens 128, not 256"), (["--online"], "without --online")):
        r = _train(target, data, out, "--steps", "3", *extra)
        assert r.exit_code == 2 and "step-0000002.pt: this checkpoint was trained " + says in r.output, r.output
        assert "rerun with that setting, or use a fresh --work-dir" in r.output and "Traceback" not in r.output
    assert (out / "work" / "pipeline_config.json").read_text() == before


def test_the_log_holds_each_step_once_after_a_resume(tiny_model_dir, tmp_path, monkeypatch):
    """Killed after logging step 3, past its checkpoint at step 2: the rerun trains step 3 again."""
    from eagle_worker.training import trainer

    step = trainer.Trainer.train_step

    def killed_at_4(self, rows):
        if self.step == 3:
            raise KeyboardInterrupt
        return step(self, rows)

    target, data, out = tiny_model_dir("llama"), _data(tmp_path), tmp_path / "h"
    monkeypatch.setattr(trainer.Trainer, "train_step", killed_at_4)
    r = _train(target, data, out, "--steps", "4", "--checkpoint-every", "2")
    assert r.exit_code == 1 and [x["step"] for x in _log(out)] == [1, 2, 3]
    with open(out / "work" / "train_log.jsonl", "a") as f:
        f.write('{"step": 4, "lo')                    # and a line the kill cut
    monkeypatch.setattr(trainer.Trainer, "train_step", step)
    r = _train(target, data, out, "--steps", "4", "--checkpoint-every", "2")
    assert r.exit_code == 0 and "resumed at step 2" in r.output, r.output
    assert [x["step"] for x in _log(out)] == [1, 2, 3, 4]
