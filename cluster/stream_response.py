"""An SSE response that releases what its request holds however the client leaves.

A stream's admission slot, in-flight gauge and engine streams are released in its body generator's
`finally`. Under Serve (ASGI spec 2.3) Starlette writes the body in a task beside one that listens
for the client's disconnect; a client that left while the ingress waited for the first token gets
the writer cancelled before the generator's first step, and a generator that never started never
runs its `finally`: without this, each such request kept its slot for good, until every request
was a 503.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.responses import StreamingResponse


class Release:
    """Runs `release` once, whoever asks first (the body's `finally` or the response's end)."""

    def __init__(self, release: Callable[[], Awaitable[None]]):
        self._release, self.done = release, False

    async def __call__(self) -> None:
        if not self.done:
            self.done = True
            await self._release()


class ReleasingStream(StreamingResponse):
    """A StreamingResponse whose body is closed, and `release` run, when the response ends."""

    def __init__(self, content, release: Release, **kwargs):
        super().__init__(content, **kwargs)
        self.release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()    # a started body's `finally` runs now, not at GC
            finally:
                await self.release()                 # a body that never started: release it here
