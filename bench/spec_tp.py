"""Speculation under tensor parallelism on this machine: `eaglectl bench spec --tp-size 2`.

Methods (greedy, Spec-Bench prompts, each batch size in turn): vanilla at TP 1 (1 torch thread, and
2 threads: the whole machine), vanilla at TP 2, the shipped head (dynamic tree) at TP 2 and the
hybrid (head + prompt lookup) at TP 2; every TP 2 rank runs 1 torch thread. This process is rank 0
(scheduler, sampler, draft head); a spawned process is rank 1 and follows rank 0's commands. All
engines stay loaded and take turns batch by batch, the order rotating, as in bench/spec.py; with
`rounds` > 1 each batch's median time counts. Rank 0 counts its collectives
(eagle_worker/parallel.py: comm_stats) around every measured `generate`, so a row reports per
engine step: wall ms, all-reduce/all-gather ms and calls, the command broadcast's ms, and the
share of the step spent in communication; rank 1 reports its own counters (its broadcast seconds
are the time it waits while rank 0 drafts, samples and schedules). Every TP 2 output must be
token-identical to vanilla TP 1 at the same batch size, or the run fails after writing its JSON.
"""
from __future__ import annotations

import socket
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.prompts import PROMPT_FORMAT, SPEC_BENCH, load_questions, render
from bench.report_file import run_meta, write_json

# name -> (tp size, rank-0 torch threads, speculation: None | "head" | "hybrid")
METHODS = {"vanilla-tp1": (1, 1, None), "vanilla-tp1-2t": (1, 2, None), "vanilla-tp2": (2, 1, None),
           "head-tp2": (2, 1, "head"), "hybrid-tp2": (2, 1, "hybrid")}
BASELINE = "vanilla-tp1"
COLLECTIVES = ("all_reduce", "all_gather_last_dim", "all_gather_rows")
BROADCAST = "broadcast_from_rank0"
WARM_PROMPT = "Warm-up: list three colours."


class OutputsDiffer(RuntimeError):
    """A TP 2 method's greedy tokens differ from vanilla TP 1's."""


def _engine_kwargs(model: str, dtype: str, method: str) -> dict:
    from eagle_worker.speculative.config import SpecConfig

    tp, _, spec = METHODS[method]
    kw = {"model": model, "dtype": dtype, "tp_size": tp, "kv_cache_gb": 0.25, "draft": None}
    if spec:        # fixed trees (adaptive=False): the same work every step, as bench/spec.py measures
        kw["spec"] = SpecConfig(draft="default", tree="dynamic", lookup=spec == "hybrid", adaptive=False)
    return kw


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank1(port: int, out) -> None:
    """Rank 1: one ModelRunner per TP 2 method, following rank 0's commands; bench commands pick the
    runner ("bench_use") and mark measured spans, whose collective counters go back to rank 0."""
    from eagle_worker import init_tensor_parallel
    from eagle_worker.config import EngineConfig
    from eagle_worker.model_runner import ModelRunner
    from eagle_worker.parallel import broadcast_from_rank0, comm_stats, enable_comm_stats

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    init_tensor_parallel(1, 2)
    enable_comm_stats()
    runners, current, measured = {}, None, False
    totals: dict[str, dict[str, dict]] = defaultdict(dict)

    def settle():
        for name, c in comm_stats(reset=True).items():
            if measured and current:
                row = totals[current].setdefault(name, {"calls": 0, "seconds": 0.0})
                row["calls"] += c["calls"]
                row["seconds"] += c["seconds"]

    while True:
        command = broadcast_from_rank0()
        op = command[0]
        if op == "bench_build":
            runners[command[1]] = ModelRunner(EngineConfig(**command[2]))
        elif op == "bench_use":
            settle()
            current, measured = command[1], command[2]
        elif op == "bench_end":
            settle()
            break
        elif op == "stop":
            continue                                  # an engine's shutdown; the bench ends with bench_end
        else:
            runner = runners[current]
            {"forward": runner.forward_local, "copy_kv": runner.copy_kv_local,
             "gather_vocab": runner.gather_vocab_local}[op](*command[1:])
    out.put(dict(totals))
    dist.destroy_process_group()


