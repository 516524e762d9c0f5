"""`train-head` refuses bad input up front, by name, with exit 2 and nothing written: counts that
would become slice indices, data with no usable sample, bad paths and PATH:N limits. Most cases
name a target that does not exist, so a refusal that came after loading it would fail differently."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from eagle_worker.training.data import load_samples
from eaglectl.train import train_head
from tests.eagle_worker.training.train_cli import ROWS, train, write_rows


@pytest.fixture
def good(tmp_path):
    return write_rows(tmp_path / "good.jsonl")


def _train(tmp_path, *args, target=None):
    out = tmp_path / "out"
    return train("--target", target or tmp_path / "no-such-model", "--out", out, "--eval-prompts", "0", "--steps", "1",
                 *args), out


@pytest.mark.parametrize("option,value", [
    ("--heldout", "-1"), ("--self-distill", "-1"), ("--fixed-text", "-1"), ("--eval-prompts", "-1"),
    ("--steps", "0"), ("--steps", "-1"), ("--epochs", "0"), ("--epochs", "-1"), ("--epochs", "nan"),
    ("--epochs", "inf"), ("--lr", "0"), ("--lr", "nan"), ("--train-seconds", "nan"), ("--distill-seconds", "-1"),
    ("--warmup-steps", "-1"), ("--batch-tokens", "-5"), ("--max-tokens", "0"), ("--ttt-steps", "0"),
    ("--distill-tokens", "0"), ("--draft-vocab-size", "0"), ("--threads", "0"), ("--threads", "-3"),
    ("--checkpoint-every", "0"), ("--eval-every", "0"), ("--seed", "-1"), ("--train-seconds", "0"),
])
def test_a_nonsense_count_is_refused_by_name(tmp_path, good, option, value):
    r, out = _train(tmp_path, "--data", str(good), option, value)
    assert r.exit_code == 2 and option in r.output, r.output
    assert not out.exists()


@pytest.mark.parametrize("extra,says", [
    (["--draft-vocab-size", "3"], "--draft-vocab-size 3"),
    (["--self-distill", "4", "--max-tokens", "64", "--distill-tokens", "64"], "--max-tokens 64"),
    (["--fixed-text", "0"], "--fixed-text 0"),
    (["--prompt-format", "{prompt} {x}"], "--prompt-format"),
    (["--batch-tokens", "100"], "--batch-tokens 100 is less than one packed row of 512 tokens"),
    (["--format", "eagle1", "--draft-vocab-size", "4096"], "--draft-vocab-size is not used here (an EAGLE-1"),
    (["--init-head", "h", "--draft-vocab-size", "4096"], "--init-head keeps that head's draft vocabulary"),
])
def test_options_that_cannot_work_together_are_refused_before_the_target_loads(tmp_path, good, extra, says):
    r, out = _train(tmp_path, "--data", str(good), *extra)
    assert r.exit_code == 2 and says in r.output, r.output
    assert not out.exists()


@pytest.mark.parametrize("content", ["", '{"foo": 1}\n', "[1,2,3]\n", '{"prompt": 5, "response": null}\n',
                                     '{"conversations": [1, {"from": "human"}]}\n{"turns": [{"a": 1}]}\n'])
def test_data_without_a_usable_sample_is_refused_before_any_work(tmp_path, content):
    p = tmp_path / "bad.jsonl"
    p.write_text(content)
    r, out = _train(tmp_path, "--data", str(p))
    assert r.exit_code == 2 and f"no training samples in {p}" in r.output, r.output
    assert not out.exists()


def test_bad_paths_limits_and_json_are_named(tmp_path, good):
    missing = tmp_path / "nonexistent.jsonl"
    r, out = _train(tmp_path, "--data", str(missing))
    assert r.exit_code == 2 and f"--data {missing}: no such file" in r.output, r.output
    for limit in ("-5", "abc"):
        r, _ = _train(tmp_path, "--data", f"{good}:{limit}")
        assert r.exit_code == 2 and f"{good}:{limit}" in r.output and "PATH:N" in r.output, r.output
    r, _ = _train(tmp_path, "--data", f"{good}:0")
    assert r.exit_code == 2 and "no training samples" in r.output, r.output
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text('{"prompt": "fine"}\nnot json {\n')
    r, _ = _train(tmp_path, "--data", str(garbage))
    assert r.exit_code == 2 and f"{garbage}: line 2: not valid JSON" in r.output, r.output
    assert not out.exists()
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for o in (a_file, a_file / "sub"):
        r = CliRunner().invoke(train_head, ["--target", "x", "--data", str(good), "--out", str(o), "--no-progress"])
        assert r.exit_code == 2 and f"--out {o}: {a_file} is a file" in r.output, r.output


def test_a_limit_takes_exactly_that_many_samples(tmp_path, good):
    assert load_samples(f"{good}:0") == []
    assert [s.prompt for s in load_samples(f"{good}:2")] == ["question 0 about things", "question 1 about things"]
    colon = tmp_path / "mix:v2.jsonl"          # an existing path is taken whole, colon included
    colon.write_text(good.read_text())
    assert len(load_samples(colon)) == 40 and len(load_samples(f"{colon}:3")) == 3


def test_refusals_that_need_the_target_name_it_and_write_nothing(tiny_model_dir, tmp_path, good):
    """The tiny target has no chat template; one sample is all held out."""
    target = tiny_model_dir("llama")
    r, out = _train(tmp_path, "--data", str(good), "--prompt-format", "chat", target=target)
    assert r.exit_code == 2 and f"model '{target}' has no chat template" in r.output, r.output
    assert not out.exists()
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps(ROWS[0]) + "\n")
    r, out = _train(tmp_path, "--data", str(one), target=target)
    assert r.exit_code == 2 and "all held out" in r.output, r.output
    assert not out.exists()


def test_no_examples_within_max_tokens_is_refused_and_not_cached(tiny_model_dir, tmp_path, good):
    """An empty training set is not cached: the rerun with room for a response trains. With
    --heldout 0 there is no held-out prompt to measure engine tau on, and none is measured."""
    target = tiny_model_dir("llama")
    r, out = _train(tmp_path, "--data", str(good), "--max-tokens", "3", "--drop-responses", target=target)
    assert r.exit_code == 2 and "no training examples" in r.output and "--max-tokens 3" in r.output, r.output
    assert not (out / "work" / "train_examples.jsonl").exists()
    r, out = _train(tmp_path, "--data", str(good), "--max-tokens", "16", "--drop-responses", "--heldout", "0",
                    "--eval-prompts", "2", target=target)
    assert r.exit_code == 0, r.output
    rec = json.loads((out / "training_record.json").read_text())
    assert rec["steps"] == 1 and "engine" not in rec


def test_a_folder_that_cannot_be_made_or_written_is_refused_before_the_target_loads(tmp_path, good, monkeypatch):
    """Probed by making it and a file in it (root writes through chmod, so a read-only file system
    is simulated), and undone: nothing is left behind."""
    import errno

    from eagle_worker.training import preflight

    ro = tmp_path / "ro"
    ro.mkdir()
    real_mkdir, real_tmp = preflight.Path.mkdir, preflight.tempfile.NamedTemporaryFile

    def refuse_in_ro(p):
        if ro in [p, *p.parents]:
            raise OSError(errno.EROFS, "Read-only file system", str(p))

    monkeypatch.setattr(preflight.Path, "mkdir", lambda self, *a, **k: refuse_in_ro(self) or real_mkdir(self, *a, **k))
    monkeypatch.setattr(preflight.tempfile, "NamedTemporaryFile",
                        lambda dir, **k: refuse_in_ro(preflight.Path(dir)) or real_tmp(dir=dir, **k))
    for opt, path in (("--out", ro / "head"), ("--work-dir", ro), ("--work-dir", ro / "a" / "w")):
        r = CliRunner().invoke(train_head, ["--target", str(tmp_path / "no-such-model"), "--data", str(good),
                                            "--out", str(tmp_path / "out"), "--no-progress", opt, str(path)])
        assert r.exit_code == 2 and f"{opt} {path}: cannot create or write it (Read-only file system)" in r.output, r.output
    assert list(ro.iterdir()) == [] and not (tmp_path / "out").exists()
    if Path("/proc/self").is_dir():        # a folder no one can make
        r, _ = _train(tmp_path, "--data", str(good), "--work-dir", "/proc/no-such/work")
        assert r.exit_code == 2 and "--work-dir /proc/no-such/work: cannot create or write it" in r.output, r.output


def test_an_os_error_during_the_run_is_one_line(tmp_path, good, monkeypatch):
    from eagle_worker.training import pipeline

    def full_disk(cfg, progress):
        raise OSError(28, "No space left on device", str(tmp_path / "out" / "work" / "x"))

    monkeypatch.setattr(pipeline, "run", full_disk)
    r, _ = _train(tmp_path, "--data", str(good))
    assert r.exit_code == 1 and r.output.strip() == f"error: {tmp_path}/out/work/x: No space left on device", r.output


def test_max_tokens_over_the_target_context_is_refused_by_name(tiny_model_dir, tmp_path, good, monkeypatch):
    """Before loading when config.json is on disk; after loading (before anything is written) otherwise."""
    from eagle_worker.training import preflight

    fake = tmp_path / "config-only"        # nothing to load: a refusal after loading would fail otherwise
    fake.mkdir()
    (fake / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 512}))
    r, out = _train(tmp_path, "--data", str(good), "--max-tokens", "2000", target=fake)
    assert r.exit_code == 2 and "--max-tokens 2000 is over the context of model" in r.output and "512" in r.output, r.output
    assert not out.exists()
    monkeypatch.setattr(preflight, "local_context", lambda target: None)    # e.g. a hub id
    r, out = _train(tmp_path, "--data", str(good), "--max-tokens", "513", target=tiny_model_dir("llama"))
    assert r.exit_code == 2 and "--max-tokens 513 is over the context" in r.output and "(512 tokens)" in r.output, r.output
    assert not out.exists()


def test_init_head_that_is_no_head_folder_is_refused_before_the_target_loads(tiny_model_dir, tmp_path, good):
    a_file, no_cfg, no_weights = tmp_path / "a_file", tmp_path / "no_cfg", tmp_path / "no_weights"
    a_file.write_text("x")
    no_cfg.mkdir()
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    for head, says in ((tmp_path / "missing", "no such folder"), (a_file, "a file, not a head folder"),
                       (no_cfg, "no config.json"), (no_weights, "no model.safetensors"),
                       (tiny_model_dir("llama"), "num_hidden_layers=4: a full model, not a draft head")):
        r, out = _train(tmp_path, "--data", str(good), "--init-head", str(head))
        assert r.exit_code == 2 and f"--init-head {head}: {says}" in r.output, r.output
        assert not out.exists()


def test_a_data_folder_reads_regular_files_only(tmp_path, good):
    folder = tmp_path / "mix"
    (folder / "sub.json").mkdir(parents=True)
    r, out = _train(tmp_path, "--data", str(folder))
    assert r.exit_code == 2 and f"{folder}: no .json/.jsonl/.parquet files" in r.output, r.output
    (folder / "a.jsonl").write_text(good.read_text())
    assert len(load_samples(folder)) == 40


def test_json_nested_too_deeply_is_not_valid_json(tmp_path):
    deep = "[" * 200_000
    for name, text, says in (("deep.jsonl", '{"prompt": "fine"}\n' + deep + "\n", "line 2: not valid JSON"),
                             ("deep.json", deep, "not valid JSON")):
        p = tmp_path / name
        p.write_text(text)
        r, out = _train(tmp_path, "--data", str(p))
        assert r.exit_code == 2 and f"{p}: {says} (nested too deeply)" in r.output, r.output
