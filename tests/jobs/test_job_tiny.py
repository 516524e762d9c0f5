"""Whole jobs on the tiny model with real Ray actors and real Parquet, driven in-process.

Covers: texts equal `LLM.generate`/`LLM.chat` at temperature 0 with per-row overrides, bad rows as
error rows, duplicate ids, --keep-columns, several committed files, OpenAI Batch JSONL in and out,
a replica killed mid-job, cancellation and resume, and replicas that cannot start.
"""
from __future__ import annotations

import json
import threading
import time

import pytest

from jobs.job_config import JobConfig
from jobs.replica_pool import JobFailed
from jobs.runner import JobRunner, run_job

from .conftest import read_manifest, read_rows, write_parquet

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
WORDS = "the quick brown fox jumps over the lazy dog question answer speculative decoding".split()


def prompt(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + i % 5))


def test_job_matches_llm_generate_with_overrides_and_bad_rows(tmp_path, tiny_model, local_ray):
    from eagle_worker import LLM, SamplingParams

    n = 30
    ids = [f"q{i}" for i in range(n)] + ["q3"]                      # q3 twice: generated once
    prompts = [prompt(i) for i in range(n)] + ["dup"]
    messages = [None] * (n + 1)
    max_tokens = [1 + i % 6 for i in range(n)] + [None]
    temperature = [None] * (n + 1)
    top_p = [None] * (n + 1)
    prompts[4] = None                                              # null prompt
    prompts[5] = ""                                                # empty prompt
    prompts[6] = " ".join(["speculative decoding"] * 60)           # longer than max_model_len
    temperature[7] = -1.0                                          # invalid per-row parameter
    top_p[8] = 2.0
    prompts[9], messages[9] = None, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi fox"}]
    prompts[10], messages[10] = None, [{"role": "user", "content": "lazy dog?"}]
    min_p, repetition_penalty = [None] * (n + 1), [None] * (n + 1)
    min_p[12] = 2.0                                                # invalid engine setting, per row
    repetition_penalty[13] = 1.3                                   # a per-row engine setting the flags lack
    inp = write_parquet(tmp_path / "in.parquet", id=ids, prompt=prompts, messages=messages, max_tokens=max_tokens,
                        temperature=temperature, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                        category=[f"c{i % 3}" for i in range(n + 1)],
                        text=[f"source {i}" for i in range(n + 1)])
    cfg = JobConfig(input=str(inp), model=tiny_model, draft="none", max_tokens=6, max_model_len=64,
                    keep_columns=True, rows_per_file=8, chat_template=TEMPLATE, log_interval_s=1)
    m = run_job(cfg)

    rows = {r["id"]: r for r in read_rows(tmp_path / "in.out")}
    assert len(read_rows(tmp_path / "in.out")) == n and set(rows) == set(ids)       # every id exactly once
    # q3's second row (another prompt) is not in the output: not complete (the CLI exits 3)
    assert m["status"] == "completed" and not m["complete"] and m["duplicate_ids_skipped"] == 1
    assert m["rows"] == n and m["error_rows"] == 6, [r for r in rows.values() if r["error"]]
    assert len(list((tmp_path / "in.out").glob("part-*.parquet"))) >= 4
    assert rows["q4"]["error"] == "prompt is null" and rows["q5"]["error"] == "prompt is empty"
    assert "maximum context length is 64 tokens" in rows["q6"]["error"] and "temperature" in rows["q7"]["error"]
    assert "top_p" in rows["q8"]["error"] and "min_p must be in [0, 1]" in rows["q12"]["error"]
    for bad in ("q4", "q5", "q6", "q7", "q8", "q12"):
        assert rows[bad]["text"] is None and rows[bad]["completion_tokens"] is None
    assert rows["q3"]["prompt"] == prompt(3)                        # the first row with a duplicated id
    assert rows["q11"]["category"] == "c2" and rows["q11"]["input_text"] == "source 11"

    llm = LLM(model=tiny_model, max_model_len=64, chat_template=TEMPLATE)
    good = [i for i in range(n) if i not in (4, 5, 6, 7, 8, 9, 10, 12)]
    expect = llm.generate([prompt(i) for i in good], [SamplingParams(
        max_tokens=max_tokens[i], temperature=0.0, repetition_penalty=repetition_penalty[i] or 1.0) for i in good])
    for i, out in zip(good, expect):
        r = rows[f"q{i}"]
        assert r["error"] is None and r["text"] == out.text and r["completion_tokens"] == len(out.token_ids), \
            (i, r, out.text, out.token_ids)
        assert r["completion_tokens"] == max_tokens[i] or r["finish_reason"] == "stop"
        assert r["prompt_tokens"] == len(out.prompt_token_ids) and r["accepted_tokens_per_step"] == 1.0
        assert 0 < r["ttft_s"] <= r["latency_s"]                     # the engine's times of the row
    assert rows["q4"]["ttft_s"] is None and rows["q4"]["latency_s"] is None
    chats = llm.chat([messages[9], messages[10]], [SamplingParams(max_tokens=max_tokens[9], temperature=0.0),
                                                   SamplingParams(max_tokens=max_tokens[10], temperature=0.0)])
    assert rows["q9"]["text"] == chats[0].text and rows["q10"]["text"] == chats[1].text, (rows["q9"], rows["q10"], chats)

    again = run_job(cfg)                                  # a finished job: nothing to do, no model load
    assert again["last_noop_rerun"]["skipped_already_done"] == n       # recorded, without a "0 rows" run
    assert [r["run_id"] for r in again["runs"]] == [r["run_id"] for r in m["runs"]] and again["runs"][-1]["rows"] == n
    assert m["prefix_cache"]["prompt_tokens"] > 0 and again["prefix_cache"] == m["prefix_cache"]
    assert len(read_rows(tmp_path / "in.out")) == n

    # a part deleted by hand: its rows run again, and the prefix-cache totals count them once (they
    # were carried from the earlier manifest and added to again)
    first = sorted((tmp_path / "in.out").glob("part-*.parquet"))[0]
    first.unlink()
    redone = run_job(cfg)
    assert len(read_rows(tmp_path / "in.out")) == n and redone["runs"][-1]["rows"] == 8
    assert first.name not in redone["prefix_cache_by_part"]
    assert redone["prefix_cache"]["prompt_tokens"] == m["prefix_cache"]["prompt_tokens"]
    manifest = tmp_path / "in.out" / "_manifest.json"           # as written before counts by part
    doc = json.loads(manifest.read_text())
    del doc["prefix_cache_by_part"]
    manifest.write_text(json.dumps(doc))
    assert run_job(cfg)["prefix_cache"] == redone["prefix_cache"]     # its totals carried


