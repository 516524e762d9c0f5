"""Will the app's replicas ever be scheduled here? Checked before deploying, so a config asking for
more than the cluster has fails at once with what is missing, instead of Serve waiting forever
(it only logs "cannot be scheduled" every 30 s).

The check packs the replicas the app starts with (`num_replicas`, or autoscaling's initial/min) and
the ingress onto the cluster's nodes by their *total* resources (what other apps hold now may be
freed; what no node has never will be), first fit, biggest first. A replica's ranks are one item
under STRICT_PACK (one node), separate items otherwise. On an autoscaling cluster (Ray's autoscaler
v2 records its node groups in the GCS, as KubeRay's does) the nodes it may add count too: each
group's node shape up to its `max_count`. Other autoscalers record nothing there: set
`EAGLE_SERVE_SKIP_RESOURCE_CHECK=1` to deploy anyway and let the autoscaler add nodes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from cluster.config import ServeConfig
from cluster.config_sections import PlacementStrategy

SKIP_ENV = "EAGLE_SERVE_SKIP_RESOURCE_CHECK"
KEYS = ("CPU", "GPU")
MAX_VIRTUAL_NODES = 256     # an autoscaling group's possible nodes counted at most


class InsufficientResourcesError(RuntimeError):
    """The app's replicas (or its ingress) can never be scheduled on this cluster."""


@dataclass
class Item:
    what: str
    need: dict[str, float]


def initial_replicas(config: ServeConfig) -> int:
    if config.autoscaling is None:
        return config.num_replicas or 1
    a = config.autoscaling
    return a.initial_replicas if a.initial_replicas is not None else max(a.min_replicas, 0)


def items(config: ServeConfig) -> list[Item]:
    """What must be placed for the app to start: replicas (as one item or one per rank) and ingress."""
    bundle = {k: float(v) for k, v in config.resources_per_rank.bundle().items()}
    out: list[Item] = []
    for i in range(initial_replicas(config)):
        if config.tp_size > 1 and config.placement_strategy == PlacementStrategy.STRICT_PACK:
            out.append(Item(f"replica {i} ({config.tp_size} ranks, STRICT_PACK)",
                            {k: v * config.tp_size for k, v in bundle.items()}))
        else:
            out += [Item(f"replica {i} rank {r}", dict(bundle)) for r in range(config.tp_size)]
    if config.ingress.num_cpus:
        out += [Item(f"ingress {i}", {"CPU": config.ingress.num_cpus}) for i in range(config.ingress.num_replicas)]
    return out


def pack(todo: list[Item], nodes: list[dict[str, float]]) -> list[Item]:
    """First-fit decreasing onto `nodes` (free resources, consumed); the items that did not fit."""
    free = [{k: float(n.get(k, 0.0)) for k in KEYS} for n in nodes]
    left = []
    for it in sorted(todo, key=lambda i: (i.need.get("GPU", 0), i.need.get("CPU", 0)), reverse=True):
        for node in free:
            if all(node.get(k, 0.0) + 1e-9 >= v for k, v in it.need.items()):
                for k, v in it.need.items():
                    node[k] = node.get(k, 0.0) - v
                break
        else:
            left.append(it)
    return left


def cluster_nodes() -> tuple[list[dict[str, float]], bool]:
    """(each alive node's total resources, plus the nodes an autoscaler may add; whether it autoscales)."""
    import ray

    nodes = [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]
    extra: list[dict[str, float]] = []
    try:
        from ray._private.state import state

        cfg = state.get_cluster_config()
        for group in getattr(cfg, "node_group_configs", None) or []:
            count = group.max_count if group.max_count >= 0 else MAX_VIRTUAL_NODES
            shape = {k: float(v) for k, v in dict(group.resources).items()}
            extra += [dict(shape) for _ in range(min(count, MAX_VIRTUAL_NODES))]
    except Exception:   # no autoscaler v2 config: the nodes there are what there is
        extra = []
    return nodes + extra, bool(extra)


def _total(nodes: list[dict[str, float]]) -> dict[str, float]:
    return {k: sum(float(n.get(k, 0.0)) for n in nodes) for k in KEYS}


def _fmt(res: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in res.items() if v) or "nothing"


def check_fits(config: ServeConfig, nodes: list[dict[str, float]] | None = None, autoscales: bool = False) -> None:
    """Raise InsufficientResourcesError naming what is missing when the app cannot start here."""
    if os.environ.get(SKIP_ENV, "").strip() not in ("", "0"):
        return
    if nodes is None:
        nodes, autoscales = cluster_nodes()
    todo = items(config)
    left = pack(todo, nodes)
    if not left:
        return
    need = {k: sum(i.need.get(k, 0.0) for i in todo) for k in KEYS}
    have = _total(nodes)
    missing = {k: need[k] - have[k] for k in KEYS if need[k] > have[k] + 1e-9}
    biggest = max(nodes, key=lambda n: (n.get("GPU", 0), n.get("CPU", 0)), default={})
    where = "this cluster" + (" (with every node its autoscaler may add)" if autoscales else "")
    reason = (f"missing {_fmt(missing)} overall" if missing else
              f"no node has room for {left[0].what} ({_fmt(left[0].need)}; the biggest node has "
              f"{_fmt({k: float(biggest.get(k, 0)) for k in KEYS})})")
    per_rank = _fmt(config.resources_per_rank.bundle())
    raise InsufficientResourcesError(
        f"serve app {config.app_name!r} cannot be scheduled: it starts {initial_replicas(config)} replica(s) x "
        f"{config.tp_size} rank(s) x ({per_rank}) + ingress {config.ingress.num_replicas} x CPU "
        f"{config.ingress.num_cpus:g} = {_fmt(need)}, but {where} has {_fmt(have)} on {len(nodes)} node(s): "
        f"{reason}. Lower resources_per_rank.cpu (the torch thread count is resources_per_rank.threads, "
        f"not the reservation), fewer replicas, or add nodes (on a cluster whose autoscaler adds them, "
        f"set {SKIP_ENV}=1)")
