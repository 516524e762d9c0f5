"""Online serving benchmark over HTTP, reported the way `vllm bench serve` reports.

For each setup (plain decoding, then with the EAGLE draft head) and each concurrency level, send
`max(num_prompts, concurrency)` Spec-Bench prompts through `/v1/completions` with `stream: true`,
at most `concurrency` in flight (closed loop, like `vllm bench serve --max-concurrency`), greedy,
`ignore_eos` so every request generates exactly `max_tokens` tokens. Per level:

  * request throughput (req/s) and output token throughput (tok/s) = completed / wall time;
  * TTFT: request sent -> first streamed token;
  * TPOT: (latency - TTFT) / (output tokens - 1), per request;
  * ITL: gaps between consecutive streamed chunks. As in vLLM, a chunk may carry several tokens (an
    EAGLE step accepts a few at once), so ITL is per chunk while TPOT is per token;
  * tau: the server's mean accepted tokens per target forward over the level (from /metrics).

Mean, median and p99 in milliseconds. Without `url`, the app is started here (Ray + Serve on this
machine, `cluster.serve_app.run_serve(..., blocking=False)`), once without and once with the head;
with `url`, the endpoint is measured as it is (one setup).

Against the engine (without `url`): before any Ray starts, the same prompts go through the engine
itself (`LLM.generate`, no head, the replica's engine settings) in this process, `concurrency` at a
time, with the torch thread count the replica gets (`--threads`, default every core: the replica is
given `resources_per_rank.threads` = that, so both compute on the same cores), and each HTTP level
of the plain setup reports `vs_engine` = its output tok/s / the engine's. Usage: `eaglectl bench
serve [--num-prompts 4 --max-tokens 16]`.
"""
from __future__ import annotations

import json
import os
import platform
import re
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from bench.prompts import load_questions, render
from bench.report_file import run_meta, write_json
from cluster.local_ray import StartedRay

STAT_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")


# ---- one request -----------------------------------------------------------------------------
def _stream_one(session: requests.Session, url: str, model: str, prompt: str, max_tokens: int,
                timeout: float) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    chunks: list[float] = []
    out_tokens, error = None, None
    try:
        with session.post(f"{url}/v1/completions", json=body, stream=True, timeout=timeout) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}: {r.text[:200]}"}
            for line in r.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    error = msg["error"].get("message", str(msg["error"]))
                    break
                if msg.get("usage"):
                    out_tokens = msg["usage"]["completion_tokens"]
                if msg.get("choices") and msg["choices"][0].get("text"):
                    chunks.append(time.perf_counter())
    except requests.RequestException as e:
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    if error or not chunks:
        return {"ok": False, "error": error or "no tokens streamed"}
    n = out_tokens if out_tokens is not None else len(chunks)
    ttft = chunks[0] - t0
    return {"ok": True, "output_tokens": n, "ttft_ms": 1e3 * ttft, "e2el_ms": 1e3 * (end - t0),
            "tpot_ms": 1e3 * (end - t0 - ttft) / (n - 1) if n > 1 else None,
            "itl_ms": [1e3 * (b - a) for a, b in zip(chunks, chunks[1:])]}


def _summary(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, max(0, round(0.99 * (len(ordered) - 1))))] if len(ordered) > 1 else ordered[0]
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "p99": p99}


def _tau_counters(url: str) -> tuple[float, float]:
    """(sum, count) of the server's per-request tau histogram; (0, 0) when unavailable."""
    try:
        text = requests.get(f"{url}/metrics", timeout=10).text
    except requests.RequestException:
        return 0.0, 0.0

    def total(name):
        return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))
    return total("eagle_generation_tokens_total"), total("eagle_target_forwards_total")


def bench_level(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
                timeout: float = 600) -> dict:
    """One concurrency level: all prompts, at most `concurrency` in flight."""
    local = threading.local()

    def one(prompt):
        if not hasattr(local, "session"):
            local.session = requests.Session()
        return _stream_one(local.session, url, model, prompt, max_tokens, timeout)

    tokens0, forwards0 = _tau_counters(url)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, prompts))
    duration = time.perf_counter() - t0
    tokens1, forwards1 = _tau_counters(url)
    ok = [r for r in results if r["ok"]]
    out_tokens = sum(r["output_tokens"] for r in ok)
    row = {"concurrency": concurrency, "num_prompts": len(prompts), "completed": len(ok),
           "failed": len(results) - len(ok), "duration_s": duration,
           "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
           "total_output_tokens": out_tokens,
           "tau": (tokens1 - tokens0) / (forwards1 - forwards0) if forwards1 > forwards0 else None,
           "errors": sorted({r["error"] for r in results if not r["ok"]})[:5]}
    for key in STAT_KEYS:
        vals = [v for r in ok for v in (r[key] if isinstance(r[key], list) else [r[key]]) if v is not None]
        row[key] = _summary(vals)
    return row