def test_openai_batch_jsonl_job(tmp_path, tiny_model, local_ray):
    reqs = [
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": tiny_model, "messages": [{"role": "user", "content": "the fox"}], "max_tokens": 3}},
        {"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "the lazy dog", "max_tokens": 2, "temperature": 0}},
        {"custom_id": "other-model", "method": "POST", "url": "/v1/completions",
         "body": {"model": "gpt-4o", "prompt": "the lazy dog", "max_tokens": 2}},
        {"custom_id": "bad-temp", "method": "POST", "url": "/v1/completions",
         "body": {"model": "tiny", "prompt": "x", "temperature": -3}},
        {"custom_id": "bad-n", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 3}},
        {"custom_id": "cut", "method": "POST", "url": "/v1/completions",      # kept: what fits beside max_tokens
         "body": {"prompt": "the lazy dog " * 100, "max_tokens": 2, "truncate_prompt_tokens": -1}},
        {"custom_id": "uncut", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "the lazy dog " * 100, "max_tokens": 2}},
        {"custom_id": "loop-format", "method": "POST", "url": "/v1/completions",   # compiles, but produces nothing:
         "body": {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {   # the replica refuses it
             "name": "loop", "schema": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}}},
    ]
    inp = tmp_path / "batch.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    m = run_job(JobConfig(input=str(inp), model=tiny_model, draft="none", chat_template=TEMPLATE, max_tokens=4,
                          max_model_len=64))
    assert m["format"] == "openai-batch" and m["rows"] == 8 and m["error_rows"] == 5
    lines = [json.loads(x) for p in sorted((tmp_path / "batch.out").glob("part-*.jsonl"))
             for x in p.read_text().splitlines()]
    by = {x["custom_id"]: x for x in lines}
    assert sorted(by) == sorted(r["custom_id"] for r in reqs) and len(lines) == 8
    chat = by["chat-1"]["response"]
    assert chat["status_code"] == 200 and chat["body"]["object"] == "chat.completion"
    assert chat["body"]["model"] == tiny_model and chat["body"]["usage"]["completion_tokens"] <= 3
    assert isinstance(chat["body"]["choices"][0]["message"]["content"], str)
    assert by["cmpl-1"]["response"]["body"]["object"] == "text_completion"
    assert by["cmpl-1"]["response"]["body"]["model"] == tiny_model            # no `model`: the job's
    other = by["other-model"]["response"]["body"]["error"]
    assert other["code"] == "model_not_found" and other["param"] == "model" and "'gpt-4o' does not exist" in other["message"]
    assert by["bad-temp"]["response"]["status_code"] == 400
    assert "temperature" in by["bad-temp"]["response"]["body"]["error"]["message"]
    assert "n must be 1" in by["bad-n"]["response"]["body"]["error"]["message"]
    assert by["cut"]["response"]["body"]["usage"] == {"prompt_tokens": 62, "completion_tokens": 2, "total_tokens": 64}
    assert by["uncut"]["response"]["body"]["error"]["code"] == "context_length_exceeded"
    loop = by["loop-format"]["response"]["body"]["error"]      # in the field the request used, as over HTTP
    assert loop["param"] == "response_format", loop
    assert loop["message"].startswith("response_format: json_schema: the grammar cannot produce any output"), loop


