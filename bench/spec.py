"""Speculative decoding benchmark on Spec-Bench-format prompts, every method in one run.

Methods: our vanilla decoding, `transformers` generate, `transformers` prompt-lookup decoding,
our prompt lookup, our EAGLE chain, static tree and dynamic tree, and the hybrid (lookup branches
merged into the dynamic tree). Per category: tokens/s, speedup over our vanilla
and tau (output tokens per target forward), at batch 1. `--batch-sizes` measures the default
against the fixed methods at every batch size instead (bench/spec_batch.py).
Usage: `eaglectl bench spec [--prompts FILE] [--draft DIR|default|random] [--json OUT]`.
"""
from __future__ import annotations

import json
import math
import random
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import transformers

from bench.methods import SPEC_METHODS as METHODS
from bench.methods import check_methods
from bench.prompts import PROMPT_FORMAT, SPEC_BENCH, load_questions, render
from bench.report_file import run_meta, write_json

OURS = ("vanilla", "lookup", "chain", "static", "dynamic", "hybrid")


def _spec_config(method: str, draft: str, tree: dict | None = None):
    """`tree`: depth / top_k / num_draft_tokens for the dynamic tree and the hybrid, and the node
    budget for prompt lookup too, so lookup and the hybrid verify trees of the same size
    (SpecConfig's defaults where absent)."""
    from eagle_worker.speculative.config import SpecConfig

    tree = tree or {}
    if method == "vanilla":
        return None
    if method == "lookup":
        return SpecConfig(lookup=True, adaptive=False, **{k: v for k, v in tree.items() if k == "num_draft_tokens"})
    if method == "hybrid":              # the default method (each request's sources chosen per step)
        return SpecConfig(draft=draft, tree="dynamic", lookup=True, **tree)
    if method == "chain":
        return SpecConfig(draft=draft, lookup=False, tree="chain", adaptive=False, depth=5, num_draft_tokens=5)
    return SpecConfig(draft=draft, lookup=False, tree=method, adaptive=False, **(tree if method == "dynamic" else {}))


def _random_head(llm, out: Path, draft_vocab: int = 8192) -> str:
    """A random EAGLE-3 head (accepts ~nothing): measures the cost side while no trained head exists.
    Its draft vocabulary is the target's first `draft_vocab` ids, or all of them in a smaller vocabulary."""
    from eagle_worker.speculative.head_init import new_head
    from eagle_worker.speculative.head_saver import save_draft_head

    runner = llm.engine.runner
    ids = torch.arange(min(draft_vocab, runner.model.vocab_size))
    save_draft_head(new_head("eagle3", runner.model, runner.hf_config, ids), out)
    return str(out)


def _run_ours(llm, prompts: list[str], max_tokens: int, shares: dict | None = None,
              temperature: float = 0.0) -> tuple[float, int, int]:
    from eagle_worker import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0 if temperature else None)
    t0 = time.perf_counter()
    tokens = forwards = 0
    for p in prompts:                       # batch 1: one request at a time
        out = llm.generate(p, params)[0]
        tokens += len(out.token_ids)
        forwards += out.metrics["num_target_forwards"] + 1   # + the prefill that produced token 1
        if shares is not None:
            drafted = sum(out.metrics.get("accepted_per_depth", []))
            shares["head"] = shares.get("head", 0) + out.metrics.get("accepted_share_head", 0) * drafted
            shares["lookup"] = shares.get("lookup", 0) + out.metrics.get("accepted_share_lookup", 0) * drafted
            shares["accepted"] = shares.get("accepted", 0) + drafted
            for mode, n in out.metrics.get("steps_by_source", {}).items():
                shares["steps_" + mode] = shares.get("steps_" + mode, 0) + n
    return time.perf_counter() - t0, tokens, forwards


def _run_hf(model, tok, prompts: list[str], max_tokens: int, lookup: int | None,
            temperature: float = 0.0) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    tokens = 0
    kw = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    if temperature:    # plain temperature sampling, as ours (no top-k/top-p from generation_config)
        kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kw.update(do_sample=False)
    with torch.inference_mode():
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids.to(model.device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, **kw)
            tokens += out.shape[1] - ids.shape[1]
    if model.device.type == "cuda":      # generate returns before the GPU is done
        torch.cuda.synchronize(model.device)
    return time.perf_counter() - t0, tokens, 0


