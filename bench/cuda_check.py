"""The CUDA paths, checked and timed in one run on a GPU machine (CI has none).

`python -m bench.cuda_check --out DIR [--device cuda]` builds tiny random targets (the test suite's),
then on the device: greedy output equals the CPU's; every draft method (chain, static and dynamic
trees with a random head, prompt lookup, the hybrid) reproduces plain greedy decoding; seeded
sampling runs; bfloat16 runs; a batch on one cached prefix (cascade attention) reproduces plain
greedy decoding; `train-head` trains a head there that reloads and speculates
losslessly; with 2 GPUs, speculation under tensor parallelism (two NCCL processes on cuda:0 and
cuda:1, the head and the hybrid) reproduces TP 1 plain greedy output (skipped, saying why, with
fewer; `--device cpu` runs it on gloo). It times decoding at a few batch sizes, and with `--spec-bench` also runs
`bench spec --batch-sizes 1,8,32` (every method, bf16) on the default model when its weights are on the machine
(DIR/spec_batch_cuda.json). Writes DIR/cuda_check.json;
exits 1 if any check failed. `--device cpu` dry-runs the same checks here.
"""
from __future__ import annotations

import json
import queue
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import click
import torch

from bench.report_file import write_json

PROMPTS = ["The quick brown fox", "Question: what is two plus two?\nAnswer:", "def add(a, b):",
           "Bonjour, comment ça va ?", "Speculative decoding drafts tokens and verifies them in one pass."]


def _tiny_targets(root: Path) -> dict[str, Path]:
    from tests.conftest import save_tiny_model

    return {f: save_tiny_model(f, root / f) for f in ("llama", "qwen2", "gemma3")}


def _random_head(target: Path, out: Path) -> Path:
    from eagle_worker import LLM
    from eagle_worker.speculative.head_init import new_head
    from eagle_worker.speculative.head_saver import save_draft_head

    runner = LLM(model=str(target), draft=None).engine.runner
    save_draft_head(new_head("eagle3", runner.model, runner.hf_config, torch.arange(64)), out)
    return out


def _greedy(llm, prompts, n=24):
    from eagle_worker import SamplingParams

    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))]


def check_engine(target: Path, head: Path, device: str) -> dict:
    from eagle_worker import LLM, SamplingParams
    from eagle_worker.speculative.config import SpecConfig

    cpu = _greedy(LLM(model=str(target), draft=None), PROMPTS)
    plain = _greedy(LLM(model=str(target), device=device, draft=None), PROMPTS)
    out = {"greedy_equals_cpu": plain == cpu}
    methods = {"chain": SpecConfig(draft=str(head), lookup=False, tree="chain", adaptive=False),
               "static": SpecConfig(draft=str(head), lookup=False, tree="static", adaptive=False),
               "dynamic": SpecConfig(draft=str(head), lookup=False, tree="dynamic", adaptive=False),
               "lookup": SpecConfig(lookup=True, adaptive=False),
               "hybrid": SpecConfig(draft=str(head), tree="dynamic", lookup=True, adaptive=False)}
    for name, spec in methods.items():
        out[f"{name}_lossless"] = _greedy(LLM(model=str(target), device=device, spec=spec), PROMPTS) == plain
    sampled = LLM(model=str(target), device=device, spec=methods["dynamic"]).generate(
        PROMPTS, SamplingParams(max_tokens=16, temperature=1.0, seed=0))
    out["sampling_runs"] = all(len(o.token_ids) > 0 for o in sampled)
    out["bf16_runs"] = all(len(t) == 24 for t in _greedy(LLM(model=str(target), device=device, dtype="bfloat16",
                                                             spec=methods["hybrid"]), PROMPTS))
    # a batch on one cached prefix: its keys are read once for all (cascade attention, trees included)
    cached = LLM(model=str(target), device=device, spec=methods["hybrid"])
    prefix = "A shared system prompt, sent with every request. "
    while len(cached.tokenizer.encode(prefix)) < 96:
        prefix += prefix
    shared = [prefix + p for p in PROMPTS]
    cached.generate(shared[:1], SamplingParams(max_tokens=4, temperature=0.0))
    uncached = LLM(model=str(target), device=device, draft=None, enable_prefix_caching=False)
    out["cached_prefix_lossless"] = _greedy(cached, shared) == _greedy(uncached, shared)
    return out