def _run_in_thread(runner: JobRunner):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("manifest", runner.run()), daemon=True)
    t.start()
    return t, box


def _wait(cond, timeout=120.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.05)


def test_replica_death_then_cancel_then_resume(tmp_path, tiny_model, local_ray):
    n = 240
    inp = write_parquet(tmp_path / "in.parquet", prompt=[prompt(i) for i in range(n)])
    cfg = JobConfig(input=str(inp), model=tiny_model, draft="none", max_tokens=12, max_num_seqs=8,
                    rows_per_file=20, replicas=1, cpus_per_replica=1)
    runner = JobRunner(cfg)
    thread, box = _run_in_thread(runner)
    _wait(lambda: runner.stats.rows >= 20)
    victim = runner.pool.replicas[0]
    lost = victim.in_flight
    local_ray.kill(victim.actor, no_restart=True)                  # the replica dies mid-job
    _wait(lambda: runner.stats.rows >= 120)
    assert runner.pool.restarts_left == cfg.replica_restarts - 1 and lost > 0
    # a batch and a few rows queued, not a second whole batch that would wait behind the first
    assert lost <= cfg.in_flight_per_replica and cfg.max_num_seqs < cfg.in_flight_per_replica < 2 * cfg.max_num_seqs
    runner.stopping = "test"                                        # what SIGTERM / `job cancel` does
    thread.join(60)
    m = box["manifest"]
    assert m["status"] == "cancelled" and 120 <= m["rows"] < n and m["error_rows"] == 0
    committed = m["rows"]

    m2 = run_job(cfg)                                              # the same job again: resumes
    rows = read_rows(tmp_path / "in.out")
    ids = [r["id"] for r in rows]
    assert len(ids) == n and set(ids) == {f"in.parquet:{i}" for i in range(n)}
    assert m2["status"] == "completed" and m2["complete"] and m2["error_rows"] == 0
    assert m2["runs"][-1]["skipped_already_done"] == committed and m2["runs"][-1]["rows"] == n - committed
    assert [r["status"] for r in m2["runs"]] == ["cancelled", "completed"]
    assert [r["stopped_by"] for r in m2["runs"]] == ["test", None]


def test_replicas_that_cannot_start_fail_the_job_clearly(tmp_path, local_ray):
    inp = write_parquet(tmp_path / "in.parquet", prompt=["a", "b"])
    cfg = JobConfig(input=str(inp), model=str(tmp_path / "no-such-model"), draft="none", max_replica_restarts=0)
    with pytest.raises(JobFailed, match="no-such-model"):
        run_job(cfg)
    m = read_manifest(tmp_path / "in.out")
    assert m["status"] == "failed" and "no-such-model" in m["error"] and m["rows"] == 0