# ---- setups ----------------------------------------------------------------------------------
def resolve_head(model: str, draft: str | None) -> tuple[str | None, str | None]:
    """(head to use or None, a note saying why there is none)."""
    if draft in (None, "", "none"):
        return None, "draft head disabled: plain decoding only"
    if draft == "default":
        from eagle_worker.speculative.config import HEADS_DIR

        if (HEADS_DIR / model / "config.json").exists():
            return "default", None
        return None, (f"no draft head shipped for {model} ({HEADS_DIR / model}/config.json missing) and none "
                      "passed in: ran without the draft head only")
    from bench.preflight import check_draft

    head = check_draft(draft, model)          # the engine's rule, as the CLI checked it before anything started
    if head is None:
        return None, f"no draft head for {model} ({draft!r}): plain decoding only"
    return str(Path(head).resolve()), None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_RAY = StartedRay()  # the Ray this benchmark started, if any: it goes when the run ends


def local_config(model: str, draft: str | None, name: str, port: int, max_num_seqs: int, max_tokens: int,
                 dtype: str, threads: int, stream_interval: int = 1, direct_ingress: bool = False,
                 colocate: bool | None = None, offline_slowdown: float | None = 0.25):
    """The app this benchmark starts: one replica computing on `threads` torch threads (with the
    ingress in its process unless `colocate` is False), without prefix caching (what the benchmarks
    compare is decoding and serving; `bench prefix` measures caching)."""
    from cluster.config import ServeConfig

    return ServeConfig(model=model, draft=draft, dtype=dtype, app_name=name, port=port, num_replicas=1,
                       enable_prefix_caching=False,   # rounds and phases repeat prompts: no cache hits between them
                       resources_per_rank={"cpu": 1, "threads": threads}, offline_slowdown=offline_slowdown,
                       ingress={"stream_interval": stream_interval, "direct": direct_ingress, "colocate": colocate},
                       limits={"max_num_seqs": max_num_seqs, "max_queued_requests": max_num_seqs,
                               "max_tokens": max(max_tokens, 16)})


def ingress_label(colocate: bool | None) -> str:
    """Where the started app's ingress runs, for the reports."""
    return "separate" if colocate is False else "colocated (one replica)"


def _start_local(model: str, draft: str | None, name: str, port: int, max_num_seqs: int, max_tokens: int,
                 dtype: str, threads: int, stream_interval: int = 1, direct_ingress: bool = False,
                 colocate: bool | None = None, offline_slowdown: float | None = 0.25) -> str:
    """Deploy the app on this machine's Ray (started here if needed); its base URL."""
    from cluster.serve_app import local_ray_env, run_serve

    cfg = local_config(model, draft, name, port, max_num_seqs, max_tokens, dtype, threads, stream_interval, direct_ingress,
                       colocate, offline_slowdown)
    if not os.environ.get("RAY_ADDRESS"):   # as `eaglectl serve` starts its Ray (run_serve)
        os.environ.update(local_ray_env(cfg))
    _RAY.start(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False,
               namespace="eagle-bench", log_to_driver=False, logging_level="WARNING")
    return run_serve(cfg, blocking=False)


def load_engine(cfg, threads: int):
    """`LLM` with `cfg`'s engine settings on `threads` torch threads, warmed up."""
    import torch

    from eagle_worker import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(**cfg.engine_kwargs())
    llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))   # warm-up
    return llm


