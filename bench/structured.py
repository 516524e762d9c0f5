"""Structured outputs with and without speculation: tokens/s, τ and identical text, per format and batch.

The same prompts (bundled Spec-Bench, rendered) under each format: free text, any JSON object
(`json_object`) and a JSON schema for an answer with steps, greedy. Plain decoding (no draft) and the
speculation asked for (`--draft`, default: the model's default) take turns each round; the median
counts. `same` is whether both gave the same tokens (speculation must not change the text, with a
grammar as without). A format's tok/s are of its own texts, so compare methods within a format.
"""
from __future__ import annotations

import statistics
import time

from bench.report_file import run_meta, write_json

ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"},
                                                  "steps": {"type": "array", "items": {"type": "string"}}},
                 "required": ["answer", "steps"]}
FORMATS = {"free": None, "json_object": {"json_object": True}, "json_schema": {"json": ANSWER_SCHEMA}}


def _timed(llm, prompts, params, batch: int) -> tuple[float, list, list]:
    """Wall seconds for the prompts in batches, their token ids, and each request's τ."""
    start, ids, taus = time.perf_counter(), [], []
    for i in range(0, len(prompts), batch):
        for out in llm.generate(prompts[i:i + batch], params):
            ids.append(out.token_ids)
            taus.append(out.metrics.get("mean_accepted_tokens", 1.0))
    return time.perf_counter() - start, ids, taus


def run(model: str = "gemma-3-270m", dtype: str = "float32", draft: str = "default", formats=tuple(FORMATS),
        batch_sizes=(1, 4), num_prompts: int = 8, max_tokens: int = 64, rounds: int = 2,
        json_out: str | None = None) -> list[dict]:
    from bench.prompts import load_questions, render
    from eagle_worker import LLM, SamplingParams

    prompts = [render(q) for q in load_questions(limit=num_prompts)]
    engines = {"plain": LLM(model=model, dtype=dtype, draft=None), "spec": LLM(model=model, dtype=dtype, draft=draft)}
    for llm in engines.values():      # warm: the tokenizer's grammar index, the first forwards
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, structured_outputs={"json_object": True}))
    rows = []
    for fmt in formats:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=FORMATS[fmt])
        for batch in batch_sizes:
            speeds: dict[str, list[float]] = {"plain": [], "spec": []}
            seen: dict[str, list] = {}
            taus: list[float] = []
            for r in range(rounds):
                for name in (("plain", "spec") if r % 2 == 0 else ("spec", "plain")):
                    wall, ids, tau = _timed(engines[name], prompts, params, batch)
                    speeds[name].append(sum(map(len, ids)) / wall)
                    seen.setdefault(name, ids)
                    if name == "spec":
                        taus += tau
            plain, spec = statistics.median(speeds["plain"]), statistics.median(speeds["spec"])
            row = {"format": fmt, "batch": batch, "plain_tok_s": plain, "spec_tok_s": spec, "speedup": spec / plain,
                   "tau": statistics.mean(taus), "same": seen["plain"] == seen["spec"]}
            rows.append(row)
            print(f"{fmt:11s} batch {batch:2d}: plain {plain:6.1f} tok/s  spec {spec:6.1f} tok/s  "
                  f"{row['speedup']:.2f}x  tau {row['tau']:.2f}  same {row['same']}", flush=True)
    print(table(rows))
    if json_out:
        write_json(json_out, {"meta": {**run_meta(), "model": model, "dtype": dtype, "draft": draft,
                                       "num_prompts": num_prompts, "max_tokens": max_tokens, "rounds": rounds},
                              "rows": rows})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| format | batch | plain tok/s | spec tok/s | spec / plain | τ | same text |", "|---|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['format']} | {r['batch']} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | {r['speedup']:.2f}x | "
              f"{r['tau']:.2f} | {'yes' if r['same'] else 'NO'} |" for r in rows]
    return "\n".join(lines)
