"""`train-head` refuses bad input up front, by name, with exit 2 and nothing written: counts that
would become slice indices, data with no usable sample, bad paths and PATH:N limits. Most cases
name a target that does not exist, so a refusal that came after loading it would fail differently."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from eagle_worker.training.data import load_samples
from eaglectl.train import train_head

ROWS = [{"prompt": f"question {i} about things", "response": f"answer number {i} is here and long"} for i in range(40)]


@pytest.fixture
def good(tmp_path):
    p = tmp_path / "good.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return p


def _train(tmp_path, *args, target=None):
    out = tmp_path / "out"
    base = ["--target", str(target or tmp_path / "no-such-model"), "--out", str(out), "--no-progress",
            "--prompt-format", "Q: {prompt}\\nA:", "--eval-prompts", "0", "--steps", "1"]
    return CliRunner().invoke(train_head, [*base, *args]), out


@pytest.mark.parametrize("option,value", [
    ("--heldout", "-1"), ("--self-distill", "-1"), ("--fixed-text", "-1"), ("--eval-prompts", "-1"),
    ("--steps", "0"), ("--steps", "-1"), ("--epochs", "0"), ("--epochs", "-1"), ("--epochs", "nan"),
    ("--epochs", "inf"), ("--lr", "0"), ("--lr", "nan"), ("--train-seconds", "nan"), ("--distill-seconds", "-1"),
    ("--warmup-steps", "-1"), ("--batch-tokens", "-5"), ("--max-tokens", "0"), ("--ttt-steps", "0"),
    ("--distill-tokens", "0"), ("--draft-vocab-size", "0"), ("--threads", "0"), ("--threads", "-3"),
    ("--checkpoint-every", "0"), ("--eval-every", "0"), ("--seed", "-1"),
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