def engine_levels(llm, prompts_for, concurrencies: tuple[int, ...], max_tokens: int, rnd: int = 0) -> list[dict]:
    """The same prompts through the engine in this process (`LLM.generate`, `concurrency` at a time,
    greedy, ignore_eos)."""
    import torch

    from eagle_worker import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for c in concurrencies:
        prompts = prompts_for(c)
        t0 = time.perf_counter()
        outs = [o for i in range(0, len(prompts), c) for o in llm.generate(prompts[i:i + c], sp)]
        duration = time.perf_counter() - t0
        n = sum(len(o.token_ids) for o in outs)
        row = {"setup": "engine", "draft": None, "concurrency": c, "round": rnd, "num_prompts": len(prompts),
               "completed": len(outs), "failed": 0, "duration_s": duration, "request_throughput": len(outs) / duration,
               "output_throughput": n / duration, "total_output_tokens": n, "tau": None, "errors": [],
               "threads": torch.get_num_threads()}
        for key, metric in (("ttft_ms", "ttft_s"), ("tpot_ms", "tpot_s"), ("e2el_ms", "latency_s")):
            row[key] = _summary([1e3 * o.metrics[metric] for o in outs if (o.metrics or {}).get(metric) is not None])
        row["itl_ms"] = _summary([])
        rows.append(row)
        print(f"bench serve: engine c={c} round {rnd}: {n / duration:.2f} out tok/s ({row['threads']} threads)",
              flush=True)
    return rows


def _http_level(name: str, draft: str | None, base: str, served: str, prompts: list[str], c: int, max_tokens: int,
                timeout: float, rnd: int, engine_row: dict | None) -> dict:
    row = bench_level(base, served, prompts, c, max_tokens, timeout=timeout)
    row.update(setup=name, draft=draft, round=rnd)
    if name == "plain":
        row["tau"] = None  # no speculation: tokens per forward says nothing there
        if engine_row and engine_row["output_throughput"]:
            row["vs_engine"] = row["output_throughput"] / engine_row["output_throughput"]
    print(f"bench serve: {name} c={c} round {rnd}: {row['completed']}/{row['num_prompts']} done, "
          f"{row['output_throughput']:.2f} out tok/s, TTFT median {_fmt(row['ttft_ms']['median'], 0)} ms", flush=True)
    return row


def _stop_local(name: str) -> None:
    from ray import serve

    try:
        serve.delete(name)
    except Exception:  # noqa: BLE001 - already gone
        pass


class EndpointError(RuntimeError):
    """The endpoint cannot be benchmarked: unreachable, or not an OpenAI-compatible server."""


def _served_model(url: str) -> str:
    """The model `url` serves: the first check of an endpoint, so a wrong URL is one line, not a traceback."""
    try:
        r = requests.get(f"{url}/v1/models", timeout=30)
        r.raise_for_status()
    except requests.RequestException as e:
        raise EndpointError(f"no answer from {url}/v1/models ({type(e).__name__}: {e})") from None
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, LookupError, TypeError):
        raise EndpointError(f"{url}/v1/models lists no model: not an OpenAI-compatible endpoint") from None


