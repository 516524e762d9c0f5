"""TPGroup: the ranks of one tensor-parallel replica as Ray actors in the replica's placement group.

Rank 0 is the replica itself (cluster/replica.py, bundle 0 of the placement group Serve reserves
for it via `placement_group_bundles`); ranks 1..n-1 are `TPRankWorker` actors pinned to bundles
1..n-1, so PACK / STRICT_PACK decide whether a replica may span nodes. All ranks join one
torch.distributed group (gloo on CPU, NCCL on CUDA) whose TCP rendezvous is hosted by rank 0, then
call the engine module's `init_tensor_parallel(rank, world)` so the sharded layers know their slice.

Engine side: the engine contract (eagle_worker/engine_api.py, `EngineModule`); eagle_worker's
tp_worker.py and parallel.py implement it:
  * every rank calls `<engine module>.init_tensor_parallel(rank, world)` once the group exists;
  * ranks 1..n-1 call `<engine module>.run_tp_worker(config: EngineConfig) -> None`: build the
    model shard, then loop on the commands rank 0 broadcasts (forward, KV copy) and run the same
    sharded computation, meeting in the layers' all-reduce / all-gather; return on "stop".
  * rank 0's `LLMEngine` broadcasts each command before running it itself, and "stop" from
    `engine.shutdown()`, which the replica's engine thread calls when the replica stops (so every
    collective of rank 0 stays on that one thread). Sampling and drafting happen on rank 0 only.
An engine module whose `run_tp_worker` is None makes a tp_size > 1 replica refuse to start with a
message that says so; the group itself (placement, rendezvous, collectives) is also tested by
`selftest`.
"""
from __future__ import annotations

import datetime
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import ServeConfig
from cluster.death_cause import loss_reason, lost_with_node
from eagle_worker.engine_api import load_engine_module

logger = logging.getLogger(__name__)
# joining the group, and any one collective, incl. ranks 1..n-1 waiting for rank 0's next command
# (an idle replica's engine loop sends them a no-op every replica.TP_KEEPALIVE_S)
RENDEZVOUS_TIMEOUT_S = 300
# after rank 0's step failed: how long a rank Ray cannot reach may take to be known dead with its node
# (a drained node's SIGKILLed raylet is noticed by the GCS's health checks)
NODE_LOSS_WAIT_S = 30.0


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _init_process_group(backend: str, init_method: str, rank: int, world: int,
                        init_tensor_parallel: Callable[[int, int], None]) -> None:
    """Join the group, then tell the engine (its `init_tensor_parallel`) which slice is ours."""
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
    init_tensor_parallel(rank, world)


def _all_reduce_rank(rank: int) -> float:
    """Sum of (rank + 1) over the group: world * (world + 1) / 2 when every rank took part."""
    import torch
    import torch.distributed as dist

    x = torch.tensor([float(rank + 1)])
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        x = x.cuda()
    dist.all_reduce(x)
    return float(x.item())