def test_engine_crash_process_death_and_a_hung_step_are_retried_once(tmp_path, local_ray):
    """The cluster layer's fake engine injects faults: `[crash-once:F:N]` makes the engine loop raise
    (the actor lives on with a dead engine), `[die-once:F:N]` kills the replica process, and
    `[hang-once:F:N]` makes a step sleep an hour (the pool's health checks see it pass
    step_timeout_s). Every replica is replaced, their rows are sent again, and every row ends
    exactly once without error."""
    n = 60
    prompts = [f"row {i} [slow:0.01]" for i in range(n)]
    prompts[10] += f" [crash-once:{tmp_path / 'crashed'}:2]"
    prompts[25] += f" [hang-once:{tmp_path / 'hung'}:2]"
    prompts[40] += f" [die-once:{tmp_path / 'died'}:2]"
    inp = write_parquet(tmp_path / "in.parquet", prompt=prompts)
    cfg = JobConfig(input=str(inp), engine="tests.cluster.fake_engine", model="fake", draft="none",
                    max_tokens=4, max_num_seqs=4, max_in_flight=8, rows_per_file=7, step_timeout_s=1)
    runner = JobRunner(cfg)
    m = runner.run()
    assert (tmp_path / "crashed").exists() and (tmp_path / "died").exists() and (tmp_path / "hung").exists()
    ids = [r["id"] for r in read_rows(tmp_path / "in.out")]
    assert sorted(ids) == sorted(f"in.parquet:{i}" for i in range(n))
    assert m["complete"] and m["error_rows"] == 0
    assert runner.pool is not None and runner.pool.restarts_left == cfg.replica_restarts - 3


def test_a_replica_the_engine_refuses_fails_the_job_at_once(tmp_path, local_ray):
    """Settings the engine refuses (here a TP size the model's 4 heads cannot be split into) fail the
    job at the first replica's start, with the engine's reason, instead of restarting replicas."""
    inp = write_parquet(tmp_path / "in.parquet", prompt=["a", "b"])
    from tests.conftest import save_tiny_model

    model = save_tiny_model("llama", tmp_path / "tiny")
    cfg = JobConfig(input=str(inp), model=str(model), draft="none", tp_size=3, cpus_per_replica=0.5)
    started = time.monotonic()
    with pytest.raises(JobFailed, match="a restart cannot fix this") as failure:
        run_job(cfg)
    assert "tensor-parallel size 3" in str(failure.value) and time.monotonic() - started < 120
    m = read_manifest(tmp_path / "in.out")
    assert m["status"] == "failed" and "a restart cannot fix this" in m["error"]


def test_a_tp2_job_with_a_head_speculates_and_matches_llm_generate(tmp_path, copying_target, local_ray):
    """`submit-job --tp-size 2` with a draft head and a fixed tree (`speculation`): each replica is a
    TP group speculating every step; the rows are `LLM.generate`'s greedy texts and the head, which
    drafts this target's own bigrams, is accepted far beyond one token per target step. (The default
    hybrid sizes trees from measured costs: on a tiny model the tree's own bookkeeping outweighs
    the model, and it rightly drafts little, so it cannot show that the TP path speculates.)"""
    from cluster.config_sections import SpeculationConfig
    from eagle_worker import LLM, SamplingParams

    target, head = copying_target
    prompts = [prompt(i) for i in range(6)]
    want = [o.text for o in LLM(model=str(target), draft=None).generate(
        prompts, SamplingParams(max_tokens=24, temperature=0.0))]
    inp = write_parquet(tmp_path / "in.parquet", prompt=prompts)
    cfg = JobConfig(input=str(inp), model=str(target), draft=str(head), tp_size=2, cpus_per_replica=0.5,
                    max_tokens=24, temperature=0.0, speculation=SpeculationConfig(adaptive=False, lookup=False))
    m = run_job(cfg)
    assert m["status"] == "completed" and m["error_rows"] == 0
    rows = sorted(read_rows(tmp_path / "in.out"), key=lambda r: int(r["id"].rsplit(":", 1)[1]))
    assert [r["text"] for r in rows] == want
    assert sum(r["accepted_tokens_per_step"] for r in rows) / len(rows) > 2.0     # 2.9 here