def _fmt(v, digits=1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def markdown(results: list[dict]) -> str:
    head = ("| setup | conc | done/sent | req/s | out tok/s | tau | TTFT mean / med / p99 (ms) "
            "| TPOT mean / med / p99 (ms) | ITL mean / med / p99 (ms) |")
    lines = [head, "|" + "---|" * 9]
    for r in results:
        stats = [" / ".join(_fmt(r[k][s], 0) for s in ("mean", "median", "p99")) for k in ("ttft_ms", "tpot_ms", "itl_ms")]
        lines.append(f"| {r['setup']} | {r['concurrency']} | {r['completed']}/{r['num_prompts']} "
                     f"| {_fmt(r['request_throughput'], 3)} | {_fmt(r['output_throughput'], 2)} | {_fmt(r['tau'], 2)} "
                     f"| {' | '.join(stats)} |")
    return "\n".join(lines)


def run(url: str | None = None, model: str = "gemma-3-270m", concurrencies: tuple[int, ...] = (1, 8),
        num_prompts: int = 8, max_tokens: int = 48, draft: str | None = "default",
        json_out: str | None = "bench/results/serve.json", dtype: str = "float32",
        request_timeout_s: float = 900, prompts: list[str] | None = None, threads: int | None = None,
        engine_baseline: bool = True, stream_interval: int = 1, direct_ingress: bool = False,
        colocate: bool | None = None, rounds: int = 1) -> dict:
    """Benchmark the endpoint at `url`, or (url=None) an app started here without and with the head,
    after the engine itself with the same threads (`engine_baseline`).

    Each concurrency level sends max(num_prompts, concurrency) prompts (Spec-Bench questions, or
    `prompts` cycled). Returns the report (also printed as a markdown table and written to
    `json_out` unless that is None)."""
    from cluster.cpu_threads import usable_cores

    concurrencies = tuple(int(c) for c in concurrencies)
    threads = int(threads or usable_cores())
    pool = list(prompts) if prompts else [render(r) for r in load_questions()]

    def prompts_for(c):
        n = max(num_prompts, c)
        return [pool[i % len(pool)] for i in range(n)]

    notes: list[str] = []
    results: list[dict] = []
    if url is not None:
        url = url.rstrip("/").removesuffix("/v1")
        setups = [("endpoint", None)]
        head = None
    else:
        head, note = resolve_head(model, draft)
        if note:
            notes.append(note)
            print(f"bench serve: {note}", flush=True)
        setups = [("plain", None)] + ([("eagle", head)] if head else [])
    port = _free_port()
    engine_rows: dict[int, dict] = {}
    llm = None

    def engine_round(rnd: int) -> None:
        for row in engine_levels(llm, prompts_for, concurrencies, max_tokens, rnd):
            engine_rows[row["concurrency"]] = row
            results.append(row)

    if url is None and engine_baseline:   # the first round before Ray starts: nothing else computes meanwhile
        llm = load_engine(local_config(model, None, "bench-engine", port, max(concurrencies), max_tokens, dtype,
                                       threads), threads)
        engine_round(0)
    try:
        for name, setup_draft in setups:
            app = f"bench-{name}"
            base = url
            try:
                if base is None:
                    t0 = time.perf_counter()
                    base = _start_local(model, setup_draft, app, port, max_num_seqs=max(concurrencies),
                                        max_tokens=max_tokens, dtype=dtype, threads=threads,
                                        stream_interval=stream_interval, direct_ingress=direct_ingress,
                                        colocate=colocate)
                    print(f"bench serve: {name} up in {time.perf_counter() - t0:.0f}s at {base}", flush=True)
                served = _served_model(base)
                warm = _stream_one(requests.Session(), base, served, pool[0], 4, request_timeout_s)  # load/compile paths
                if not warm["ok"]:
                    raise RuntimeError(f"warm-up request failed: {warm['error']}")
                for rnd in range(rounds if name == "plain" else 1):
                    if rnd and llm is not None:   # again, beside the idle app: this machine's speed drifts
                        engine_round(rnd)
                    for c in concurrencies:
                        results.append(_http_level(name, setup_draft, base, served, prompts_for(c), c, max_tokens,
                                                   request_timeout_s, rnd, engine_rows.get(c)))
            finally:
                if url is None:
                    _stop_local(app)
    finally:
        if llm is not None:
            llm.engine.shutdown()
        _RAY.shutdown()
    report = {"meta": {"model": model, "url": url, "draft": head, "concurrencies": list(concurrencies),
                       "num_prompts": num_prompts, "max_tokens": max_tokens, "dtype": dtype, "threads": threads,
                       "stream_interval": stream_interval, "direct_ingress": direct_ingress,
                       "ingress": ingress_label(colocate),
                       "rounds": rounds, "cpus": os.cpu_count(), "machine": platform.machine(), "notes": notes,
                       "method": "streamed /v1/completions, greedy, ignore_eos, closed loop at each concurrency; "
                                 "engine: LLM.generate of the same prompts, concurrency at a time, same threads",
                       "prefix_caching": False, **run_meta()},
              "results": results}
    table = markdown(results)
    ratios = {c: [r["vs_engine"] for r in results if r.get("vs_engine") and r["concurrency"] == c] for c in concurrencies}
    if any(ratios.values()):
        report["vs_engine_median"] = {str(c): statistics.median(v) for c, v in ratios.items() if v}
        table += "\n\nHTTP (no head) vs LLM.generate, same threads, median of rounds: " + ", ".join(
            f"c={c}: {statistics.median(v):.2f}x ({' / '.join(f'{x:.2f}' for x in v)})" for c, v in ratios.items() if v)
    print(table + ("\n\n" + "\n".join(f"note: {n}" for n in notes) if notes else ""), flush=True)
    if json_out:
        write_json(json_out, report)
    return report


if __name__ == "__main__":       # the benchmarks' options live in one place, the CLI
    raise SystemExit("run this benchmark as `eaglectl bench serve [OPTIONS]` (`eaglectl bench serve --help`)")
