"""`eaglectl bench structured`: a run on a tiny target with a head drafting it (its speculation must
give plain decoding's text under every format), its report, and the options it refuses."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from eaglectl.bench import bench as bench_cli


def test_a_tiny_run_reports_every_format_and_batch_with_the_same_text(copying_target, tmp_path):
    from bench.structured import run, table

    target, head = copying_target
    out = tmp_path / "s.json"
    res = CliRunner().invoke(bench_cli, ["structured", "--model", str(target), "--draft", str(head), "--batch-sizes",
                                         "1,3", "--prompts", "3", "--max-tokens", "12", "--rounds", "1",
                                         "--json", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())["rows"]
    assert [(r["format"], r["batch"]) for r in rows] == [(f, b) for f in ("free", "json_object", "json_schema")
                                                        for b in (1, 3)]
    assert all(r["same"] and r["plain_tok_s"] > 0 and r["spec_tok_s"] > 0 for r in rows), rows
    assert max(r["tau"] for r in rows) > 1.0          # the head's drafts were accepted somewhere
    assert "| json_schema | 3 |" in table(rows) and "| json_schema | 3 |" in res.output
    direct = run(model=str(target), draft=str(head), formats=["json_object"], batch_sizes=[2], num_prompts=2,
                 max_tokens=8, rounds=1)
    assert len(direct) == 1 and direct[0]["same"]


@pytest.mark.parametrize("args, hint", [(["--formats", "xml"], "--formats"), (["--formats", "free,free"], "--formats"),
                                        (["--batch-sizes", "0"], "--batch-sizes"), (["--rounds", "0"], "--rounds"),
                                        (["--draft", "none"], "--draft"), (["--prompts", "0"], "--prompts")])
def test_bench_structured_refuses_what_it_cannot_run(args, hint, monkeypatch):
    import bench.structured

    monkeypatch.setattr(bench.structured, "run", lambda *a, **k: pytest.fail("the benchmark ran"))
    res = CliRunner().invoke(bench_cli, ["structured", *args])
    assert res.exit_code == 2 and hint in res.output, res.output
