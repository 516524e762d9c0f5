"""`eaglectl bench job`: one offline job over Spec-Bench prompts, without speculation and with the default.

The same Parquet input (`rows` Spec-Bench questions taken round-robin over its 13 categories,
rendered as `Question: ...\nAnswer:` for the base model) goes through the real job path
(`jobs.runner`: Ray replicas, continuous batching, atomic Parquet output) at temperature 0, once
with `--draft none` and once with `draft` (default "auto": what `submit-job` does by default, the
hybrid with the model's built-in head, or prompt lookup where it has none; or a head folder).
Throughput counts generation only (from the first replica ready to the last row written), not
model loading. At temperature 0 speculative decoding is lossless, so
the two runs' texts are compared row by row as a check. With `rounds` > 1 the two jobs run that many
times, taking turns to go first; each variant reports its median round, and the speedup is the median
of the rounds' ratios (with their range).
Usage: `eaglectl bench job [--rows 200 --max-tokens 64 --draft auto --rounds 1]`.
"""
from __future__ import annotations

import itertools
import platform
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from bench.prompts import load_questions, render
from bench.report_file import run_meta, write_json


def available_rows() -> int:
    """The most rows `write_input` writes: one a Spec-Bench question (no prompt twice, which prefix
    caching would turn into free rows)."""
    return len(load_questions())


def write_input(path: Path, rows: int) -> list[str]:
    """The benchmark input: `rows` prompts taken round-robin over the categories (as even as the
    categories' sizes allow: the 8 MT-Bench ones have 10 questions each)."""
    by_cat: dict[str, list[dict]] = {}
    for q in load_questions():
        by_cat.setdefault(q.get("category", "default"), []).append(q)
    mixed = [q for group in itertools.zip_longest(*by_cat.values()) for q in group if q is not None]
    if not 1 <= rows <= len(mixed):        # a slice would quietly write another count (mixed[:-1]: all but one)
        raise ValueError(f"rows must be from 1 to {len(mixed)} (the Spec-Bench questions), got {rows}")
    picked = mixed[:rows]
    ids = [f"q{q['question_id']}" for q in picked]
    pq.write_table(pa.table({"id": ids, "prompt": [render(q) for q in picked],
                             "category": [q.get("category", "default") for q in picked]}), path)
    return ids


class BenchStopped(Exception):
    """A signal stopped one of the benchmark's jobs; `signal` is its name (SIGINT, SIGTERM) where known."""

    def __init__(self, message: str, signal: str | None):
        super().__init__(message)
        self.signal = signal


def completed_run(manifest: dict, name: str) -> dict:
    """The last run of a benchmark's finished job; BenchStopped where Ctrl-C or SIGTERM stopped it
    (the job stops gracefully, and the benchmark with it, instead of going on to its next job)."""
    run = manifest["runs"][-1]
    if manifest["status"] != "completed":
        raise BenchStopped(f"stopped by {run.get('stopped_by') or 'a signal'} during the {name!r} job: nothing "
                           "reported", run.get("stopped_by"))
    return run


def _variant(name: str, draft: str, inp: Path, out: Path, model: str, max_tokens: int, replicas: int,
             max_num_seqs: int) -> dict:
    from jobs.job_config import JobConfig
    from jobs.runner import run_job

    cfg = JobConfig(input=str(inp), output=str(out), model=model, draft=draft, max_tokens=max_tokens,
                    temperature=0.0, replicas=replicas, max_num_seqs=max_num_seqs, overwrite=True,
                    min_ready_replicas=replicas)
    m = run_job(cfg)
    run = completed_run(m, name)
    gen_s = run.get("generation_s") or run["wall_s"]
    row = {"variant": name, "draft": cfg.resolved_draft(), "rows": m["rows"], "error_rows": m["error_rows"],
           "completion_tokens": run["completion_tokens"], "generation_s": gen_s, "startup_s": run.get("startup_s"),
           "rows_per_s": m["rows"] / gen_s, "output_tokens_per_s": run["completion_tokens"] / gen_s,
           "tau": run["tau"]}
    print(f"{name:10s}: {row['rows']} rows, {row['completion_tokens']} tokens in {gen_s:.1f}s "
          f"({row['rows_per_s']:.2f} rows/s, {row['output_tokens_per_s']:.1f} tok/s, tau {row['tau']:.2f})", flush=True)
    return row