def _tp2_rank(rank: int, port: int, backend: str, jobs: list[dict], out) -> None:
    """One rank of a TP 2 replica: rank 0 runs each job's engine and reports its greedy tokens, rank 1
    follows in the worker loop (eagle_worker/tp_worker.py). Each rank's engine device is its own
    GPU (`EngineConfig.device`, cuda:{rank}) under NCCL, the CPU under gloo."""
    import torch.distributed as dist

    from eagle_worker import LLM, init_tensor_parallel
    from eagle_worker.config import EngineConfig
    from eagle_worker.speculative.config import SpecConfig
    from eagle_worker.tp_worker import run_tp_worker

    torch.set_num_threads(1)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)          # broadcast_object_list stages through the current device
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    init_tensor_parallel(rank, 2)
    try:
        for job in jobs:
            kw = {"model": job["target"], "device": device, "tp_size": 2, "draft": None}
            if rank:
                run_tp_worker(EngineConfig(**kw))
                continue
            llm = LLM(spec=SpecConfig(**job["spec"]) if job["spec"] else None, **kw)
            out.put((job["name"], _greedy(llm, PROMPTS)))
            llm.engine.shutdown()
    finally:
        dist.destroy_process_group()


def check_tp2(targets: dict[str, Path], heads: dict[str, Path], device: str) -> dict:
    """TP 2 (plain, head with the dynamic tree, hybrid) greedy output equals TP 1 plain on `device`."""
    import torch.multiprocessing as mp

    from eagle_worker import LLM

    if device.startswith("cuda"):
        if torch.cuda.device_count() < 2:
            reason = f"needs 2 GPUs for TP 2 over NCCL, this machine has {torch.cuda.device_count()}"
            print(f"tp2_spec: skipped ({reason})", flush=True)
            return {"skipped": reason}
        backend = "nccl"
    else:
        backend = "gloo"
    jobs, expected = [], {}
    for family in ("llama", "gemma3"):
        target, head = str(targets[family]), str(heads[family])
        expected[family] = _greedy(LLM(model=target, device=device, draft=None), PROMPTS)
        for name, spec in (("plain", None), ("head", dict(draft=head, tree="dynamic", adaptive=False)),
                           ("hybrid", dict(draft=head, tree="dynamic", lookup=True, adaptive=False))):
            jobs.append({"name": f"{family}_{name}", "target": target, "spec": spec})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_tp2_rank, args=(r, port, backend, jobs, out)) for r in range(2)]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + 600
    try:
        while len(results) < len(jobs):
            try:
                name, tokens = out.get(timeout=2)
                results[name] = tokens
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"TP 2 ranks: exit codes {dead}, {len(results)}/{len(jobs)} jobs done "
                                       "(see their stderr)") from None
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
    report = {"backend": backend}
    for job in jobs:
        family = job["name"].split("_")[0]
        report[f"tp2_{job['name'].split('_', 1)[1]}_equals_tp1_{family}"] = results[job["name"]] == expected[family]
    return report


def time_decoding(target: Path, head: Path, device: str, sizes=(1, 16, 64), tokens: int = 64) -> list[dict]:
    from eagle_worker import LLM
    from eagle_worker.speculative.config import SpecConfig

    engines = {"vanilla": LLM(model=str(target), device=device, draft=None),
               "dynamic": LLM(model=str(target), device=device, spec=SpecConfig(draft=str(head), lookup=False, adaptive=False))}
    rows = []
    for bs in sizes:
        batch = (PROMPTS * bs)[:bs]
        row = {"batch": bs}
        for name, llm in engines.items():
            _greedy(llm, batch, 8)                                 # warm-up
            t0 = time.perf_counter()
            n = sum(len(t) for t in _greedy(llm, batch, tokens))
            row[f"{name}_tok_s"] = round(n / (time.perf_counter() - t0), 1)
        rows.append(row)
    return rows


