"""Driver side of the multi-node Serve tests: `python -m tests.cluster.multinode ADDRESS deploy|replicas ...`.

The test process stays out of the cluster (it may already be connected to the session's embedded
Ray, and a process joins one cluster only): deploying and asking Ray about replicas happen in short
driver subprocesses (`LocalCluster.driver`); Serve apps outlive their driver (Serve is detached).
"""
from __future__ import annotations

import json
import sys



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
                  "nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])}
    else:
        raise SystemExit(f"unknown command {cmd!r}")
    print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
