"""Decode throughput: this engine vs `transformers` generate, same model, dtype and prompts, one run.

Greedy, a fixed number of new tokens per prompt (EOS ignored on both sides), batch 1 (prompts
one after another) and batch N (all at once: continuous batching here, left-padded batch there).
Usage: `eaglectl bench decode` or `python -m bench.decode`.
"""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch
import transformers

from bench.prompts import load_questions, render


def _hf_generate(model, tok, prompts: list[str], max_tokens: int) -> int:
    enc = tok(prompts, return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    return (out.shape[1] - enc["input_ids"].shape[1]) * len(prompts)


def _timed(fn) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = fn()
    return time.perf_counter() - t0, n


def run(model: str = "gemma-3-270m", dtypes: list[str] = ("float32", "bfloat16"), batch_sizes: list[int] = (1, 8),
        max_tokens: int = 64, json_out: str | None = "bench/results/decode.json", threads: int | None = None) -> list[dict]:
    """`threads` pins torch's intra-op threads for both engines (1 keeps a shared machine's
    other processes from stalling every parallel op; the JSON records what was used)."""
    if threads:
        torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle_worker import LLM, SamplingParams
    from eagle_worker.model_runner import resolve_model

    path = resolve_model(model)
    n_prompts = max(batch_sizes)
    prompts = [render(r) for r in load_questions(per_category=1)][:n_prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for dtype in dtypes:
        tdtype = getattr(torch, dtype)
        tok = AutoTokenizer.from_pretrained(path, padding_side="left")
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=tdtype).eval()
        llm = LLM(model=model, dtype=dtype, draft=None)
        with torch.inference_mode():
            _hf_generate(hf, tok, prompts[:1], 4)                      # warm-up
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))
        for bs in batch_sizes:
            batch = prompts[:bs]
            with torch.inference_mode():
                if bs == 1:
                    t_hf, n_hf = _timed(lambda: sum(_hf_generate(hf, tok, [p], max_tokens) for p in prompts[:2]))
                else:
                    t_hf, n_hf = _timed(lambda: _hf_generate(hf, tok, batch, max_tokens))
            if bs == 1:
                t_us, n_us = _timed(lambda: sum(len(llm.generate([p], params)[0].token_ids) for p in prompts[:2]))
            else:
                t_us, n_us = _timed(lambda: sum(len(o.token_ids) for o in llm.generate(batch, params)))
            rows.append({"dtype": dtype, "batch": bs, "engine_tok_s": n_us / t_us, "transformers_tok_s": n_hf / t_hf,
                         "speedup_vs_transformers": (n_us / t_us) / (n_hf / t_hf)})
            print(f"{dtype:9s} batch {bs:2d}: engine {n_us / t_us:7.1f} tok/s  transformers {n_hf / t_hf:7.1f} tok/s",
                  flush=True)
        del hf, llm
    for dtype in dtypes:
        b1 = next((r for r in rows if r["dtype"] == dtype and r["batch"] == 1), None)
        for r in rows:
            if b1 and r["dtype"] == dtype:
                r["vs_own_batch1"] = r["engine_tok_s"] / b1["engine_tok_s"]
    _print_table(rows)
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        meta = {"model": model, "max_tokens": max_tokens, "threads": torch.get_num_threads(),
                "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                "transformers": transformers.__version__}
        Path(json_out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return rows


def _print_table(rows: list[dict]) -> None:
    print("\n| dtype | batch | engine tok/s | transformers tok/s | engine / transformers | engine / own batch 1 |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['dtype']} | {r['batch']} | {r['engine_tok_s']:.1f} | {r['transformers_tok_s']:.1f} | "
              f"{r['speedup_vs_transformers']:.2f}x | {r.get('vs_own_batch1', 1.0):.2f}x |")


if __name__ == "__main__":
    run()
