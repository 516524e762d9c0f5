"""tp_size=2 (two gloo processes, rank 1 in the worker loop) gives the same greedy tokens as tp_size=1,
on a Gemma 3 config with a single KV head (replicated across ranks) and an odd vocabulary split, and
the same seeded temperature-1 tokens: full logits gathered across the ranks there, the LM head's
screen on one rank (logit_rows.py)."""
from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from eagle_worker import LLM, SamplingParams
from eagle_worker.config import EngineConfig

PROMPTS = ["The quick brown fox", "def add(a, b):\n", "Question: what is two plus two?\nAnswer:"]


def _rank(rank: int, world: int, port: int, model: str, out):
    from eagle_worker.parallel import init_tensor_parallel
    from eagle_worker.tp_worker import run_tp_worker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    init_tensor_parallel(rank, world)
    kw = dict(model=model, tp_size=world, block_size=4, num_kv_blocks=128)
    if rank == 0:
        llm = LLM(**kw)
        out.put([[o.token_ids for o in llm.generate(PROMPTS, p)] for p in _params()]
                + [_prompt_scores(llm)])
        llm.engine.shutdown()
    else:
        run_tp_worker(EngineConfig(**kw))
    dist.destroy_process_group()


def _params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)]


def _prompt_scores(llm) -> list:
    """Prompt logprobs (rank 0 scores; the other ranks only join the logits' gather), rounded."""
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, prompt_logprobs=2))
    return [[None if s is None else (s.token_id, round(s.logprob, 3), [t for t, _ in s.top]) for s in o.prompt_logprobs]
            for o in outs]


def test_tp2_greedy_and_sampled_equal_tp1(tmp_path):
    from tests.conftest import save_random_model, tiny_config

    torch.manual_seed(0)
    cfg = tiny_config("gemma3", vocab_size=321)
    cfg.num_key_value_heads = 1
    save_random_model(cfg, tmp_path)
    single = LLM(model=str(tmp_path), block_size=4, num_kv_blocks=128)
    expected = [[o.token_ids for o in single.generate(PROMPTS, p)] for p in _params()] + [_prompt_scores(single)]
    assert expected[0] != expected[1] and all(len(s) > 3 for s in expected[2])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, str(tmp_path), out)) for r in range(2)]
    for p in procs:
        p.start()
    got = out.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert got == expected


def test_tp_size_without_a_group_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="tensor-parallel group"):
        LLM(model=str(tiny_model_dir("llama")), tp_size=2)


def _idle_rank(rank: int, port: int, model: str, keep_alive: bool, out):
    """A group whose collectives time out after 5 s (room for the ranks' model builds on a busy
    machine); rank 0 serves, idles 7 s, serves again."""
    import datetime
    import time

    from eagle_worker.parallel import init_tensor_parallel
    from eagle_worker.tp_worker import run_tp_worker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=5))
    init_tensor_parallel(rank, 2)
    kw = dict(model=model, tp_size=2, block_size=4, num_kv_blocks=64)
    try:
        if rank == 0:
            llm = LLM(**kw)
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            first = llm.generate(PROMPTS[0], params)[0].token_ids
            for _ in range(7):
                time.sleep(1.0)
                if keep_alive:
                    llm.engine.keep_alive()
            out.put(("rank 0", first == llm.generate(PROMPTS[0], params)[0].token_ids))
            llm.engine.shutdown()
        else:
            run_tp_worker(EngineConfig(**kw))
            out.put(("rank 1", True))
    except Exception as e:   # noqa: BLE001 - the outcome is what the test reads
        out.put((f"rank {rank}", f"{type(e).__name__}: {str(e)[:200]}"))


@pytest.mark.slow
def test_an_idle_group_kept_alive_outlasts_its_collective_timeout(tiny_model_dir):
    """Ranks 1..n-1 wait for rank 0's next command in a collective, which times out with the process
    group: an idle engine's `keep_alive` (the replica's loop calls it every TP_KEEPALIVE_S) keeps the
    group usable; without it, the wait times out and the group is gone (a TP replica died after 300 s
    without requests)."""
    results = {}
    for keep_alive in (True, False):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=_idle_rank, args=(r, port, str(tiny_model_dir("llama")), keep_alive, out))
                 for r in range(2)]
        for p in procs:
            p.start()
        got = dict(out.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=30)
            if p.exitcode is None:
                p.kill()
        results[keep_alive] = got
    assert results[True] == {"rank 0": True, "rank 1": True}, results
    assert results[False]["rank 1"] is not True and results[False]["rank 0"] is not True, results
