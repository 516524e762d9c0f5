"""`eaglectl bench prefix`: its summary from fake runs (no model), the options it refuses, and a smoke run
of every scenario on a tiny model with a head, caching off and on (outputs must not change)."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from bench.prefix import Sizes, run, summarise, table
from eaglectl.bench import bench_prefix


def _rec(wall, ttfts, prompt, cached, out, tokens, tau):
    return {"wall_s": wall, "ttft_s": ttfts, "prompt_tokens": prompt, "cached_tokens": cached, "output_tokens": out,
            "tokens": tokens, "tau": tau}


def test_summary_takes_medians_and_compares_with_caching_off():
    off = [_rec(10.0, [1.0, 2.0, 3.0], 900, 0, 100, [[1], [2], [3]], [(False, 2.0, 10)] * 3),
           _rec(50.0, [9.0, 9.0, 9.0], 900, 0, 100, [[1], [2], [3]], [(False, 2.0, 10)] * 3),   # a slow spell
           _rec(10.0, [1.0, 2.0, 3.0], 900, 0, 100, [[1], [2], [3]], [(False, 2.0, 10)] * 3)]
    on = [_rec(4.0, [0.2, 0.5, 1.0], 900, 600, 100, [[1], [2], [3]], [(False, 2.0, 10), (True, 3.0, 10), (True, 3.0, 30)])
          for _ in range(3)]
    on[1] = {**on[1], "tokens": [[1], [9], [3]]}                                       # one output differs once
    rows = {(r["scenario"], r["caching"]): r for r in summarise({("a", True, False): off, ("a", True, True): on})}
    a_off, a_on = rows[("a", False)], rows[("a", True)]
    assert a_off["total_tok_s"] == 100.0 and a_off["ttft_p50_ms"] == 2000.0 and a_off["hit_rate"] == 0
    assert a_on["total_tok_s"] == 250.0 and a_on["speedup"] == 2.5 and a_on["ttft_p50_gain"] == 4.0
    assert abs(a_on["hit_rate"] - 2 / 3) < 1e-9 and a_on["ttft_p99_ms"] == 1000.0
    assert abs(a_on["same"] - 2 / 3) < 1e-9 and a_off["same"] == 1.0                  # the worst round counts
    assert a_on["tau_hit"] == 3.0 and a_on["tau_miss"] == 2.0 and a_on["tau"] == 2.8     # weighted by tokens
    text = table(list(rows.values()))
    assert "| a | yes | on | 500 | 1000 | 250.0 | 25.0 | 67% | 3.00 / 2.00 | 67% | 2.50x | 4.00x |" in text


def test_bench_prefix_refuses_what_it_cannot_run():
    for args, hint in ((["--scenarios", "a,d"], "--scenarios"), (["--scenarios", ""], "--scenarios"),
                       (["--rounds", "0"], "--rounds"), (["--requests", "0"], "--requests"),
                       (["--dtype", "float16"], "--dtype")):
        res = CliRunner().invoke(bench_prefix, args)
        assert res.exit_code == 2 and hint in res.output, res.output


SMALL = Sizes(requests=4, system_tokens=48, question_tokens=6, conversations=2, turns=2, history_tokens=24, rows=4,
              preamble_tokens=40, max_tokens=6)


def test_smoke_every_scenario_with_and_without_the_head(copying_target, tmp_path):
    target, head = copying_target
    out = tmp_path / "prefix.json"
    rep = run(model=str(target), draft=str(head), scenarios=("a", "b", "c"), rounds=1, sizes=SMALL,
              json_out=str(out), c_runner="engine")
    rows = {(r["scenario"], r["head"], r["caching"]): r for r in rep["rows"]}
    assert set(rows) == {(s, h, c) for s in "abc" for h in (False, True) for c in (False, True)}
    for (scn, head_on, caching), r in rows.items():
        assert r["same"] == 1.0, (scn, head_on, caching)              # greedy: caching never changes the tokens
        assert (r["hit_rate"] > 0) == caching, (scn, head_on, caching, r["hit_rate"])
        assert r["ttft_p50_ms"] is not None                          # c through the engine has TTFT too
    assert rows[("a", True, True)]["tau_hit"] and rows[("a", True, True)]["tau_miss"]   # the first request misses
    assert rows[("b", True, True)]["requests"] == SMALL.conversations * SMALL.turns
    saved = json.loads(out.read_text())
    assert saved["meta"]["c_runner"] == "engine" and len(saved["rows"]) == 12


@pytest.mark.slow   # starts Ray: c through the jobs runner
def test_smoke_the_job_scenario_through_the_jobs_runner(copying_target, tmp_path):
    from bench.prefix import job_has_caching_switch

    if not job_has_caching_switch():
        pytest.skip("the job config has no enable_prefix_caching yet")
    target, _ = copying_target
    rep = run(model=str(target), draft="none", scenarios=("c",), rounds=1, sizes=SMALL, json_out=None, c_runner="job")
    rows = {r["caching"]: r for r in rep["rows"]}
    assert rep["meta"]["c_runner"] == "job"
    assert rows[True]["same"] == 1.0 and rows[True]["hit_rate"] > 0 and rows[False]["hit_rate"] == 0
