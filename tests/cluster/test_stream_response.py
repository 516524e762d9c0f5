"""ReleasingStream (cluster/stream_response.py) with Starlette's real StreamingResponse, no Ray: a
stream's admission slot is released however its client leaves, and once."""
from __future__ import annotations

import asyncio

import pytest

from cluster.admission import Admission
from cluster.stream_response import Release, ReleasingStream


def _respond(body_steps: int, disconnect_at_once: bool, spec_version: str) -> tuple[Admission, list, list]:
    """An admitted stream whose body yields `body_steps` chunks and releases in its `finally`, as the
    ingress's `_sse` does; the client either stays or has already left when the response starts."""
    admission, released, sent = Admission(4), [], []

    async def main():
        admission.enter(0, 1)

        async def leave():
            admission.leave(0, 1)
            released.append(1)
        release = Release(leave)

        async def body():
            try:
                for i in range(body_steps):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
            finally:
                await release()

        async def receive():
            if disconnect_at_once:
                return {"type": "http.disconnect"}
            await asyncio.sleep(3600)

        async def send(message):
            sent.append(message)
            await asyncio.sleep(0)
        scope = {"type": "http", "asgi": {"spec_version": spec_version}}
        await ReleasingStream(body(), release, media_type="text/event-stream")(scope, receive, send)
    asyncio.run(main())
    return admission, released, sent


def test_a_client_gone_before_the_body_starts_frees_its_slot():
    """Serve speaks ASGI 2.3: Starlette cancels the body's writer when the listener sees the
    disconnect, here before the body's first step, so its `finally` never runs; the response's own
    end releases the slot (a plain StreamingResponse kept it for good: every later request a 503)."""
    admission, released, sent = _respond(body_steps=5, disconnect_at_once=True, spec_version="2.3")
    assert not any(m.get("body") for m in sent)          # no chunk went out: the body never ran
    assert released == [1] and admission.in_flight == 0


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_a_stream_that_ran_to_its_end_is_released_once(spec_version):
    admission, released, sent = _respond(body_steps=3, disconnect_at_once=False, spec_version=spec_version)
    assert [m["body"] for m in sent if m.get("body")] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    assert released == [1] and admission.in_flight == 0
