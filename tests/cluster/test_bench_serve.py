"""`bench.serve.run(url=...)` against a live endpoint (the fake engine, so it takes seconds): the report
has every vLLM-style number per concurrency level, the JSON is written and the table printed."""
from __future__ import annotations

import json

import pytest

from bench.serve import markdown, resolve_head, run
from cluster.config import ServeConfig
from tests.cluster.conftest import FAKE


def test_bench_serve_against_an_endpoint(deploy, tmp_path, capsys):
    cfg = ServeConfig(model="fake", engine=FAKE, app_name="bench", num_replicas=1, resources_per_rank={"cpu": 0.25},
                      limits={"max_model_len": 256, "max_tokens": 64})
    app = deploy(cfg, "/bench")
    out = tmp_path / "serve.json"
    report = run(url=f"{app.url}/v1", concurrencies=(1, 3), num_prompts=2, max_tokens=6, json_out=str(out),
                 prompts=[f"[slow:0.01] question {i}" for i in range(4)])  # slow steps: one token per chunk
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    rows = report["results"]
    assert [(r["setup"], r["concurrency"], r["num_prompts"]) for r in rows] == [("endpoint", 1, 2), ("endpoint", 3, 3)]
    for r in rows:
        assert r["completed"] == r["num_prompts"] and r["failed"] == 0, r
        assert r["total_output_tokens"] == 6 * r["num_prompts"]
        assert r["request_throughput"] > 0 and r["output_throughput"] > 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            s = r[key]
            assert 0 < s["median"] <= s["p99"] and s["mean"] > 0, (key, s)
    printed = capsys.readouterr().out
    assert markdown(rows) in printed and "TTFT mean / med / p99" in printed


def test_resolve_head(tmp_path):
    assert resolve_head("gemma-3-270m", None)[0] is None
    head, note = resolve_head("no-such-model", "default")
    assert head is None and "ran without the draft head" in note
    (tmp_path / "config.json").write_text("{}")
    assert resolve_head("gemma-3-270m", str(tmp_path)) == (str(tmp_path.resolve()), None)
    with pytest.raises(ValueError, match="not a folder"):            # the engine's rule (bench/preflight.py)
        resolve_head("gemma-3-270m", str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a head folder"):
        resolve_head("gemma-3-270m", str(tmp_path / "empty"))


def _bench_subprocess(tmp_path, code: str) -> str:
    """A benchmark in its own process and Ray (as `eaglectl bench` runs it), bounded by a timeout."""
    import os
    import subprocess
    import sys

    from tests.cluster.conftest import REPO

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, text=True, capture_output=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


SHORT = [f"Question {i}: what comes next?" for i in range(6)]


@pytest.mark.slow   # Ray, Serve and a tiny real model in a subprocess
def test_bench_serve_measures_http_against_the_engine_with_the_same_threads(tmp_path, tiny_model_dir):
    out = tmp_path / "serve.json"
    _bench_subprocess(tmp_path, f"""
from bench.serve import run
run(model={str(tiny_model_dir("llama"))!r}, concurrencies=(1, 2), num_prompts=2, max_tokens=4, draft="none",
    json_out={str(out)!r}, threads=1, prompts={SHORT!r}, rounds=2)
""")
    report = json.loads(out.read_text())
    rows = {(r["setup"], r["concurrency"], r["round"]): r for r in report["results"]}
    assert set(rows) == {(s, c, k) for s in ("engine", "plain") for c in (1, 2) for k in (0, 1)}
    assert report["meta"]["threads"] == 1 and rows[("engine", 1, 0)]["threads"] == 1
    for r in rows.values():
        assert r["completed"] == r["num_prompts"] == 2 and r["total_output_tokens"] == 8, r
    for c in (1, 2):     # each round's HTTP level against that round's engine level
        ratios = [rows[("plain", c, k)]["output_throughput"] / rows[("engine", c, k)]["output_throughput"] for k in (0, 1)]
        assert [rows[("plain", c, k)]["vs_engine"] for k in (0, 1)] == pytest.approx(ratios)
        assert report["vs_engine_median"][str(c)] == pytest.approx(sum(ratios) / 2)


@pytest.mark.slow
def test_bench_mixed_runs_online_load_and_a_job_through_one_app(tmp_path, tiny_model_dir):
    out = tmp_path / "mixed.json"
    stdout = _bench_subprocess(tmp_path, f"""
from bench.mixed import run
run(model={str(tiny_model_dir("llama"))!r}, rows=12, online_requests=4, concurrency=2, max_tokens=6,
    max_num_seqs=4, threads=1, json_out={str(out)!r}, prompts={SHORT!r})
""")
    report = json.loads(out.read_text())
    phases = {r["phase"]: r for r in report["summary"]}
    assert set(phases) == {"online alone", "job alone", "online + job"}
    assert phases["online alone"]["online_done"] == "4/4" and phases["online + job"]["online_done"] == "4/4"
    assert phases["job alone"]["job_rows"] == phases["online + job"]["job_rows"] == 12
    assert phases["job alone"]["job_error_rows"] == 0 and phases["job alone"]["job_rows_per_s"] > 0
    assert report["counters_during_mixed"]["offline_finished"] == 12
    assert report["counters_during_mixed"]["online_finished"] >= 1
    assert "| online + job |" in stdout
