"""tp_size=2 (two gloo processes, rank 1 in the worker loop) gives the same greedy tokens as tp_size=1,
on a Gemma 3 config with a single KV head (replicated across ranks) and an odd vocabulary split, and
the same seeded temperature-1 tokens: full logits gathered across the ranks there, the LM head's
screen on one rank (logit_rows.py)."""
from __future__ import annotations

import socket

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
    import pytest
    with pytest.raises(ValueError, match="tensor-parallel group"):
        LLM(model=str(tiny_model_dir("llama")), tp_size=2)
