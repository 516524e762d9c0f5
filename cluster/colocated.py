"""`ColocatedServer`: the ingress and its engine replica in one process, the one deployment of an app
with one engine replica (`ServeConfig.colocated`)."""
from typing import Any, AsyncIterator

from cluster.ingress import OpenAIIngress
from cluster.local_engine import LocalEngine
from cluster.replica import EngineReplica


class ColocatedServer(OpenAIIngress):
    """The ingress with its engine in the same process, as the one deployment `LLMServer`
    (`ServeConfig.colocated`: one engine replica). The endpoints reach the engine through
    `LocalEngine`; a job's rows (cluster/app_client.py) and Serve's health and routing probes reach it
    through the methods below, as they reach a separate `LLMServer`."""

    engine_attempts = 1   # its engine is the only one: a crashed engine is a 503 at once, while Serve restarts it

    async def __init__(self, config: dict):
        self.replica = EngineReplica(config)
        await super().__init__(config, LocalEngine(self.replica))
        self._saw_stats({"max_model_len": self.replica.max_model_len})   # known here, not probed

    async def submit(self, *args, **kwargs) -> AsyncIterator[Any]:
        outputs = self.replica.submit(*args, **kwargs)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()   # now: the replica's stream aborts the request if it did not finish

    async def abort(self, request_id: str) -> None:
        await self.replica.abort(request_id)

    async def stats(self) -> dict[str, Any]:
        return await self.replica.stats()

    async def engine_info(self) -> dict[str, Any]:
        return await self.replica.engine_info()

    def record_routing_stats(self) -> dict[str, Any]:
        return self.replica.record_routing_stats()

    def check_health(self) -> None:
        self.replica.check_health()

    async def __del__(self):  # Serve calls this when it stops the replica
        replica = getattr(self, "replica", None)
        if replica is not None:
            replica.shutdown()
        await super().__del__()   # the ASGI app's lifespan
