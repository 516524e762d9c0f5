"""`eaglectl bench spec` refuses options it cannot report on, before loading any model."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from eaglectl.bench import bench_spec


def test_bench_spec_needs_vanilla():
    res = CliRunner().invoke(bench_spec, ["--methods", "dynamic,hybrid", "--sweep", ""])
    assert res.exit_code == 2
    assert "--methods" in res.output and "vanilla" in res.output


def test_bench_spec_needs_at_least_one_round():
    res = CliRunner().invoke(bench_spec, ["--rounds", "0", "--sweep", ""])
    assert res.exit_code == 2
    assert "--rounds" in res.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_bench_spec_on_a_missing_gpu_says_so():
    res = CliRunner().invoke(bench_spec, ["--device", "cuda", "--sweep", ""])
    assert res.exit_code == 2
    assert "--device" in res.output and "CUDA is not available" in res.output


def test_bench_spec_warms_up_on_prompts_it_does_not_measure(tmp_path):
    from bench.prompts import SPEC_BENCH, load_questions, render
    from bench.spec import _warmup_prompts

    measured = {render(r) for r in load_questions(SPEC_BENCH, per_category=2)}
    warm = _warmup_prompts(SPEC_BENCH, 2, 4)
    assert len(warm) == 4 and not set(warm) & measured
    cats = {r["category"] for r in load_questions(SPEC_BENCH, per_category=3) if render(r) in warm}
    assert len(cats) == 4                                    # spread over categories
    assert _warmup_prompts(SPEC_BENCH, 2, 0) == []
    small = tmp_path / "q.jsonl"                             # a file with nothing else: its own prompts
    small.write_text('{"category": "a", "turns": ["hi"]}\n')
    assert _warmup_prompts(small, 2, 4) == [render({"turns": ["hi"]})]
    res = CliRunner().invoke(bench_spec, ["--warmup", "-1", "--sweep", ""])
    assert res.exit_code == 2 and "--warmup" in res.output


def test_bench_spec_rotates_the_order_and_takes_each_prompts_median_time(monkeypatch, tmp_path):
    import json

    import bench.spec as bs

    calls = []

    def fake_runners(model, dtype, draft, methods, tree, max_tokens, temperature, warm_prompts, device):
        def runner(method):
            def run(ps, shares=None):
                calls.append((method, ps[0]))
                secs = 1.0 if method == "vanilla" else 0.5
                if method == "lookup" and "aq0\n" in ps[0] and calls.count((method, ps[0])) == 2:
                    secs = 50.0                                  # a slow spell during one pass
                if shares is not None:                           # the hybrid's 3 lookup steps a prompt
                    shares["steps_lookup"] = shares.get("steps_lookup", 0) + 3
                return secs, 10, 10 if method == "vanilla" else 4
            return run
        return {m: runner(m) for m in methods}, {}

    monkeypatch.setattr(bs, "_runners", fake_runners)
    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps({"category": c, "turns": [f"{c}q{i}"]}) + "\n" for c in ("a", "b") for i in range(2)))
    rep = bs.run(model="x", prompts_file=q, per_category=2, methods=("vanilla", "lookup", "hybrid"), sweep=(),
                 json_out=None, rounds=3, warmup=0)
    assert len(calls) == 3 * 4 * 3                               # every method, prompt and round
    firsts = [calls[i][0] for i in range(0, len(calls), 3)]
    assert firsts[:4] == ["vanilla", "lookup", "hybrid", "vanilla"]   # the order rotates per prompt ...
    assert firsts[4:6] == ["lookup", "hybrid"]                   # ... and per round
    s = rep["summary"]
    assert s["lookup"]["a"]["tok_s"] == s["lookup"]["b"]["tok_s"] == 20.0   # the slow pass's median drops it
    assert s["lookup"]["overall"]["speedup"] == 2.0 and s["lookup"]["a"]["tau"] == 2.5
    assert rep["results"]["hybrid"]["a"]["steps_by_source"] == {"lookup": 6.0}   # per pass over 2 prompts
    # hybrid against lookup pass by pass: level (both 0.5 s) but for the slow pass, which the median drops
    level = rep["paired"]["hybrid/lookup"]
    assert level["a"]["ratio"] == level["b"]["ratio"] == 1.0 and level["a"]["pairs"] == 6
    assert level["a"]["ci95"][0] == 1.0 and level["a"]["ci95"][1] >= 1.0 and level["b"]["ci95"] == [1.0, 1.0]
    assert rep["paired"]["hybrid/vanilla"]["overall"]["ratio"] == 2.0


@pytest.mark.slow  # the whole GPU check end to end on CPU: engines, a head training, decode benches
def test_cuda_check_dry_runs_on_cpu(tmp_path):
    """The prepared GPU check (`python -m bench.cuda_check`) runs end to end with --device cpu, so it
    works the day a GPU machine is lent; every check it reports holds."""
    import json

    from bench.cuda_check import main

    res = CliRunner().invoke(main, ["--out", str(tmp_path), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "cuda_check.json").read_text())
    for family in ("llama", "qwen2", "gemma3"):
        assert set(report[f"engine_{family}"].values()) == {True}
    assert report["train_head"]["trained_head_lossless"] and report["train_head"]["train_head_steps"] == 24
    assert [r["batch"] for r in report["decode_tok_s"]] == [1, 16, 64]
