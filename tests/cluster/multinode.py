"""Driver side of the multi-node Serve tests:
`python -m tests.cluster.multinode ADDRESS deploy|replicas|actors|kill-busy|rank-verdict ...`.

The test process stays out of the cluster (it may already be connected to the session's embedded
Ray, and a process joins one cluster only): deploying and asking Ray about replicas happen in short
driver subprocesses (`LocalCluster.driver`); Serve apps outlive their driver (Serve is detached).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time


def _rank_verdict() -> dict:
    """A tensor-parallel rank worker (cluster/tp_group.py) on the node whose id comes on stdin, in a
    group whose rank 0 is this driver: prints `connected`, then `ready` once the rank runs, waits for
    another line (the test takes the node away meanwhile), then answers what the group's `node_loss`
    says of the rank and how long it took to say it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from cluster.config import ServeConfig
    from cluster.tp_group import TPGroup, TPRankWorker

    print("connected", flush=True)
    node_id = sys.stdin.readline().strip()
    config = ServeConfig(engine="tests.cluster.fake_engine", model="fake", draft="none").model_dump(mode="json")
    rank = TPRankWorker.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)) \
        .remote(1, 2, config, 1)
    group = TPGroup([rank], "gloo", lambda rank, world: None)
    before = group.node_loss()                       # alive: no verdict
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.monotonic()
    return {"before": before, "verdict": group.node_loss(), "seconds": time.monotonic() - t0}


# ---- driver side (runs in a subprocess joined to the cluster) ------------------------------------
def _replicas(app: str) -> list[dict]:
    """Alive Serve replicas of `app` (every deployment): replica id, process id, node."""
    from ray._private import state  # straight from the GCS: works without the dashboard

    out = []
    for a in state.actors(actor_state_name="ALIVE").values():
        name = a.get("Name") or ""
        if name.startswith(f"SERVE_REPLICA::{app}#"):
            _, deployment, replica_id = name.split("#")
            out.append({"deployment": deployment, "replica_id": replica_id, "pid": a["Pid"],
                        "node_id": a["Address"]["NodeID"]})
    return sorted(out, key=lambda r: (r["deployment"], r["replica_id"]))


def _head_node() -> str:
    import ray

    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"])


def _actors(class_name: str) -> list[dict]:
    """Alive actors of a class (e.g. a job's JobReplica): process id, node, and whether its node is the head."""
    from ray._private import state

    head = _head_node()
    return [{"pid": a["Pid"], "node_id": a["Address"]["NodeID"], "on_head": a["Address"]["NodeID"] == head}
            for a in state.actors(actor_state_name="ALIVE").values() if a.get("ActorClassName") == class_name]


def _kill_busy(app: str, deployment: str, timeout: float = 60.0) -> dict:
    """SIGKILL the `deployment` replica with the most requests in flight, asked of Serve's replica
    actors themselves (their queue length answers on a thread of its own, never behind user code).

    Waits until some replica serves at least two requests (one after a short wait), so the kill is
    known to land on work in progress; the load's own counts, reported as requests finish, lag.
    Every node of the test's local cluster is this machine, so the pid is killed from here.
    """
    import ray

    replicas = [r for r in _replicas(app) if r["deployment"] == deployment]
    handles = {r["replica_id"]: ray.get_actor(f"SERVE_REPLICA::{app}#{deployment}#{r['replica_id']}", namespace="serve")
               for r in replicas}
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        ongoing = dict(zip(handles, ray.get([h.get_num_ongoing_requests.remote() for h in handles.values()])))
        busiest = max(replicas, key=lambda r: ongoing[r["replica_id"]])
        if ongoing[busiest["replica_id"]] >= (2 if time.monotonic() - t0 < 2.0 else 1):
            os.kill(busiest["pid"], signal.SIGKILL)
            return {**busiest, "ongoing": ongoing}
        time.sleep(0.01)
    raise SystemExit(f"no {deployment} replica of {app} had a request in flight for {timeout:.0f} s")


def _main(argv: list[str]) -> None:
    import ray
    from ray import serve

    address, cmd, *rest = argv
    ray.init(address=address, namespace="eagle-mn", log_to_driver=False, logging_level="ERROR")
    if cmd == "deploy":  # deploy CONFIG_JSON HTTP_PORT
        from cluster.config import ServeConfig
        from cluster.serve_app import deploy_app

        config = ServeConfig.from_dict(json.loads(rest[0]))
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": int(rest[1])})
        deploy_app(config)
        answer = {"replicas": _replicas(config.app_name)}
    elif cmd == "replicas":  # replicas APP
        answer = {"replicas": _replicas(rest[0]),
                  "nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]),
                  "head": _head_node()}
    elif cmd == "actors":  # actors CLASS_NAME
        answer = {"actors": _actors(rest[0])}
    elif cmd == "kill-busy":  # kill-busy APP DEPLOYMENT
        answer = {"killed": _kill_busy(rest[0], rest[1])}
    elif cmd == "rank-verdict":  # rank-verdict (the node id on stdin): see _rank_verdict
        answer = _rank_verdict()
    else:
        raise SystemExit(f"unknown command {cmd!r}")
    print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