def run(model: str = "gemma-3-270m", prompts_file: str | Path = SPEC_BENCH, per_category: int = 2,
        max_tokens: int = 128, dtype: str = "bfloat16", draft: str = "default",
        methods: tuple[str, ...] = METHODS,
        json_out: str | None = "bench/results/spec.json",
        threads: int | None = None, temperature: float = 0.0, tree: dict | None = None, rounds: int = 1,
        device: str = "cpu", warmup: int = 4) -> dict:
    """Batch 1, one request after another; `temperature` > 0 samples (seed 0 per request on our
    side) and reports tau and speed: acceptance then depends on the drawn tokens.

    Every engine is loaded first and the methods take turns prompt by prompt, the order rotating
    by one place each prompt and round (each method runs first, second, ... equally often), so a
    slow spell of the machine hits all methods alike instead of whichever ran then. With `rounds`
    > 1 every prompt runs that many times per method and its median time counts (a spell that
    slows one pass does not; 3 rounds take a median of 3). Each engine first
    serves `warmup` prompts from outside the measured set (the next prompt of several categories),
    so what adapts per worker (the tree budget, the hybrid's estimates) is measured settled, as in a
    server that has been running, not while it learns."""
    check_methods(methods, METHODS)
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds must be >= 1 and warmup >= 0, got {rounds} and {warmup}")
    if threads:
        torch.set_num_threads(threads)
    records = load_questions(prompts_file, per_category=per_category)
    by_cat = defaultdict(list)
    for r in records:
        by_cat[r.get("category", "default")].append(render(r))
    runners, engines = _runners(model, dtype, draft, methods, tree, max_tokens, temperature,
                                _warmup_prompts(prompts_file, per_category, warmup), device)
    prompts = [(cat, p) for cat, ps in by_cat.items() for p in ps]
    runs = defaultdict(list)                 # (method, prompt index) -> (seconds, tokens, forwards, shares) per round
    for rnd in range(rounds):
        for i, (cat, p) in enumerate(prompts):
            k = (i + rnd) % len(methods)
            for method in methods[k:] + methods[:k]:
                shares = {} if method == "hybrid" else None
                secs, tokens, forwards = runners[method]([p], shares) if method in OURS else runners[method]([p])
                runs[(method, i)].append((secs, tokens, forwards, shares or {}))
                print(f"round {rnd + 1} {method:10s} {cat:16s} {tokens / secs:7.2f} tok/s", flush=True)
    results: dict[str, dict[str, dict]] = {m: {} for m in methods}
    for (method, i), rs in runs.items():     # one pass per prompt: mean tokens, median seconds
        row = results[method].setdefault(prompts[i][0], {"tokens": 0.0, "seconds": 0.0, "forwards": 0.0, "shares": {}})
        row["seconds"] += statistics.median(r[0] for r in rs)
        row["tokens"] += sum(r[1] for r in rs) / len(rs)
        row["forwards"] += sum(r[2] for r in rs) / len(rs)
        for r in rs:
            for key, v in r[3].items():
                row["shares"][key] = row["shares"].get(key, 0) + v
    for method, per_cat in results.items():
        for row in per_cat.values():
            row["tok_s"] = row["tokens"] / row["seconds"]
            row["tau"] = row["tokens"] / row["forwards"] if row["forwards"] else None
            shares = row.pop("shares")
            if shares.get("accepted"):
                row["share_head"] = shares["head"] / shares["accepted"]
                row["share_lookup"] = shares["lookup"] / shares["accepted"]
            steps = {k[6:]: v / rounds for k, v in shares.items() if k.startswith("steps_")}
            if steps:                   # hybrid: decode steps of one pass over the category, by source
                row["steps_by_source"] = steps
        if method in engines and method != "vanilla":
            per_cat["_acceptance_per_depth"] = engines[method].engine.stats().get("acceptance_rate_per_depth")
    summary = _summarise(results)
    paired = {f"hybrid/{m}": _paired(runs, [c for c, _ in prompts], "hybrid", m)
              for m in methods if "hybrid" in methods and m != "hybrid"}
    _print(summary, paired)
    report = {"meta": {"model": model, "dtype": dtype, "device": device, "max_tokens": max_tokens, "prompt_format": PROMPT_FORMAT,
                       "torch": torch.__version__, "transformers": transformers.__version__,
                       "temperature": temperature, "tree": tree or {}, "rounds": rounds, "warmup": warmup,
                       "prompts": str(prompts_file), "per_category": per_category, "draft": draft,
                       "threads": torch.get_num_threads(), "prefix_caching": False, **run_meta()},
              "results": results, "summary": summary, "paired": paired}
    if json_out:
        write_json(json_out, report)
    return report


