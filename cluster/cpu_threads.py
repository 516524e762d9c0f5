"""How many torch threads a CPU engine rank computes with.

Ray's logical CPU reservation (`resources_per_rank.cpu`) says how many ranks fit on a node; it is
not how many cores a rank may use. Tying the two made the default config (one replica reserving
1 CPU) compute on one core of a laptop's 8, and reserving every core left no room for anything
else on the node. So the thread count is its own setting, `resources_per_rank.threads`; when it is
unset, a Serve replica takes the cores of its node divided by the engine ranks of its deployment
that can be there at once (`auto_threads`): one replica on a machine gets every core, four
replicas packed on a 16-core node get 4 each. A node's cores are the process's CPU affinity capped by
its cgroup CPU quota (a pod's CPU limit). Ranks started outside Serve (a job's own replicas,
which already size `cpu` as the cores each replica gets) keep `threads = int(cpu)`.
"""
from __future__ import annotations

import os

from cluster.config import ServeConfig
from eagle_worker.engine_api import GLIBC_TUNABLES


def serve_env() -> dict[str, str]:
    """Environment for Serve's processes (replicas, and the proxy where we start Ray): user code and
    the handle's router run on the process's own event loop instead of a thread each, two thread
    hops fewer per streamed chunk (with the engine-thread fix, README "Serving": 0.73x -> 0.84x of
    the engine at concurrency 1 on 2 cores). Our async handlers never block: tokenizing and the
    engine run in threads. Values the operator set are kept."""
    return {k: os.environ.get(k, v) for k, v in SERVE_STREAMING_ENV.items()}


SERVE_STREAMING_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


def engine_env() -> dict[str, str]:
    """Environment for engine processes (Serve's engine replicas, a job's own replicas): glibc's
    malloc keeps large freed blocks for reuse (eagle_worker/malloc_tuning.py says why; without it a
    job replica at batch 64 spent half its CPU time in the kernel). Values the operator set are kept."""
    return {k: os.environ.get(k, v) for k, v in ENGINE_MALLOC_ENV.items()}


ENGINE_MALLOC_ENV = {"GLIBC_TUNABLES": GLIBC_TUNABLES}


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity (a container's cpuset), capped by its cgroup's
    CPU quota (a Kubernetes CPU limit, which leaves the affinity at the whole node)."""
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cores = max(1, os.cpu_count() or 1)
    quota = cgroup_cpu_limit()
    return max(1, min(cores, quota)) if quota else cores


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup") -> int | None:
    """ceil(quota / period) of this process's cgroup (v2 `cpu.max`, v1 `cpu.cfs_quota_us`), None if unlimited."""
    import math
    from pathlib import Path

    try:
        quota, period = Path(root, "cpu.max").read_text().split()[:2]
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path(root, "cpu", "cpu.cfs_quota_us").read_text())
        period = int(Path(root, "cpu", "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else max(1, math.ceil(quota / period))
    except (OSError, ValueError):
        return None


def auto_threads(cores: int, cpu: float, node_cpus: float, engine_ranks: int) -> int:
    """`cores` split over the engine ranks that can share the node: at most `engine_ranks` (the
    deployment's replicas x tp_size at most), and no more than the node's logical CPUs hold at
    `cpu` each; never below the reservation (capped at the cores) nor 1."""
    per_node = max(1, engine_ranks)
    if cpu > 0:
        per_node = min(per_node, max(1, int(node_cpus // cpu)))
    return max(1, min(cores, max(int(cpu), cores // per_node)))


def node_logical_cpus() -> float | None:
    """The logical CPUs Ray gives this process's node, or None outside Ray."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        me = ray.get_runtime_context().get_node_id()
        for n in ray.nodes():
            if n.get("NodeID") == me:
                return float(n.get("Resources", {}).get("CPU", 0.0))
    except Exception:
        return None
    return None


def rank_threads(config: ServeConfig, under_serve: bool) -> int:
    """The torch thread count of one CPU rank of `config` (see the module docstring)."""
    res = config.resources_per_rank
    if res.threads is not None:
        return res.threads
    if not under_serve:
        return max(1, int(res.cpu))
    cores = usable_cores()
    node_cpus = node_logical_cpus()
    return auto_threads(cores, res.cpu, cores if node_cpus is None else node_cpus,
                        config.max_engine_replicas * config.tp_size)


def set_torch_threads(n: int) -> int:
    import torch

    torch.set_num_threads(max(1, int(n)))
    return torch.get_num_threads()


def inside_serve_replica() -> bool:
    try:
        from ray import serve

        serve.get_replica_context()
        return True
    except Exception:
        return False