def check_training(target: Path, work: Path, device: str) -> dict:
    from eagle_worker import LLM
    from eagle_worker.speculative.config import SpecConfig
    from eagle_worker.training.pipeline import PipelineConfig, run
    from eagle_worker.training.trainer import TrainConfig

    work.mkdir(parents=True, exist_ok=True)
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 8))
    out = work / "head"
    t0 = time.perf_counter()
    record = run(PipelineConfig(target=str(target), out=str(out), data=[str(data)], device=device, prompt_format="{prompt}",
                                draft_vocab_size=128, self_distill=16, distill_tokens=24, max_tokens=64, heldout=4,
                                eval_prompts=0, train=TrainConfig(steps=24, lr=1e-2, warmup_steps=4, batch_tokens=512,
                                                                  row_len=64, checkpoint_every=12, eval_every=12)),
                 progress=False)
    seconds = time.perf_counter() - t0
    plain = _greedy(LLM(model=str(target), device=device, draft=None), PROMPTS)
    spec = _greedy(LLM(model=str(target), device=device, spec=SpecConfig(draft=str(out), lookup=False, adaptive=False)), PROMPTS)
    return {"train_head_steps": record["steps"], "train_head_s": round(seconds, 1),
            "heldout_acc": record["metrics"].get("heldout_acc"), "trained_head_lossless": spec == plain,
            "trained_head_ran": record["steps"] == 24}


def spec_bench_step(device: str, out: Path) -> list[dict]:
    """`bench spec --batch-sizes 1,8,32` on the default model in bf16 on `device`, every method: the
    speedups the README reports for this CPU, measured on the GPU; its rows per batch size."""
    from bench.spec_batch import METHODS, run

    return run(dtype="bfloat16", per_category=1, device=device, batch_sizes=(1, 8, 32), methods=METHODS,
               json_out=str(out / "spec_batch_cuda.json"))["batches"]


@click.command()
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder for cuda_check.json.")
@click.option("--device", default="cuda", show_default=True)
@click.option("--spec-bench", is_flag=True, help="Also `bench spec` on the default model (needs its weights there).")
@click.option("--decode-tokens", default=64, show_default=True, type=click.IntRange(1, 4096),
              help="Tokens per request in the decode timings (a dry run on CPU needs fewer).")
def main(out, device, spec_bench, decode_tokens):
    from eagle_worker.config import check_device

    try:
        check_device(device)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--device") from None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": device, "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(device) if device.startswith("cuda") else None}
    root = Path(tempfile.mkdtemp(prefix="cuda-check-"))
    targets = _tiny_targets(root)
    heads = {f: _random_head(t, root / f"head-{f}") for f, t in targets.items()}
    steps = [(f"engine_{f}", lambda f=f: check_engine(targets[f], heads[f], device)) for f in targets]
    steps += [("tp2_spec", lambda: check_tp2(targets, heads, device)),
              ("decode_tok_s", lambda: time_decoding(targets["llama"], heads["llama"], device, tokens=decode_tokens)),
              ("train_head", lambda: check_training(targets["llama"], root / "train", device))]
    if spec_bench:
        steps.append(("spec_bench", lambda: spec_bench_step(device, out)))
    failed = []
    for name, fn in steps:
        t0 = time.perf_counter()
        try:
            report[name] = fn()
        except Exception:                                     # keep going: one broken path hides no other
            report[name] = {"error": traceback.format_exc()}
        result = report[name] if isinstance(report[name], dict) else {}
        bad = "error" in result or any(v is False for v in result.values())   # a check that did not hold
        failed += [name] if bad else []
        print(f"{name}: {'FAILED' if bad else 'ok'} ({time.perf_counter() - t0:.1f} s)", flush=True)
        write_json(out / "cuda_check.json", report)
    print(json.dumps({"failed": failed}), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
