"""Issue #25 with real generation (tiny model, real Ray actors, real files): error rows fixed and
retried exactly once, a corrupt file among good ones (the good rows in flight all land), OpenAI
Batch requests whose max_tokens exceeds the context (400, as OpenAI answers) and with logprobs."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.job_config import JobConfig
from jobs.runner import run_job

from .conftest import read_rows, write_parquet
from .test_job_data import corrupt_column_chunk, prompts

pytestmark = pytest.mark.slow   # Ray actors


def test_error_rows_fixed_in_place_then_retried_exactly_once(tmp_path, tiny_model, local_ray):
    ids = pa.array([10, 11, 12, 13, 14], pa.int64())
    inp = write_parquet(tmp_path / "in.parquet", id=ids, prompt=["the fox", None, "lazy dog", "", "jumps"])
    cfg = JobConfig(input=str(inp), model=tiny_model, draft="none", max_tokens=3, rows_per_file=2)
    m = run_job(cfg)
    assert m["status"] == "completed" and m["rows"] == 5 and m["error_rows"] == 2
    before = {r["id"]: r for r in read_rows(tmp_path / "in.out")}
    write_parquet(tmp_path / "in.parquet", id=ids, prompt=["the fox", "quick brown", "lazy dog", "over the", "jumps"])
    m = run_job(cfg.model_copy(update={"retry_errors": True}))
    rows = read_rows(tmp_path / "in.out")
    assert sorted(r["id"] for r in rows) == [10, 11, 12, 13, 14]                # exactly once, still integers
    by = {r["id"]: r for r in rows}
    assert by[11]["error"] is None and by[13]["error"] is None and by[11]["completion_tokens"] > 0
    assert all(by[i] == before[i] for i in (10, 12, 14))                         # good rows untouched
    assert m["error_rows"] == 0 and m["complete"] and m["runs"][-1]["rows"] == 2
    assert m["runs"][-1]["retried_error_rows"] == 2


def test_a_corrupt_file_among_good_ones(tmp_path, tiny_model, local_ray):
    d = tmp_path / "in"
    d.mkdir()
    for name in ("a", "b", "c"):
        pq.write_table(pa.table({"id": [f"{name}{i}" for i in range(60)], "prompt": prompts(60, seed=ord(name))}),
                       d / f"{name}.parquet", compression="zstd", row_group_size=20)
    corrupt_column_chunk(d / "b.parquet", 1, "prompt")
    m = run_job(JobConfig(input=str(d), model=tiny_model, draft="none", max_tokens=2, max_num_seqs=8,
                          rows_per_file=25))
    rows = read_rows(tmp_path / "in.out")
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == 180 and m["complete"] and m["status"] == "completed"
    bad = [r for r in rows if r["error"]]
    assert bad and all(r["id"].startswith("b") and "b.parquet: row group 1 cannot be read" in r["error"] for r in bad)
    assert all(r["completion_tokens"] for r in rows if not r["error"])      # every good row generated


def test_openai_batch_context_limit_and_logprobs(tmp_path, tiny_model, local_ray):
    chat = {"model": tiny_model, "messages": [{"role": "user", "content": "the fox"}]}
    reqs = [
        {"custom_id": "too-long", "url": "/v1/chat/completions", "body": {**chat, "max_tokens": 100000}},
        {"custom_id": "chat-lp", "url": "/v1/chat/completions",
         "body": {**chat, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}},
        {"custom_id": "cmpl-lp", "url": "/v1/completions", "body": {"prompt": "the lazy dog", "max_tokens": 3,
                                                                     "logprobs": 2}},
        {"custom_id": "plain", "url": "/v1/completions", "body": {"prompt": "the lazy dog", "max_tokens": 3}},
        {"custom_id": "tools", "url": "/v1/chat/completions", "body": {**chat, "tools": [{"type": "function"}]}},
    ]
    inp = tmp_path / "b.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    tmpl = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    m = run_job(JobConfig(input=str(inp), model=tiny_model, draft="none", chat_template=tmpl, max_model_len=128,
                          max_tokens=8))
    by = {x["custom_id"]: x for p in sorted((tmp_path / "b.out").glob("part-*.jsonl"))
          for x in map(json.loads, p.read_text().splitlines())}
    assert m["rows"] == 5 and m["error_rows"] == 2
    err = by["too-long"]["response"]
    assert err["status_code"] == 400 and err["body"]["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 128 tokens" in err["body"]["error"]["message"]
    assert err["body"]["error"]["param"] == "max_tokens"
    assert by["tools"]["response"]["body"]["error"]["param"] == "tools"
    c = by["chat-lp"]["response"]["body"]
    content = c["choices"][0]["logprobs"]["content"]
    assert len(content) == c["usage"]["completion_tokens"] and all(len(t["top_logprobs"]) == 2 for t in content)
    assert "".join(t["token"] for t in content) == c["choices"][0]["message"]["content"]
    assert b"".join(bytes(t["bytes"]) for t in content).decode() == c["choices"][0]["message"]["content"]
    lp = by["cmpl-lp"]["response"]["body"]["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3 or \
        by["cmpl-lp"]["response"]["body"]["choices"][0]["finish_reason"] == "stop"
    assert all(v <= 0 for v in lp["token_logprobs"])
    assert by["plain"]["response"]["body"]["choices"][0]["logprobs"] is None
