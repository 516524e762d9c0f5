"""Speculation at every batch size: `eaglectl bench spec --batch-sizes 1,4,8,16,32,64`.

Methods: `vanilla` (no speculation), `default` (what `LLM()` gives: `default_spec("auto")`, the
hybrid sized per sequence and step), and the fixed methods it chooses between, each drafting its
full tree at every step: `head` (the EAGLE-2 dynamic tree), `lookup` (prompt lookup) and `hybrid`
(lookup merged with the head's tree). Spec-Bench prompts (`per_category` of each category, taken
round-robin over the categories) are cycled to fill batches: each batch size runs at least
`min_prompts` prompts (batch 1: one category after another; batch 64: one batch of the whole set
cycled), every request makes `max_tokens` tokens (ignore_eos, so every method does the same work).
One engine per method serves every batch size, as a server would, after a warm-up batch. The
methods take turns batch by batch, the order rotating each batch and round; a batch counts with
its median time over rounds. Each method's ratio over vanilla is a throughput ratio, paired by round:
in each round, vanilla's seconds over the method's summed over the round's batches (each batch back
to back); the median of the rounds, with their range. (A median of per-batch ratios would weigh a
short batch like a long one: at batch 1 that is each prompt's own speedup, which overstates the
throughput.) Prefix caching is off: the rounds repeat the batches. For the default it
reports where the policy's choices went: draft nodes per sequence and step, and steps by source.
The report is rewritten after each batch size, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
import transformers

from bench.methods import BATCH_METHODS as METHODS
from bench.methods import check_methods
from bench.prompts import PROMPT_FORMAT, SPEC_BENCH, load_questions, render
from bench.report_file import run_meta, write_json


def spec_for(method: str, model: str, draft: str, head_dtype: str = "target"):
    from eagle_worker.speculative.config import SpecConfig, default_spec

    if method == "vanilla":
        return None                     # spec=None: no speculation
    if method == "default":
        spec = default_spec("auto" if draft == "default" else draft, model)
        return replace(spec, head_dtype=head_dtype) if spec is not None else None
    if method == "head":
        return SpecConfig(draft=draft, lookup=False, adaptive=False, head_dtype=head_dtype)
    if method == "lookup":
        return SpecConfig(draft=None, lookup=True, adaptive=False)
    if method == "hybrid":
        return SpecConfig(draft=draft, lookup=True, adaptive=False, head_dtype=head_dtype)
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def _engine_counts(llm) -> dict:
    worker = getattr(llm.engine, "worker", None)
    totals = getattr(worker, "totals", None)
    if not totals or "draft_nodes" not in totals:
        return {"draft_nodes": 0, "decode_seq_steps": 0, "draft_s": 0.0}
    return {"draft_nodes": totals["draft_nodes"], "decode_seq_steps": totals["decode_seq_steps"],
            "draft_s": totals["draft_s"]}


def _once(llm, batch: list[str], params) -> dict:
    before = _engine_counts(llm)
    t0 = time.perf_counter()
    outs = llm.generate(batch, params)
    seconds = time.perf_counter() - t0
    after = _engine_counts(llm)
    tokens = sum(len(o.token_ids) for o in outs)
    forwards = sum(o.metrics["num_target_forwards"] + 1 for o in outs)
    steps: dict[str, int] = {}
    for o in outs:
        for mode, n in o.metrics.get("steps_by_source", {}).items():
            steps[mode] = steps.get(mode, 0) + n
    seq_steps = after["decode_seq_steps"] - before["decode_seq_steps"]
    return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds, "tau": tokens / forwards,
            "nodes_per_seq_step": (after["draft_nodes"] - before["draft_nodes"]) / seq_steps if seq_steps else 0.0,
            "draft_share": (after["draft_s"] - before["draft_s"]) / seconds,   # lookup, the choice, the head's passes
            "steps_by_source": steps}


def run(model: str = "gemma-3-270m", prompts_file: str | Path = SPEC_BENCH, per_category: int = 2,
        max_tokens: int = 128, dtype: str = "float32", draft: str = "default",
        methods: tuple[str, ...] = METHODS, batch_sizes: tuple[int, ...] = (1, 4, 8, 16, 32, 64),
        rounds: int = 1, temperature: float = 0.0, device: str = "cpu", threads: int | None = None,
        json_out: str | None = "bench/results/spec_batch.json", min_prompts: int = 13, head_dtype: str = "target") -> dict:
    from eagle_worker import LLM, SamplingParams

    check_methods(methods, METHODS)
    if threads:
        torch.set_num_threads(threads)
    by_cat: dict[str, list[str]] = {}
    for r in load_questions(prompts_file, per_category=per_category):
        by_cat.setdefault(r.get("category", "default"), []).append(render(r))
    prompts = [p for group in itertools.zip_longest(*by_cat.values()) for p in group if p is not None]
    kv_gb = max(1.0, 36e3 * max(batch_sizes) * (max_tokens + 400) / 2**30 * (1 if dtype == "float32" else 0.5) * 1.5)
    engines = {m: LLM(model=model, dtype=dtype, device=device, spec=spec_for(m, model, draft, head_dtype), kv_cache_gb=kv_gb,
                      max_num_seqs=max(batch_sizes), enable_prefix_caching=False) for m in methods}
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                            seed=0 if temperature else None)
    warm = (prompts * 8)[:8]
    for m, llm in engines.items():                        # the adaptive state settles as in a running server
        llm.generate(warm, SamplingParams(max_tokens=32, temperature=temperature, ignore_eos=True))
        print(f"warmed {m}", flush=True)
    report = {"meta": {"model": model, "dtype": dtype, "device": device, "max_tokens": max_tokens,
                       "prompt_format": PROMPT_FORMAT, "prompts": str(prompts_file), "per_category": per_category,
                       "rounds": rounds, "min_prompts": min_prompts, "temperature": temperature, "draft": draft,
                       "head_dtype": head_dtype,
                       "methods": list(methods),
                       "torch": torch.__version__, "transformers": transformers.__version__,
                       "threads": torch.get_num_threads(), "prefix_caching": False, **run_meta()},
              "batches": []}
    for bs in batch_sizes:
        n = max(bs, -(-min_prompts // bs) * bs)
        cycled = (prompts * (n // len(prompts) + 1))[:n]
        batches = [cycled[i:i + bs] for i in range(0, n, bs)]
        runs: dict[str, list[list[dict]]] = {m: [[] for _ in batches] for m in methods}   # per batch, per round
        for rnd in range(rounds):
            for j, batch in enumerate(batches):
                k = (j + rnd) % len(methods)
                for m in methods[k:] + methods[:k]:
                    r = _once(engines[m], batch, params)
                    runs[m][j].append(r)
                    print(f"batch {bs:3d} #{j + 1}/{len(batches)} round {rnd + 1} {m:8s} {r['tok_s']:8.1f} tok/s "
                          f"tau {r['tau']:.2f} nodes/seq-step {r['nodes_per_seq_step']:.2f} {r['steps_by_source']}",
                          flush=True)
        report["batches"].append(_summarise(bs, runs))
        _print_row(report["batches"][-1])
        if json_out:
            write_json(json_out, report)
    _print(report)
    return report


def round_ratios(method: list[list[dict]], vanilla: list[list[dict]]) -> list[float]:
    """Per round: vanilla's seconds over the method's, each summed over the round's batches (the same
    work: every request makes max_tokens tokens)."""
    rounds = len(vanilla[0])
    return [sum(b[r]["seconds"] for b in vanilla) / sum(m[r]["seconds"] for m in method) for r in range(rounds)]


def _summarise(bs: int, runs: dict[str, list[list[dict]]]) -> dict:
    """Per method: tokens over the batches' median seconds, and the throughput ratio over vanilla
    paired by round (round_ratios), its median and range over the rounds; every pass's seconds."""
    row = {"batch": bs, "batches": len(runs["vanilla"]), "methods": {}}
    base = runs["vanilla"]
    for m, per_batch in runs.items():
        flat = [r for rs in per_batch for r in rs]
        ratios = round_ratios(per_batch, base)
        steps: dict[str, int] = {}
        for r in flat:
            for mode, n in r["steps_by_source"].items():
                steps[mode] = steps.get(mode, 0) + n
        total = sum(steps.values())
        tokens = sum(rs[0]["tokens"] for rs in per_batch)
        row["methods"][m] = {
            "tok_s": tokens / sum(statistics.median(r["seconds"] for r in rs) for rs in per_batch),
            "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)], "rounds": len(ratios),
            "seconds": [[r["seconds"] for r in rs] for rs in per_batch],      # per batch, per round
            "tau": statistics.mean(r["tau"] for r in flat),
            "nodes_per_seq_step": statistics.mean(r["nodes_per_seq_step"] for r in flat),
            "draft_share": statistics.mean(r["draft_share"] for r in flat),
            "steps_by_source": {k: v / total for k, v in sorted(steps.items())} if total else {}}
    return row


def _cell(r: dict) -> str:
    return f"{r['tok_s']:.1f} ({r['ratio']:.2f}x [{r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}], τ {r['tau']:.2f})"


def _print_row(row: dict) -> None:
    print(f"| {row['batch']} | " + " | ".join(_cell(r) for r in row["methods"].values()) + " |", flush=True)


def _print(report: dict) -> None:
    methods = report["meta"]["methods"]
    print("\n| batch | " + " | ".join(methods) + " |\n|---:|" + "---:|" * len(methods))
    for row in report["batches"]:
        _print_row(row)
    print("\n| batch | default: nodes per sequence-step | default: steps by source | drafting's share of the time: "
          + ", ".join(m for m in methods if m != "vanilla") + " |\n|---:|---:|---|---|")
    for row in report["batches"]:
        d = row["methods"].get("default")
        src = ", ".join(f"{k} {v:.0%}" for k, v in d["steps_by_source"].items()) if d else "-"
        shares = ", ".join(f"{r.get('draft_share', 0.0):.1%}" for m, r in row["methods"].items() if m != "vanilla")
        print(f"| {row['batch']} | {d['nodes_per_seq_step']:.2f} | {src} | {shares} |" if d else
              f"| {row['batch']} | - | - | {shares} |")