def _batches(prompts: list[str], bs: int) -> list[list[str]]:
    """Consecutive batches of `bs` prompts; the last one filled up from the start of the list."""
    n = -(-len(prompts) // bs) * bs
    cycled = (prompts * (n // max(len(prompts), 1) + 1))[:n]
    return [cycled[i:i + bs] for i in range(0, n, bs)]


def run(model: str = "gemma-3-270m", prompts_file: str | Path = SPEC_BENCH, per_category: int = 1,
        max_tokens: int = 64, dtype: str = "float32", batch_sizes: tuple[int, ...] = (1, 8),
        json_out: str | None = "bench/results/spec_tp.json", rounds: int = 1, tp_size: int = 2,
        methods: tuple[str, ...] = tuple(METHODS)) -> dict:
    if tp_size != 2:
        raise ValueError(f"the TP benchmark runs TP 2 on this machine's CPUs, got tp_size={tp_size}")
    if BASELINE not in methods or any(m not in METHODS for m in methods):
        raise ValueError(f"methods must be among {list(METHODS)} and include {BASELINE}, got {list(methods)}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    prompts = [render(r) for r in load_questions(prompts_file, per_category=per_category)]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _port()
    follower = ctx.Process(target=_rank1, args=(port, out), daemon=True)
    follower.start()
    try:
        runs, tokens, rank1 = _rank0(port, model, dtype, methods, prompts, batch_sizes, max_tokens, rounds, out)
    finally:
        if follower.is_alive():
            follower.join(timeout=60)
        if follower.is_alive():
            follower.terminate()
    rows = summarise(runs, rank1)
    mismatches = compare_outputs(tokens)
    report = {"meta": {"model": model, "dtype": dtype, "max_tokens": max_tokens, "prompt_format": PROMPT_FORMAT,
                       "prompts": str(prompts_file), "per_category": per_category, "num_prompts": len(prompts),
                       "batch_sizes": list(batch_sizes), "rounds": rounds, "torch": torch.__version__,
                       "backend": "gloo", "device": "cpu", "cpu_cores": torch.multiprocessing.cpu_count(),
                       "threads": {m: {"rank0": METHODS[m][1], "ranks": METHODS[m][0]} for m in methods},
                       "spec": "draft=default, tree=dynamic (SpecConfig defaults), adaptive=False; hybrid adds lookup=True",
                       "greedy": True, **run_meta()},
              "rows": rows, "identical_to_tp1": not mismatches, "mismatches": mismatches}
    print(table(rows))
    print("\nTP 2 outputs token-identical to vanilla TP 1: " + ("yes" if not mismatches else f"NO {mismatches}"))
    if json_out:
        write_json(json_out, report)
    if mismatches:
        raise OutputsDiffer(f"TP 2 greedy outputs differ from vanilla TP 1: {mismatches}")
    return report


def _rank0(port, model, dtype, methods, prompts, batch_sizes, max_tokens, rounds, out):
    from eagle_worker import LLM, SamplingParams, init_tensor_parallel
    from eagle_worker.parallel import broadcast_from_rank0, comm_stats, enable_comm_stats, single_rank

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    init_tensor_parallel(0, 2)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    engines = {}

    def use(method, measured):
        broadcast_from_rank0(("bench_use", method, measured))
        torch.set_num_threads(METHODS[method][1])

    def generate(method, batch):
        if METHODS[method][0] == 1:
            with single_rank():                       # TP 1 in a TP process: no collectives, no commands
                return engines[method].generate(batch, params)
        return engines[method].generate(batch, params)

    try:
        for method in methods:
            kw = _engine_kwargs(model, dtype, method)
            t0 = time.perf_counter()
            if METHODS[method][0] == 2:
                broadcast_from_rank0(("bench_build", method, kw))
                use(method, False)
                engines[method] = LLM(**kw)                      # its head gathers the vocab tables now
            else:
                with single_rank():
                    engines[method] = LLM(**{**kw, "tp_size": 1})
                use(method, False)
            generate(method, [WARM_PROMPT])
            print(f"loaded {method} ({time.perf_counter() - t0:.1f} s)", flush=True)
        enable_comm_stats()
        runs, tokens = defaultdict(list), {}   # (method, bs, batch index) -> per round; (method, bs) -> ids
        for bs in batch_sizes:
            batches = _batches(prompts, bs)
            for rnd in range(rounds):
                for i, batch in enumerate(batches):
                    k = (i + rnd) % len(methods)
                    for method in methods[k:] + methods[:k]:
                        use(method, True)
                        engine = engines[method].engine
                        steps0 = engine.totals["steps"]
                        comm_stats(reset=True)
                        t0 = time.perf_counter()
                        outs = generate(method, batch)
                        secs = time.perf_counter() - t0
                        comm = comm_stats(reset=True)
                        ids = [o.token_ids for o in outs]
                        n = sum(len(t) for t in ids)
                        forwards = sum(o.metrics["num_target_forwards"] + 1 for o in outs)
                        runs[(method, bs, i)].append({"seconds": secs, "tokens": n, "forwards": forwards,
                                                      "steps": engine.totals["steps"] - steps0, "comm": comm})
                        tokens.setdefault((method, bs), {})[i] = ids if rnd == 0 else tokens[(method, bs)][i]
                        if rnd and ids != tokens[(method, bs)][i]:
                            tokens[(method, bs)][i] = ("round-dependent", ids)
                        print(f"bs {bs} round {rnd + 1} batch {i + 1}/{len(batches)} {method:15s} "
                              f"{n / secs:7.2f} tok/s", flush=True)
        use(methods[0], False)
        broadcast_from_rank0(("bench_end",))
        rank1 = out.get(timeout=120)
    finally:
        enable_comm_stats(False)
        torch.set_num_threads(1)
        if dist.is_initialized():
            dist.destroy_process_group()
        init_tensor_parallel(0, 1)
    return runs, {f"{m}@{bs}": [v[i] for i in sorted(v)] for (m, bs), v in tokens.items()}, rank1


def summarise(runs: dict, rank1: dict | None = None) -> list[dict]:
    """One row per (batch size, method): per batch the median seconds over rounds and the mean of
    the rest, summed over batches. Per engine step: wall ms, collective ms and calls (all-reduce and
    all-gathers), broadcast ms and calls, and communication's share of the wall time."""
    acc = {}
    for (method, bs, _), rs in runs.items():
        a = acc.setdefault((bs, method), defaultdict(float))
        a["seconds"] += statistics.median(r["seconds"] for r in rs)
        for key in ("tokens", "forwards", "steps"):
            a[key] += sum(r[key] for r in rs) / len(rs)
        for r in rs:
            for name, c in r["comm"].items():
                group = "bcast" if name == BROADCAST else "coll"
                a[group + "_s"] += c["seconds"] / len(rs)
                a[group + "_calls"] += c["calls"] / len(rs)
                a["time_" + name] += c["seconds"] / len(rs)
    rows = []
    for (bs, method), a in sorted(acc.items(), key=lambda kv: (kv[0][0], list(METHODS).index(kv[0][1]))):
        steps = a["steps"] or 1
        row = {"batch": bs, "method": method, "tp": METHODS[method][0], "rank0_threads": METHODS[method][1],
               "tok_s": a["tokens"] / a["seconds"], "tau": a["tokens"] / a["forwards"] if a["forwards"] else None,
               "steps": a["steps"], "step_ms": 1e3 * a["seconds"] / steps,
               "collective_ms": 1e3 * a["coll_s"] / steps, "collective_calls": a["coll_calls"] / steps,
               "broadcast_ms": 1e3 * a["bcast_s"] / steps, "broadcast_calls": a["bcast_calls"] / steps,
               "comm_share": (a["coll_s"] + a["bcast_s"]) / a["seconds"],
               "collective_ms_by_name": {k[5:]: 1e3 * v / steps for k, v in a.items() if k.startswith("time_")}}
        if rank1 and method in rank1:          # rank 1, all batch sizes together
            row["rank1_seconds_by_name"] = {k: v["seconds"] for k, v in rank1[method].items()}
        rows.append(row)
    return rows


def compare_outputs(tokens: dict) -> list[str]:
    """The '{method}@{batch}' keys whose token ids differ from vanilla TP 1's at that batch size."""
    bad = []
    for key, ids in tokens.items():
        method, bs = key.split("@")
        if method != BASELINE and ids != tokens.get(f"{BASELINE}@{bs}"):
            bad.append(key)
    return bad


def table(rows: list[dict]) -> str:
    lines = ["| batch | method | TP x rank-0 threads | tok/s | τ | step ms | collectives ms (calls) / step "
             "| broadcast ms / step | comm share |", "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        comm = (f"{r['collective_ms']:.2f} ({r['collective_calls']:.1f})", f"{r['broadcast_ms']:.2f}",
                f"{r['comm_share']:.0%}") if r["tp"] > 1 else ("-", "-", "-")
        lines.append(f"| {r['batch']} | {r['method']} | {r['tp']} x {r['rank0_threads']} | {r['tok_s']:.1f} | {tau} "
                     f"| {r['step_ms']:.1f} | {comm[0]} | {comm[1]} | {comm[2]} |")
    return "\n".join(lines)
