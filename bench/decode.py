"""Decode throughput: this engine vs `transformers` generate, same model, dtype and prompts.

Greedy, a fixed number of new tokens per prompt (EOS ignored on both sides), batch 1 (prompts
one after another) and batch N (all at once: continuous batching here, left-padded batch there).
With `rounds` > 1 each measurement repeats that many times, the two engines taking turns (the
one that goes first alternates), and the median counts: a slow spell of a shared machine then
does not decide a ratio. In float32 the engine also runs with every GEMM on the untimed default
rule (`layers/gemm_paths.py`), in the same rounds: what timing the paths gains on this machine.
Usage: `eaglectl bench decode`.
"""
from __future__ import annotations

import platform
import statistics
import time

import torch
import transformers

from bench.prompts import load_questions, render
from bench.report_file import run_meta, write_json


def _hf_generate(model, tok, prompts: list[str], max_tokens: int) -> int:
    enc = tok(prompts, return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    return (out.shape[1] - enc["input_ids"].shape[1]) * len(prompts)


def _timed(fn) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = fn()
    return time.perf_counter() - t0, n


def run(model: str = "gemma-3-270m", dtypes: list[str] = ("float32", "bfloat16"), batch_sizes: list[int] = (1, 8),
        max_tokens: int = 64, json_out: str | None = "bench/results/decode.json", threads: int | None = None,
        rounds: int = 1) -> list[dict]:
    """`threads` pins torch's intra-op threads for both engines (1 keeps a shared machine's
    other processes from stalling every parallel op; the JSON records what was used)."""
    if rounds < 1 or max_tokens < 1 or not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"rounds, max_tokens and batch sizes must be >= 1, got {rounds}, {max_tokens}, {batch_sizes}")
    if threads:
        torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle_worker import LLM, SamplingParams
    from eagle_worker.layers import gemm_paths
    from eagle_worker.model_runner import resolve_model

    path = resolve_model(model)
    pool = [render(r) for r in load_questions(per_category=1)]
    prompts = [pool[i % len(pool)] for i in range(max(2, *batch_sizes))]    # cycled: batch N is N prompts
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for dtype in dtypes:
        tdtype = getattr(torch, dtype)
        tok = AutoTokenizer.from_pretrained(path, padding_side="left")
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=tdtype).eval()
        llm = LLM(model=model, dtype=dtype, draft=None, enable_prefix_caching=False)
        with torch.inference_mode():
            _hf_generate(hf, tok, prompts[:1], 4)                      # warm-up
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))
        for bs in batch_sizes:
            batch = prompts[:bs] if bs > 1 else prompts[:2]         # batch 1: two prompts one after another

            def transformers_run(batch=batch, bs=bs):
                with torch.inference_mode():
                    if bs == 1:
                        return sum(_hf_generate(hf, tok, [p], max_tokens) for p in batch)
                    return _hf_generate(hf, tok, batch, max_tokens)

            def engine_run(batch=batch, bs=bs):
                if bs == 1:
                    return sum(len(llm.generate([p], params)[0].token_ids) for p in batch)
                return sum(len(o.token_ids) for o in llm.generate(batch, params))

            def engine_rule_run(batch=batch, bs=bs):
                """The same engine with every float32 GEMM on the untimed default rule (gemm_paths)."""
                with gemm_paths.untimed():
                    return engine_run(batch, bs)

            order = [("transformers", transformers_run), ("engine", engine_run)]
            if dtype == "float32":
                order.append(("engine_gemm_rule", engine_rule_run))
            speeds: dict[str, list[float]] = {name: [] for name, _ in order}
            for rnd in range(rounds):
                for name, fn in order[rnd % len(order):] + order[:rnd % len(order)]:
                    secs, n = _timed(fn)
                    speeds[name].append(n / secs)
            ours, theirs = statistics.median(speeds["engine"]), statistics.median(speeds["transformers"])
            row = {"dtype": dtype, "batch": bs, "engine_tok_s": ours, "transformers_tok_s": theirs,
                   "speedup_vs_transformers": ours / theirs, "rounds": speeds}
            if "engine_gemm_rule" in speeds:   # paired per round: what timing the GEMM paths gains
                row["engine_gemm_rule_tok_s"] = statistics.median(speeds["engine_gemm_rule"])
                row["timed_gemm_vs_rule"] = statistics.median(a / b for a, b in zip(speeds["engine"], speeds["engine_gemm_rule"]))
            rows.append(row)
            print(f"{dtype:9s} batch {bs:2d}: engine {ours:7.1f} tok/s  transformers {theirs:7.1f} tok/s"
                  + (f"  engine, GEMM rule {row['engine_gemm_rule_tok_s']:7.1f} tok/s" if "engine_gemm_rule" in speeds else "")
                  + (f"  (median of {rounds})" if rounds > 1 else ""), flush=True)
        hf = llm = None  # free both models before the next dtype
    for dtype in dtypes:
        b1 = next((r for r in rows if r["dtype"] == dtype and r["batch"] == 1), None)
        for r in rows:
            if b1 and r["dtype"] == dtype:
                r["vs_own_batch1"] = r["engine_tok_s"] / b1["engine_tok_s"]
    _print_table(rows)
    if json_out:
        meta = {"model": model, "max_tokens": max_tokens, "threads": torch.get_num_threads(),
                "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                "transformers": transformers.__version__, "rounds": rounds, "prefix_caching": False, **run_meta()}
        write_json(json_out, {"meta": meta, "rows": rows})
    return rows


def _print_table(rows: list[dict]) -> None:
    print("\n| dtype | batch | engine tok/s | transformers tok/s | engine / transformers | engine / own batch 1 "
          "| engine with the GEMM rule tok/s | timed GEMM paths / rule |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        rule = (f"{r['engine_gemm_rule_tok_s']:.1f} | {r['timed_gemm_vs_rule']:.2f}x" if "timed_gemm_vs_rule" in r
                else "- | -")
        print(f"| {r['dtype']} | {r['batch']} | {r['engine_tok_s']:.1f} | {r['transformers_tok_s']:.1f} | "
              f"{r['speedup_vs_transformers']:.2f}x | {r.get('vs_own_batch1', 1.0):.2f}x | {rule} |")


if __name__ == "__main__":       # the benchmarks' options live in one place, the CLI
    raise SystemExit("run this benchmark as `eaglectl bench decode [OPTIONS]` (`eaglectl bench decode --help`)")
