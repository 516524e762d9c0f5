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
    with pytest.raises(ValueError, match="not a head folder"):
        resolve_head("gemma-3-270m", str(tmp_path / "missing"))