def _warmup_prompts(prompts_file, per_category: int, n: int) -> list[str]:
    """`n` prompts outside the measured ones (the next prompt of each category, spread over them);
    the measured ones where a small prompt file has no others."""
    measured = load_questions(prompts_file, per_category=per_category)
    keys = {json.dumps(r, sort_keys=True) for r in measured}
    extra = [r for r in load_questions(prompts_file, per_category=per_category + 1)
             if json.dumps(r, sort_keys=True) not in keys] or measured
    step = max(1, len(extra) // max(1, n))
    return [render(r) for r in extra[::step][:n]]


def _runners(model: str, dtype: str, draft: str, methods, tree: dict | None, max_tokens: int,
             temperature: float, warm_prompts: list[str], device: str = "cpu") -> tuple[dict, dict]:
    """One callable per method (prompts -> seconds, tokens, target forwards) and our engines by method,
    each warmed up on `warm_prompts` (transformers' on the first)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle_worker import LLM
    from eagle_worker.model_runner import resolve_model

    vanilla = LLM(model=model, dtype=dtype, device=device, draft=None, kv_cache_gb=0.25,
                  enable_prefix_caching=False)     # rounds repeat the prompts: no cache hits between them
    if draft == "random":
        draft = _random_head(vanilla, Path(tempfile.mkdtemp(prefix="bench-head-")))
    runners, engines = {}, {}
    hf = tok = None
    for method in methods:
        if method.startswith("hf"):
            if hf is None:
                path = resolve_model(model)
                tok = AutoTokenizer.from_pretrained(path)
                hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
            def run_hf(ps, lookup=10 if method == "hf_lookup" else None):
                return _run_hf(hf, tok, ps, max_tokens, lookup, temperature)
            runners[method] = run_hf
            runners[method](warm_prompts[:1])
        else:
            llm = engines[method] = vanilla if method == "vanilla" else LLM(     # batch 1: little KV
                model=model, dtype=dtype, device=device, spec=_spec_config(method, draft, tree), kv_cache_gb=0.25,
                enable_prefix_caching=False)
            runners[method] = lambda ps, shares=None, llm=llm: _run_ours(llm, ps, max_tokens, shares, temperature)  # noqa: E731
            runners[method](warm_prompts)
    return runners, engines


def _summarise(results: dict) -> dict:
    out = {}
    cats = [c for c in results.get("vanilla", {}) if not c.startswith("_")]
    for method, per_cat in results.items():
        per_cat = {k: v for k, v in per_cat.items() if not k.startswith("_")}
        rows = {}
        for cat in cats + ["overall"]:
            if cat == "overall":
                toks = sum(per_cat[c]["tokens"] for c in cats)
                secs = sum(per_cat[c]["seconds"] for c in cats)
                base = sum(results["vanilla"][c]["tokens"] for c in cats) / sum(results["vanilla"][c]["seconds"] for c in cats)
                forwards = [per_cat[c]["tokens"] / per_cat[c]["tau"] for c in cats if per_cat[c]["tau"]]
                rows[cat] = {"tok_s": toks / secs, "speedup": toks / secs / base,      # pooled, as tok/s is
                             "tau": toks / sum(forwards) if len(forwards) == len(cats) else None}
            else:
                rows[cat] = {"tok_s": per_cat[cat]["tok_s"], "speedup": per_cat[cat]["tok_s"] / results["vanilla"][cat]["tok_s"],
                             "tau": per_cat[cat]["tau"]}
                if "share_lookup" in per_cat[cat]:
                    rows[cat]["share_lookup"] = per_cat[cat]["share_lookup"]
                    rows[cat]["share_head"] = per_cat[cat]["share_head"]
        out[method] = rows
    return out


def _paired(runs: dict, categories: list[str], a: str, b: str, resamples: int = 2000) -> dict:
    """Speed of `a` over `b` per category from passes run back to back (the same prompt in the same
    round): the median of b's time per token over a's, and a 95% bootstrap interval of that median.
    Two methods that do the same work differ only by the machine's noise, which the interval shows:
    a category whose interval straddles 1 is level within this run's noise. Medians, as elsewhere
    here, so one pass caught by a slow spell does not decide."""
    logs = defaultdict(list)
    for (method, i), rs in runs.items():
        if method == a:
            logs[categories[i]] += [math.log(rb[0] / rb[1] * ra[1] / ra[0]) for ra, rb in zip(rs, runs[(b, i)])]
    logs["overall"] = [x for c in list(logs) for x in logs[c]]
    rng, out = random.Random(0), {}
    for cat, xs in logs.items():
        meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(resamples))
        lo, hi = meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]
        out[cat] = {"ratio": math.exp(statistics.median(xs)), "ci95": [math.exp(lo), math.exp(hi)], "pairs": len(xs)}
    return out


def _print(summary: dict, paired: dict | None = None) -> None:
    methods = list(summary)
    cats = list(next(iter(summary.values())))
    print("\n| category | " + " | ".join(methods) + " |")
    print("|---|" + "---:|" * len(methods))
    for cat in cats:
        cells = []
        for m in methods:
            r = summary[m][cat]
            tau = f", τ {r['tau']:.2f}" if r["tau"] else ""
            src = f", lookup {r['share_lookup']:.0%}" if "share_lookup" in r else ""
            cells.append(f"{r['tok_s']:.1f} ({r['speedup']:.2f}x{tau}{src})")
        print(f"| {cat} | " + " | ".join(cells) + " |")
    for name, per_cat in (paired or {}).items():
        print(f"\n{name} (paired, 95% interval): " + ", ".join(
            f"{c} {r['ratio']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]" for c, r in per_cat.items()))


if __name__ == "__main__":       # the benchmarks' options live in one place, the CLI
    raise SystemExit("run this benchmark as `eaglectl bench spec [OPTIONS]` (`eaglectl bench spec --help`)")
