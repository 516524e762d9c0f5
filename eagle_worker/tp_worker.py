"""The loop ranks 1..n-1 of a tensor-parallel replica run.

Rank 0 owns the scheduler, the sampler and the draft head; for each target forward (and each KV
compaction after speculative acceptance, and the one-time gather of the vocabulary tables a draft
head borrows) its `ModelRunner` broadcasts the command, and every rank runs the same sharded
computation (`forward_local` / `copy_kv_local` / `gather_vocab_local`), meeting in the layers'
all-reduce / all-gather. The cluster package starts this loop on each non-zero rank after the
process group exists and `init_tensor_parallel` ran (the engine contract, eagle_worker/engine_api.py;
cluster/tp_group.py).
"""
from __future__ import annotations

from eagle_worker.config import EngineConfig
from eagle_worker.model_runner import ModelRunner
from eagle_worker.parallel import broadcast_from_rank0, tp_rank


def run_tp_worker(config: EngineConfig) -> ModelRunner:
    """Build this rank's shard and follow rank 0's commands until "stop"; returns the runner (tests
    compare the ranks' KV caches)."""
    if tp_rank() == 0:
        raise RuntimeError("run_tp_worker runs on ranks 1..n-1; rank 0 runs the LLMEngine")
    runner = ModelRunner(config)
    local = {"forward": runner.forward_local, "copy_kv": runner.copy_kv_local,
             "gather_vocab": runner.gather_vocab_local, "noop": lambda: None}
    while True:
        command = broadcast_from_rank0()
        if command[0] == "stop":
            return runner
        if command[0] not in local:
            raise RuntimeError(f"unknown tensor-parallel command {command[0]!r}")
        local[command[0]](*command[1:])
