"""`eaglectl bench mixed`: online traffic and an offline job on one serving app.

One app is started on this machine (Ray + Serve, one replica on `threads` torch threads, as
`eaglectl bench serve` starts it). Three phases, same prompts and settings:

  1. online alone: `online_requests` streamed `/v1/completions` (Spec-Bench questions, greedy,
     ignore_eos), at most `concurrency` in flight (closed loop, as `bench serve` measures);
  2. the job alone: `rows` Spec-Bench rows (the `bench job` input) through the app with
     `jobs.runner` and `serve_app` (what `eaglectl submit-job --serve-app` runs): rows/s over the
     job's generation time;
  3. both: the same job again, and once its rows run, the same online load beside it.

Reported: online TTFT / TPOT (median, p99) and output tok/s alone vs with the job; the job's rows/s
alone vs with the online load; whether the job was still running when the online load ended (if
not, the "with job" numbers cover only part of the load); and the counters that show the job's rows
made way: the router's offline rows held back (`offline_deferred`), the replica's offline rows
preempted / deferred in the engine (cluster/priority_stats.py), and the offline rows the engine left
out of a step or cut short to keep online steps within `offline_slowdown` (`num_offline_held`).
Usage: `eaglectl bench mixed [--rows 20 --online-requests 4]`.
"""
from __future__ import annotations

import os
import platform
import tempfile
import threading
import time
from pathlib import Path

import requests

from bench.job import completed_run, write_input
from bench.prompts import load_questions, render
from bench.report_file import run_meta, write_json
from bench.serve import (
    _RAY,
    _fmt,
    _free_port,
    _served_model,
    _start_local,
    _stream_one,
    bench_level,
    ingress_label,
)

APP = "bench-mixed"
COUNTERS = ("offline_finished", "online_finished", "offline_preemptions", "offline_rows_preempted",
            "offline_deferred_in_engine", "num_offline_held")


def _replica_counters(app: str) -> dict[str, int]:
    from ray import serve

    st = serve.get_deployment_handle("LLMServer", app_name=app).stats.remote().result(timeout_s=120)
    return {k: int(st.get(k) or 0) for k in COUNTERS + ("num_running",)}


def _job(inp: Path, out: Path, max_tokens: int, app: str) -> dict:
    """The job through the app (jobs.runner, serve_app): its rows, error rows and generation time."""
    from jobs.job_config import JobConfig
    from jobs.runner import run_job

    t0 = time.perf_counter()
    m = run_job(JobConfig(input=str(inp), output=str(out), serve_app=app, max_tokens=max_tokens,
                          temperature=0.0, overwrite=True))
    wall = time.perf_counter() - t0
    run = completed_run(m, out.stem)
    gen_s = run.get("generation_s") or run["wall_s"]
    return {"rows": m["rows"], "error_rows": m["error_rows"], "generation_s": gen_s, "wall_s": wall,
            "rows_per_s": m["rows"] / gen_s, "completion_tokens": run.get("completion_tokens"),
            "output_tokens_per_s": (run.get("completion_tokens") or 0) / gen_s, "ended_at": time.perf_counter()}


def _online(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    row = bench_level(url, model, prompts, concurrency, max_tokens)
    row["ended_at"] = time.perf_counter()
    return row


def _summary_row(name: str, online: dict | None, job: dict | None) -> dict:
    out = {"phase": name}
    if online:
        out.update(online_done=f"{online['completed']}/{online['num_prompts']}", online_tok_s=online["output_throughput"],
                   ttft_p50_ms=online["ttft_ms"]["median"], ttft_p99_ms=online["ttft_ms"]["p99"],
                   tpot_p50_ms=online["tpot_ms"]["median"], tpot_p99_ms=online["tpot_ms"]["p99"])
    if job:
        out.update(job_rows=job["rows"], job_error_rows=job["error_rows"], job_rows_per_s=job["rows_per_s"])
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| phase | online done | online tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | job rows | job rows/s |",
             "|---|---|---:|---|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['phase']} | {r.get('online_done', '-')} | {_fmt(r.get('online_tok_s'), 2)} "
                     f"| {_fmt(r.get('ttft_p50_ms'), 0)} / {_fmt(r.get('ttft_p99_ms'), 0)} "
                     f"| {_fmt(r.get('tpot_p50_ms'), 0)} / {_fmt(r.get('tpot_p99_ms'), 0)} "
                     f"| {r.get('job_rows', '-')} | {_fmt(r.get('job_rows_per_s'), 2)} |")
    return "\n".join(lines)