@ray.remote(max_concurrency=2)  # `run` blocks for the replica's life; `ping` must still answer
class TPRankWorker:
    """One non-zero rank: joins the group, then runs the engine's worker loop."""

    def __init__(self, rank: int, world: int, config: dict[str, Any], threads: int | None = None):
        self.rank, self.world = rank, world
        self.config = ServeConfig.from_dict(config)
        self.engine_module = load_engine_module(self.config.engine)
        if self.config.device == "cpu":  # rank 0's count (cluster/cpu_threads.py): every rank alike
            from cluster.cpu_threads import rank_threads, set_torch_threads

            set_torch_threads(threads or rank_threads(self.config, under_serve=False))

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def init_distributed(self, backend: str, init_method: str) -> int:
        _init_process_group(backend, init_method, self.rank, self.world, self.engine_module.init_tensor_parallel)
        return self.rank

    def all_reduce_rank(self) -> float:
        return _all_reduce_rank(self.rank)

    def run(self) -> None:
        from cluster.engine_settings import engine_config

        self.engine_module.run_tp_worker(engine_config(self.config))

    def ping(self) -> int:
        return self.rank

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class TPGroup:
    """Created by rank 0 (inside its actor); owns the worker actors of ranks 1..n-1."""

    def __init__(self, workers: list, backend: str, init_tensor_parallel: Callable[[int, int], None]):
        self.workers = workers
        self.backend = backend
        self._init_tensor_parallel = init_tensor_parallel
        self._loops: list = []

    @classmethod
    def create(cls, config: ServeConfig, require_engine_hook: bool = True, threads: int | None = None) -> "TPGroup":
        """Place ranks 1..n-1 (on CPU with `threads` torch threads each, rank 0's count), form the
        process group with this process as rank 0, and return."""
        engine_module = load_engine_module(config.engine)
        if require_engine_hook and engine_module.run_tp_worker is None:
            raise NotImplementedError(
                f"tp_size={config.tp_size} needs the engine's tensor-parallel worker loop "
                f"`{config.engine}.run_tp_worker(config)` on the non-zero ranks, which this engine does not provide yet"
            )
        world = config.tp_size
        pg = ray.util.get_current_placement_group()
        res = config.resources_per_rank
        workers = []
        for rank in range(1, world):
            opts: dict[str, Any] = {"num_cpus": res.cpu, "num_gpus": res.gpu}
            if pg is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank,
                    placement_group_capture_child_tasks=True)
            workers.append(TPRankWorker.options(**opts).remote(rank, world, config.model_dump(mode="json"), threads))
        group = cls(workers, "nccl" if config.device == "cuda" else "gloo", engine_module.init_tensor_parallel)
        group._rendezvous(world)
        return group

    def _rendezvous(self, world: int) -> None:
        host = ray.util.get_node_ip_address()
        init_method = f"tcp://{host}:{free_port(host)}"
        refs = [w.init_distributed.remote(self.backend, init_method) for w in self.workers]
        logger.info("TP rendezvous at %s (world=%d, backend=%s)", init_method, world, self.backend)
        _init_process_group(self.backend, init_method, 0, world, self._init_tensor_parallel)
        ray.get(refs, timeout=RENDEZVOUS_TIMEOUT_S)

    def selftest(self) -> list[float]:
        """All-reduce across every rank; each returns world*(world+1)/2 when the group works."""
        refs = [w.all_reduce_rank.remote() for w in self.workers]
        mine = _all_reduce_rank(0)
        return [mine] + ray.get(refs, timeout=60)

    def start_workers(self) -> None:
        """Start the engine worker loop on ranks 1..n-1: each builds its shard, then follows rank 0's
        commands (rank 0's engine may send some while it starts, e.g. a draft head's vocab gather)."""
        self._loops = [w.run.remote() for w in self.workers]

    def check_health(self) -> None:
        """Raise if any rank's loop ended (it only ends by crashing or by its actor dying)."""
        if self._loops:
            done, _ = ray.wait(self._loops, num_returns=1, timeout=0)
            if done:
                ray.get(done[0])  # re-raises the rank's error
                raise RuntimeError("a tensor-parallel rank's worker loop exited")
        ray.get([w.ping.remote() for w in self.workers], timeout=30)

    def node_loss(self, wait_s: float = NODE_LOSS_WAIT_S) -> str | None:
        """`preempted` / `node_lost` when a rank went with a node the cluster took away
        (cluster/death_cause.py), else None; asked when rank 0's step failed or a rank's loop ended.
        A collective can fail before the GCS knows the rank's node is gone (meanwhile the rank is
        `ActorUnavailableError`), so such a rank is asked again for up to `wait_s`; a rank that
        answers is alive, and a crash with every rank alive costs one ping."""
        deadline = time.monotonic() + wait_s
        for w in self.workers:
            while True:
                try:
                    ray.get(w.ping.remote(), timeout=max(0.1, deadline - time.monotonic()))
                    break
                except ActorUnavailableError:
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(0.5)
                except RayActorError as e:
                    if lost_with_node(e):
                        return loss_reason(e)
                    break
                except GetTimeoutError:
                    break
        return None

    def shutdown(self) -> None:
        import torch.distributed as dist

        for w in self.workers:
            ray.kill(w, no_restart=True)
        if dist.is_initialized():
            dist.destroy_process_group()
