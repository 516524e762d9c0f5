"""Speculation under tensor parallelism: TP 2 (two gloo processes, rank 1 in the worker loop) with a
draft head, prompt lookup or both gives exactly TP 1's greedy tokens without speculation; seeded
sampling gives exactly TP 1's sampled tokens without speculation (keyed draws); and every rank keeps the
same KV (a single KV head is replicated, so the two ranks' caches must match bit for bit)."""
from __future__ import annotations

import queue
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from eagle_worker import LLM, SamplingParams, SpecConfig
from eagle_worker.config import EngineConfig

PROMPTS = ["The quick brown fox", "def add(a, b):\n", "Question: what is two plus two?\nAnswer:", "x",
           "Speculative decoding drafts tokens and verifies them in one pass.",
           "red green blue red green blue red green"]   # repeats itself: lookup has occurrences to copy
GREEDY = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
SAMPLED = dict(max_tokens=16, temperature=1.0, top_k=3, ignore_eos=True)


def sampled(n: int) -> list[SamplingParams]:
    """Seeded sampling params for n requests (request i has seed i)."""
    return [SamplingParams(**SAMPLED, seed=i) for i in range(n)]
KV = dict(block_size=4, num_kv_blocks=512)
METHODS = {        # name -> SpecConfig keywords besides the head
    "eagle3-dynamic": dict(kind="eagle3", tree="dynamic", depth=3, top_k=3, num_draft_tokens=6),
    "eagle3-chain": dict(kind="eagle3", tree="chain", depth=3),
    "eagle-static": dict(kind="eagle", tree="static"),
    "eagle-dynamic": dict(kind="eagle", tree="dynamic", depth=3, top_k=3, num_draft_tokens=6),
    "lookup": dict(kind=None, lookup=True),
    "hybrid": dict(kind="eagle3", lookup=True, depth=3, top_k=3, num_draft_tokens=6),
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(rank: int, port: int, model: str, jobs: list[dict], out) -> None:
    """Rank 0 runs each job's engine and reports; rank 1 follows it in the worker loop."""
    from eagle_worker import init_tensor_parallel
    from eagle_worker.tp_worker import run_tp_worker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    init_tensor_parallel(rank, 2)
    for job in jobs:
        kw = {"model": model, "tp_size": 2, **KV, **job.get("engine", {})}
        if rank:
            runner = run_tp_worker(EngineConfig(**kw))
            out.put(("kv", runner.kv_cache.numpy().copy()))      # by value: this process exits first
            continue
        llm = LLM(spec=SpecConfig(**job["spec"]) if job.get("spec") else None, **kw)
        prompts = job.get("prompts", PROMPTS)
        params = sampled(len(prompts)) if job.get("sampled") else SamplingParams(**GREEDY)
        result = [o.token_ids for o in llm.generate(prompts, params)]
        out.put(("result", job["name"], result, llm.engine.stats(), llm.engine.runner.kv_cache.numpy().copy()))
        llm.engine.shutdown()
    dist.destroy_process_group()


def run_tp2(model: str, jobs: list[dict]) -> dict[str, tuple]:
    """{job name: (result, rank 0 stats, rank 0 KV cache, rank 1 KV cache)}."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_run_rank, args=(r, port, model, jobs, out)) for r in range(2)]
    for p in procs:
        p.start()
    results, kvs = {}, []
    deadline = time.monotonic() + 900
    for _ in range(2 * len(jobs)):
        while True:                      # a rank that crashed fails the test at once, not at the deadline
            try:
                msg = out.get(timeout=2)
                break
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not dead and time.monotonic() < deadline, f"a rank exited with {dead} (see its stderr)"
        if msg[0] == "kv":
            kvs.append(msg[1])
        else:
            results[msg[1]] = msg[2:]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return {job["name"]: (*results[job["name"]], kv) for job, kv in zip(jobs, kvs)}


def heads_for(target, tmp_path) -> dict[str, str]:
    """A random EAGLE-1 and EAGLE-3 head for `target`, made on one rank."""
    from eagle_worker.speculative.head_init import new_head
    from eagle_worker.speculative.head_saver import save_draft_head

    runner = LLM(model=str(target), **KV, draft=None).engine.runner
    paths = {}
    for kind in ("eagle", "eagle3"):
        vocab = torch.arange(0, runner.model.vocab_size, 2) if kind == "eagle3" else None
        paths[kind] = str(save_draft_head(new_head(kind, runner.model, runner.hf_config, vocab, std=0.2), tmp_path / kind))
    return paths


def spec_job(name: str, heads: dict, **engine) -> dict:
    method = dict(METHODS[name])
    kind = method.pop("kind")
    return {"name": name, "spec": dict(draft=heads[kind] if kind else None, adaptive=False, **method), "engine": engine}


# gemma3 (one KV head, replicated: both ranks must keep the same cache) runs in the fast tier; the other
# families spawn the same two rank processes for each of six methods (slow: subprocesses)
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) for f in ("llama", "qwen2", "qwen3")]
                         + ["gemma3"])
def test_tp2_speculation_greedy_equals_tp1_plain(family, tmp_path):
    """Every method on llama, three on the others; a 7-token step budget chunks prompts, so trees
    share steps with prefill chunks and plain decodes."""
    from tests.conftest import save_random_model, tiny_config

    torch.manual_seed(0)                            # one target whatever ran before: lookup's chances depend on its text
    cfg = tiny_config(family, vocab_size=321)       # an odd vocabulary: the ranks' shards differ in size
    cfg.num_key_value_heads = 1                     # replicated on both ranks
    target = save_random_model(cfg, tmp_path / "target")
    expected = [o.token_ids for o in LLM(model=str(target), **KV, draft=None).generate(PROMPTS, SamplingParams(**GREEDY))]
    heads = heads_for(target, tmp_path)
    names = list(METHODS) if family == "llama" else ["eagle3-dynamic", "eagle-static", "hybrid"]
    jobs = [spec_job(n, heads, max_num_batched_tokens=7) for n in names]
    if family == "llama":                           # sampling too: rank 1 must keep what rank 0 accepted
        jobs.append({**spec_job("hybrid", heads), "name": "sampled", "sampled": True})
    results = run_tp2(str(target), jobs)
    if family == "llama":
        tokens, stats, kv0, kv1 = results.pop("sampled")
        plain = LLM(model=str(target), **KV, draft=None).generate(PROMPTS, sampled(len(PROMPTS)))
        assert tokens == [o.token_ids for o in plain], "sampling: TP 2 with speculation differs from TP 1 plain"
        assert stats["spec_steps"] > 0 and (kv0 == kv1).all(), "sampling: the ranks' KV caches differ"
    for name in names:
        tokens, stats, kv0, kv1 = results[name]
        assert tokens == expected, name
        assert stats["spec_steps"] > 0, name
        assert (kv0 == kv1).all(), f"{name}: the ranks' KV caches differ"


def test_tp2_speculative_sampling_same_seed_same_tokens(copying_target):
    """The copying target's head accepts a lot, so the drafts matter: TP 2 with the head samples
    exactly TP 1's tokens without one, seed for seed."""
    target, head = copying_target
    prompts = PROMPTS * 4
    plain = LLM(model=str(target), draft=None, **KV).generate(prompts, sampled(len(prompts)))
    spec = dict(draft=str(head), tree="dynamic", top_k=3, num_draft_tokens=6, depth=3, adaptive=False)
    results = run_tp2(str(target), [{"name": "spec", "spec": spec, "sampled": True, "prompts": prompts}])
    tokens, stats, kv0, kv1 = results["spec"]
    assert stats["acceptance_rate_per_depth"][0] > 0.3
    assert tokens == [o.token_ids for o in plain]      # (two KV heads: sharded, so no KV comparison)


def test_tp2_hybrid_on_a_copying_target_accepts_and_stays_exact(copying_target):
    """Lookup and the head both accept here (tau well above 1), batched with chunked prefills."""
    target, head = copying_target
    first = LLM(model=str(target), **KV, draft=None).generate("def add(a, b):\n", SamplingParams(**GREEDY))[0]
    prompts = ["def add(a, b):\n" + first.text + "\ndef add(a, b):\n"] + PROMPTS
    expected = [o.token_ids for o in LLM(model=str(target), **KV, draft=None).generate(prompts, SamplingParams(**GREEDY))]
    jobs = [{"name": "hybrid", "spec": dict(draft=str(head), lookup=True, adaptive=False), "engine": {},
             "prompts": prompts}]
    results = run_tp2(str(target), jobs)
    tokens, stats, kv0, kv1 = results["hybrid"]
    assert tokens == expected
    assert stats["spec_steps"] > 0 and stats["acceptance_rate_per_depth"][0] > 0.5   # (two KV heads: sharded)


def test_tp2_default_model_with_its_head_equals_tp1_plain(default_model_dir):
    """gemma-3-270m (262K vocabulary split over 2 ranks, one KV head replicated) with its shipped
    EAGLE-3 head (fusing three layers' inputs, taken from the complete residual stream) and the
    hybrid, 2 ranks x 1 core: TP 1's greedy tokens without a head."""
    prompts = PROMPTS[:3]
    base = LLM(model="gemma-3-270m", draft=None, **KV)
    expected = [o.token_ids for o in base.generate(prompts, SamplingParams(**GREEDY))]
    del base
    jobs = [{"name": name, "prompts": prompts, "spec": dict(draft="default", adaptive=False, lookup=lookup)}
            for name, lookup in (("head", False), ("hybrid", True))]
    results = run_tp2("gemma-3-270m", jobs)
    for name in ("head", "hybrid"):
        tokens, stats, kv0, kv1 = results[name]
        assert tokens == expected, name
        assert stats["spec_steps"] > 0 and stats["acceptance_rate_per_depth"][0] > 0.2, (name, stats)
        assert (kv0 == kv1).all(), name