def run(model: str = "gemma-3-270m", rows: int = 200, max_tokens: int = 64, json_out: str | None = "bench/results/job.json",
        draft: str = "auto", replicas: int = 1, max_num_seqs: int = 64, rounds: int = 1) -> list[dict]:
    from bench.preflight import check_draft, check_model
    from jobs.job_config import JobConfig, JobConfigError, builtin_head_error

    try:            # every setting checked before anything loads: both runs' configs are this one's
        JobConfig.from_options(input="x", model=model, draft=draft, max_tokens=max_tokens, replicas=replicas,
                               max_num_seqs=max_num_seqs)
        check_model(model)               # a replica that cannot load it would fail the job after Ray starts
        head = check_draft(draft, model)  # the engine's check: a head folder, or a model that ships one
    except ValueError as e:
        raise JobConfigError(str(e)) from None
    note = None
    if head is None and draft != "none":
        note = ("no EAGLE head for this model (" + (builtin_head_error("eagle_worker", model) or "")
                + "): the default is prompt lookup alone")
    with tempfile.TemporaryDirectory(prefix="bench-job-") as tmp:
        tmp = Path(tmp)
        inp = tmp / "spec_bench.parquet"
        write_input(inp, rows)
        variants = [("none", "none", tmp / "base.out")] + ([("default", draft, tmp / "eagle.out")] if draft != "none" else [])
        runs: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
        same: list[float] = []
        for rnd in range(rounds):
            for name, d, out in (variants if rnd % 2 == 0 else variants[::-1]):     # taking turns to go first
                runs[name].append(_variant(name, d, inp, out, model, max_tokens, replicas, max_num_seqs))
            if len(variants) == 2:
                base, spec = (_texts(out) for _, _, out in variants)
                same.append(sum(base[k] == spec.get(k) for k in base) / max(1, len(base)))
    results = summarise(runs)
    if same:
        results[1]["same_text_as_baseline"] = min(same)
    _print_table(results, note)
    if json_out:
        import torch

        meta = {"model": model, "rows": rows, "max_tokens": max_tokens, "replicas": replicas, "rounds": rounds,
                "max_num_seqs": max_num_seqs, "temperature": 0.0, "note": note, "threads": torch.get_num_threads(),
                "machine": platform.processor() or platform.machine(), "torch": torch.__version__, **run_meta()}
        write_json(json_out, {"meta": meta, "rows": results})
    return results


def _texts(out: Path) -> dict:
    return {r["id"]: r["text"] for r in pq.read_table(out, columns=["id", "text"]).to_pylist()}


def summarise(runs: dict[str, list[dict]]) -> list[dict]:
    """Per variant its median round (by output tok/s), and the speedup over "none": the median of the
    rounds' ratios (each round's two jobs back to back), their range, and every round's tok/s."""
    import statistics

    base = runs["none"]
    results = []
    for name, rs in runs.items():
        ratios = [r["output_tokens_per_s"] / b["output_tokens_per_s"] for r, b in zip(rs, base)]
        row = dict(sorted(rs, key=lambda r: r["output_tokens_per_s"])[(len(rs) - 1) // 2])   # the median round
        row.update(speedup=statistics.median(ratios), speedup_range=[min(ratios), max(ratios)],
                   rounds_tok_s=[r["output_tokens_per_s"] for r in rs])
        results.append(row)
    return results


def _print_table(rows: list[dict], note: str | None) -> None:
    print("\n| variant | rows | rows/s | output tok/s | tau | speedup |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['rows']} | {r['rows_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | "
              f"{r['tau']:.2f} | {r['speedup']:.2f}x |")
    if note:
        print(f"\n{note}")


if __name__ == "__main__":       # the benchmarks' options live in one place, the CLI
    raise SystemExit("run this benchmark as `eaglectl bench job [OPTIONS]` (`eaglectl bench job --help`)")
