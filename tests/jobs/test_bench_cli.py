"""`eaglectl bench spec` refuses options it cannot report on, before loading any model."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from jobs.cli import bench_spec


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
