"""Real Serve: a replica scaled down (or rolled over) under a long request ends it just before Serve's
kill, and the request finishes on another replica, retried as no death of its own
(cluster/replica_stop.py)."""
from __future__ import annotations

import asyncio

from cluster.config import ServeConfig
from cluster.death_cause import loss_reason
from cluster.replica import EngineReplica
from cluster.request_retry import stream_outputs
from cluster.serve_app import engine_deployment_options
from tests.cluster.conftest import FAKE


def _app(cfg: ServeConfig, **options):
    from ray import serve

    opts = engine_deployment_options(cfg) | {"graceful_shutdown_timeout_s": 4.0, "graceful_shutdown_wait_loop_s": 0.5}
    return serve.deployment(EngineReplica).options(**(opts | options)).bind(cfg.model_dump(mode="json"))


def test_a_request_on_a_replica_scaled_down_is_retried_elsewhere_as_no_death(serve_port):
    from ray import serve

    cfg = ServeConfig(model="fake", engine=FAKE, app_name="stopping", num_replicas=2, resources_per_rank={"cpu": 0.25},
                      limits={"max_model_len": 512, "max_tokens": 200})
    serve.run(_app(cfg), name="stopping", route_prefix=None)
    handle = serve.get_deployment_handle("LLMServer", app_name="stopping")
    retries: list[BaseException] = []

    async def one(i: int):
        params = {"max_tokens": 120, "temperature": 0}      # 6 s at a step of 50 ms: outlasts the 4 s grace
        return [o async for o in stream_outputs(handle, f"long-{i}", f"[slow:0.05] long {i}", params,
                                                restartable=True, on_retry=retries.append)][-1]

    async def main():
        first = asyncio.create_task(one(0))
        await asyncio.sleep(1.0)                             # routed and counted: the second goes to the other
        second = asyncio.create_task(one(1))
        await asyncio.sleep(1.0)
        await asyncio.to_thread(serve.run, _app(cfg, num_replicas=1), name="stopping", route_prefix=None)
        return await asyncio.gather(first, second)

    try:
        outs = asyncio.run(asyncio.wait_for(main(), timeout=90))
        assert all(o.finished and len(o.token_ids) == 120 for o in outs)
        # each retry: a replica Serve stopped (not an ActorDiedError); a second one when the redeploy also
        # rolled the kept replica over (Serve may give the new config a new version)
        assert retries and {loss_reason(e) for e in retries} == {"replica_stopped"}, retries
    finally:
        serve.delete("stopping")
