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
