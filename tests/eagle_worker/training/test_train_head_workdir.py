"""A work folder is reused only for the examples it holds: a rerun with other data or example
settings is refused and leaves the folder as it was; a run stopped mid-training leaves a head
whose record says it is not finished."""
from __future__ import annotations

import json
import logging

import pytest

from eagle_worker.speculative.head_loader import warn_if_unfinished
from tests.eagle_worker.training.train_cli import ROWS, train, write_rows


def _train(target, data, out, *args):
    return train("--target", target, "--data", data, "--out", out, "--eval-prompts", "0", "--steps", "1",
                 "--draft-vocab-size", "64", "--max-tokens", "32", *args)


def _snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """One finished run: (target, data file, its out folder)."""
    target = tiny_model_dir("llama")
    tmp = tmp_path_factory.mktemp("workdir")
    data, out = write_rows(tmp / "good.jsonl", ROWS), tmp / "base"
    r = _train(target, data, out)
    assert r.exit_code == 0, r.output
    return target, data, out


def test_a_work_folder_of_other_examples_is_refused_and_left_as_it_was(trained, tiny_model_dir, tmp_path):
    target, data, base = trained
    work = base / "work"
    before = _snapshot(work)
    other = write_rows(tmp_path / "good2.jsonl", [{**r, "response": r["response"] + " indeed"} for r in ROWS])
    edited = write_rows(tmp_path / "good.jsonl", ROWS[:-1])       # same file name, other content
    for d, extra, says in ((other, [], "--data"), (edited, [], "--data"), (data, ["--max-tokens", "48"], "--max-tokens"),
                           (data, ["--prompt-format", "{prompt}"], "--prompt-format"), (data, ["--seed", "1"], "--seed"),
                           (data, ["--drop-responses"], "--drop-responses"), (data, ["--fixed-text", "5"], "--fixed-text")):
        r = _train(target, d, tmp_path / "out", "--work-dir", str(work), *extra)
        assert r.exit_code == 2 and f"--work-dir {work}: holds examples built from other data or settings" in r.output
        assert f"differing: {says};" in r.output and "use a fresh --work-dir" in r.output, r.output
    r = _train(tiny_model_dir("qwen2"), data, base)      # refused before the other target loads
    assert r.exit_code == 2 and "differing: --target;" in r.output, r.output
    r = _train(target, data, base, "--draft-vocab-size", "32")   # same examples, other features: refused after loading
    assert r.exit_code == 2 and "holds features of other data or settings" in r.output, r.output
    assert _snapshot(work) == before               # pipeline_config.json included
    r = _train(target, data, base, "--steps", "2")     # the same examples: resumes
    assert r.exit_code == 0 and "resumed at step 1" in r.output, r.output
    assert json.loads((base / "training_record.json").read_text())["steps"] == 2


def test_examples_of_a_run_that_recorded_nothing_are_not_reused(tmp_path):
    work = tmp_path / "out" / "work"
    work.mkdir(parents=True)
    (work / "train_examples.jsonl").write_text(json.dumps({"ids": [1] * 2000, "loss_start": 1, "source": "x"}) + "\n")
    r = _train(tmp_path / "no-such-model", write_rows(tmp_path / "d.jsonl", ROWS), tmp_path / "out")
    assert r.exit_code == 2 and f"work folder {work}: holds examples of an earlier run" in r.output, r.output


def test_an_interrupted_run_leaves_a_head_marked_unfinished(tiny_model_dir, tmp_path, monkeypatch, caplog):
    from eagle_worker.training import pipeline

    target, data, out = tiny_model_dir("llama"), write_rows(tmp_path / "d.jsonl", ROWS), tmp_path / "h"
    export = pipeline._export

    def export_then_interrupt(*a):
        export(*a)
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "_export", export_then_interrupt)
    r = _train(target, data, out, "--steps", "2", "--checkpoint-every", "1")
    assert r.exit_code == 1 and "Aborted" in r.output, r.output
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    rec = json.loads((out / "training_record.json").read_text())
    assert rec["steps"] == 1 and rec["complete"] is False
    with caplog.at_level(logging.WARNING, logger="eagle_worker.speculative.head_loader"):
        warn_if_unfinished(out)                    # the head loads, and says it is a checkpoint
    assert "unfinished training run (step 1 of 2" in caplog.text
    monkeypatch.setattr(pipeline, "_export", export)
    r = _train(target, data, out, "--steps", "2", "--checkpoint-every", "1")
    assert r.exit_code == 0, r.output
    rec = json.loads((out / "training_record.json").read_text())
    assert rec["steps"] == 2 and rec["complete"] is True
    caplog.clear()
    warn_if_unfinished(out)
    assert "unfinished" not in caplog.text
