"""A seed is a text in jobs too (issue #22): `submit-job --seed S --temperature T` writes the same rows
every time, with or without the draft head, and each row equals `LLM.generate` with that seed. Before
keyed sampling the adaptive tree budget changed how many random numbers a step drew, so two runs
differed and a resumed job did not reproduce its rows."""
from __future__ import annotations

import pytest

from .conftest import cli, read_rows, write_parquet

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Write a haiku about rain.", "def fib(n):", "Once upon a time",
           "List three colours:", "2 + 2 =", "The best way to learn is", "Dear diary,"]


def _job(tmp_path, name: str, *flags) -> dict[str, str]:
    inp = tmp_path / "prompts.parquet"
    if not inp.exists():
        write_parquet(inp, id=[f"r{i}" for i in range(len(PROMPTS))], prompt=PROMPTS)
    res = cli("submit-job", inp, "--output", tmp_path / name, "--max-tokens", "10", "--seed", "123",
              "--temperature", "0.8", *flags, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    return {r["id"]: r["text"] for r in read_rows(tmp_path / name)}


def test_seeded_job_is_reproducible_with_and_without_the_head(tmp_path):
    from eagle_worker import LLM, SamplingParams

    first = _job(tmp_path, "first")                   # the default: the hybrid with the head
    outs = LLM(model="gemma-3-270m", draft=None).generate(          # no speculation: the same rows
        PROMPTS, SamplingParams(max_tokens=10, temperature=0.8, seed=123))
    assert {f"r{i}": o.text for i, o in enumerate(outs)} == first
    assert len(set(first.values())) > 1          # sampled, not one canned text