def run(model: str = "gemma-3-270m", rows: int = 200, online_requests: int = 16, concurrency: int = 4,
        max_tokens: int = 32, draft: str | None = None, dtype: str = "float32", max_num_seqs: int = 16,
        threads: int | None = None, json_out: str | None = "bench/results/mixed.json",
        prompts: list[str] | None = None, colocate: bool | None = None, offline_slowdown: float | None = 0.25) -> dict:
    from cluster.app_client import AppClient
    from cluster.cpu_threads import usable_cores

    threads = int(threads or usable_cores())
    pool = list(prompts) if prompts else [render(q) for q in load_questions()]
    online_prompts = [pool[(7 * i + 3) % len(pool)] for i in range(online_requests)]   # not the job's first rows
    port = _free_port()
    report: dict = {}
    try:
        url = _start_local(model, draft, APP, port, max_num_seqs=max_num_seqs, max_tokens=max_tokens, dtype=dtype,
                           threads=threads, colocate=colocate, offline_slowdown=offline_slowdown)
        served = _served_model(url)
        warm = _stream_one(requests.Session(), url, served, pool[0], 4, 600)
        if not warm["ok"]:
            raise RuntimeError(f"warm-up request failed: {warm['error']}")
        with tempfile.TemporaryDirectory(prefix="bench-mixed-") as tmp:
            inp = Path(tmp) / "rows.parquet"
            if prompts is None:
                write_input(inp, rows)
            else:
                _write_prompts(inp, pool, rows)
            print(f"bench mixed: online alone ({online_requests} requests, concurrency {concurrency})", flush=True)
            alone = _online(url, served, online_prompts, concurrency, max_tokens)
            print(f"bench mixed: the job alone ({rows} rows)", flush=True)
            job_alone = _job(inp, Path(tmp) / "alone.out", max_tokens, APP)
            print("bench mixed: the job with the online load beside it", flush=True)
            before, deferred0 = _replica_counters(APP), AppClient.router_counters()["offline_deferred"]
            mixed: dict = {}
            job_done = threading.Event()

            def online_beside_job():
                while not job_done.is_set():   # once the job's rows run, the online load starts
                    st = _replica_counters(APP)
                    if st["num_running"] or st["offline_finished"] > before["offline_finished"]:
                        break
                    time.sleep(0.1)
                mixed["online"] = _online(url, served, online_prompts, concurrency, max_tokens)
            side = threading.Thread(target=online_beside_job, daemon=True)
            side.start()
            try:
                job_mixed = _job(inp, Path(tmp) / "mixed.out", max_tokens, APP)
            finally:
                job_done.set()
            side.join(900)
            after = _replica_counters(APP)
        with_job = mixed.get("online")
        counters = {k: after[k] - before[k] for k in COUNTERS}
        counters["router_offline_deferred"] = AppClient.router_counters()["offline_deferred"] - deferred0
        summary = [_summary_row("online alone", alone, None), _summary_row("job alone", None, job_alone),
                   _summary_row("online + job", with_job, job_mixed)]
        notes = []
        if with_job is None or with_job["ended_at"] > job_mixed["ended_at"]:
            notes.append("the job ended before the online load did: 'online + job' covers only part of it")
        report = {"meta": {"model": model, "draft": draft, "dtype": dtype, "rows": rows, "online_requests": online_requests,
                           "concurrency": concurrency, "max_tokens": max_tokens, "max_num_seqs": max_num_seqs,
                           "threads": threads, "ingress": ingress_label(colocate), "offline_slowdown": offline_slowdown,
                           "cpus": os.cpu_count(), "machine": platform.machine(),
                           "job_path": "jobs.runner with serve_app (eaglectl submit-job --serve-app)", "notes": notes,
                           "prefix_caching": False, **run_meta()},
                  "summary": summary, "counters_during_mixed": counters,
                  "online_alone": alone, "online_with_job": with_job, "job_alone": job_alone, "job_with_online": job_mixed}
        print(markdown(summary), flush=True)
        print("counters while both ran: " + ", ".join(f"{k} {v}" for k, v in counters.items()), flush=True)
        for n in notes:
            print(f"note: {n}", flush=True)
    finally:
        try:
            from ray import serve

            serve.delete(APP)
        except Exception:  # noqa: BLE001 - nothing deployed, or Ray gone
            pass
        _RAY.shutdown()
    if json_out:
        write_json(json_out, report)
    return report


def _write_prompts(path: Path, pool: list[str], rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": [f"r{i}" for i in range(rows)], "prompt": [pool[i % len(pool)] for i in range(rows)]}),
                   path)


if __name__ == "__main__":       # the benchmarks' options live in one place, the CLI
    raise SystemExit("run this benchmark as `eaglectl bench mixed [OPTIONS]` (`eaglectl bench mixed --help`)")
