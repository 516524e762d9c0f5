"""The colocated ingress's engine: an `EngineReplica` in the ingress's own process, called the way
the ingress calls a DeploymentHandle (`handle.options(stream=True).submit.remote(...)`,
`handle.stats.remote()`), so `stream_outputs` and the endpoints run unchanged. A streamed output
then costs no Ray message: on a CPU machine each one took cycles from the engine's cores in the
replica, the ingress and the proxy (README, "Serving")."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable


class _LocalStream:
    """An async iterator over `EngineReplica.submit`'s outputs with a handle generator's `cancel()`."""

    def __init__(self, outputs: AsyncIterator[Any]):
        self._outputs = outputs

    def __aiter__(self) -> "_LocalStream":
        return self

    async def __anext__(self) -> Any:
        return await self._outputs.__anext__()

    def cancel(self) -> None:
        """The consumer left: close the replica's stream, which aborts the request in the engine."""
        asyncio.ensure_future(self._outputs.aclose())


class _LocalMethod:
    def __init__(self, call: Callable[..., Any]):
        self.remote = call


class LocalEngine:
    """The subset of a DeploymentHandle to `LLMServer` that the ingress uses, on an in-process replica."""

    def __init__(self, replica: Any):
        self.replica = replica
        self.submit = _LocalMethod(lambda *args, **kwargs: _LocalStream(replica.submit(*args, **kwargs)))
        self.stats = _LocalMethod(replica.stats)

    def options(self, **_: Any) -> "LocalEngine":
        return self
