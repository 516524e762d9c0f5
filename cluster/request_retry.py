"""One request's outputs from whichever replica Serve picks, retried when its replica dies.

If a replica dies (actor gone, engine loop crashed) before any token of a request reached the
client, the request is transparently re-submitted and Serve routes it to a live replica; once
tokens were streamed, the client gets a clear `ReplicaLostError` instead of a silently restarted
(and so duplicated) text.

Poison requests: a request under which two *different* replicas died is not resubmitted again
(`PoisonRequestError`, HTTP 500): it is most likely what kills them. Only real deaths under the
request count: the router records which replica each attempt was routed to (cluster/router.py), so
the same death seen twice and a replica already seen dead before this attempt was sent do not
count. That bookkeeping lives in cluster/router_state.py, which the router shares with this module.
A replica lost with a node the cluster took away, or stopped by Serve under a request that outlasted
its graceful shutdown (cluster/death_cause.py), counts as no death (FREE_NODE_LOSSES times a request).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Callable, Optional

import ray.exceptions
from ray.serve.exceptions import BackPressureError

from cluster import router_state as state
from cluster.admission import OverloadedError
from cluster.caller_watch import this_caller
from cluster.death_cause import FREE_NODE_LOSSES, free_loss
from cluster.replica_errors import EngineDiedError, Failed, Rejected

logger = logging.getLogger(__name__)

_DEATH = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, EngineDiedError)
try:  # Serve raises its own type when a replica goes away mid-call on some paths
    from ray.serve.exceptions import ReplicaUnavailableError

    _DEATH = _DEATH + (ReplicaUnavailableError,)
except ImportError:  # pragma: no cover - older Ray
    pass


class ReplicaLostError(RuntimeError):
    """The replica serving a request died and the request could not be retried (HTTP 503)."""


class PoisonRequestError(ReplicaLostError):
    """Replicas died under this request twice: it is not resubmitted again (HTTP 500)."""


async def stream_outputs(
    handle,
    request_id: str,
    prompt: str | list[int] | None,
    params: dict[str, Any],
    priority: int = 0,
    messages: list[dict] | None = None,
    *,
    max_attempts: int = 6,
    max_deaths: int = 2,
    retry_backoff_s: float = 0.25,
    restartable: bool = False,
    on_retry: Optional[Callable[[BaseException], None]] = None,
    group: Optional[str] = None,
    stream_interval: int = 1,
) -> AsyncIterator[Any]:
    """Outputs of one request from whichever replica Serve picks, surviving replica deaths.

    `restartable=True` (non-streaming callers, who have sent the client nothing yet) also retries
    after tokens were produced: outputs are cumulative, so the caller just keeps the last one.
    Raises OverloadedError when the system is full (Serve's queue; the caller's `Admission` is its own),
    PoisonRequestError once `max_deaths` different replicas died under this request, and
    ReplicaLostError when it cannot retry (tokens already streamed, or `max_attempts` attempts).
    `on_retry(error)` is called before each retry (the ingress counts them in /metrics).
    Requests of one `group` (the n samples of one prompt) prefer the replica a sibling went to, where
    the engine prefills their shared prompt once. `stream_interval`: the replica's (`EngineReplica.submit`).
    """
    attempts = _attempts(handle, request_id, prompt, params, priority, messages, max_attempts, max_deaths,
                         retry_backoff_s, restartable, on_retry, group, stream_interval)
    try:
        async for out in attempts:
            yield out
    finally:
        try:
            await attempts.aclose()  # now, not at garbage collection: a consumer that left cancels the call
        finally:
            for attempt in range(1, max_attempts):
                state.suspects.discard(f"{request_id}-retry{attempt}")


async def _attempts(handle, request_id, prompt, params, priority, messages, max_attempts, max_deaths,
                    retry_backoff_s, restartable, on_retry, group=None, stream_interval=1) -> AsyncIterator[Any]:
    tokens_seen = 0
    deaths: dict[str, BaseException] = {}   # replica -> how it died under this request
    node_losses = 0                          # replicas lost under it with a node taken away, or unreachable (free)
    last: BaseException | None = None
    for attempt in range(max_attempts):
        rid = request_id if attempt == 0 else f"{request_id}-retry{attempt}"
        if group is not None:
            state.groups[rid] = group
        gen = None
        sent_at = time.monotonic()
        try:  # a full router queue raises BackPressureError already from `.remote()`
            gen = handle.options(stream=True).submit.remote(rid, prompt, params, priority=priority, messages=messages,
                                                              stream_interval=stream_interval, caller=this_caller())
            last_out = None
            async for out in gen:
                if not isinstance(out, (Rejected, Failed)):
                    tokens_seen += len(out.new_token_ids)
                last_out = out
                yield out
            if last_out is None or not (isinstance(last_out, (Rejected, Failed)) or last_out.finished):
                # never a silent cut: a replica ends a stream early only for a caller it saw gone
                raise ReplicaLostError("the replica ended this request's stream before it finished (it took "
                                       "the caller for gone); please retry the request")
            return
        except (GeneratorExit, asyncio.CancelledError):  # consumer left (client disconnect): stop the work
            if gen is not None:
                gen.cancel()
            raise
        except BackPressureError as e:
            raise OverloadedError(
                "the server is overloaded: every replica is at capacity and the queue is full; retry later"
            ) from e
        except _DEATH as e:
            last = e
            replica = state.routed.get(rid)
            # lost with a node the cluster took away (a spot VM taken back, a node drained and shut
            # down), stopped by Serve (scale-down, rolling update), or unreachable for now (a network
            # or GCS blip: Ray has not called it dead): no request's doing, so no death of this one's
            # and no suspect, FREE_NODE_LOSSES times
            node_lost = free_loss(e) and node_losses < FREE_NODE_LOSSES
            if node_lost:
                node_losses += 1
            elif replica is None:                # not routed by a LoadAwareRouter here: count every death
                deaths[f"attempt-{attempt}"] = e
            elif state.replica_key(replica) not in deaths and not state.seen_dead(replica, before=sent_at):
                deaths[state.replica_key(replica)] = e   # died while this request was on it
            if replica is not None and not isinstance(e, ray.exceptions.ActorUnavailableError):
                state.mark_dead(replica)   # (unavailable may be a blip: Serve probes those itself)
            if tokens_seen and not restartable:
                raise ReplicaLostError(
                    f"the replica serving this request died after {tokens_seen} tokens were streamed; "
                    "the partial response cannot be resumed, please retry the request"
                ) from e
            if len(deaths) >= max_deaths:
                raise PoisonRequestError(
                    f"request {request_id} was not retried again: {len(deaths)} replicas died while serving it "
                    f"(the last: {_describe(e)}); it may be what crashes them"
                ) from e
            if attempt + 1 < max_attempts:
                if not node_lost:
                    state.suspects.add(f"{request_id}-retry{attempt + 1}")
                if on_retry is not None:
                    on_retry(e)
                logger.warning("request %s: replica failed (%s); retrying (attempt %d/%d)",
                               request_id, type(e).__name__, attempt + 2, max_attempts)
                await asyncio.sleep(min(retry_backoff_s * 2**attempt, 2.0))  # let Serve catch up
            tokens_seen = 0
        finally:
            state.routed.pop(rid, None)
            state.leave_group(rid)
            state.suspects.discard(rid)
            state.deferred.discard(rid)
    tries = f"{max_attempts} attempt{'s' if max_attempts != 1 else ''}"
    raise ReplicaLostError(f"request {request_id}: {tries} failed, the last with "
                           f"{_describe(last) if last else 'no replica'}; giving up")


def _describe(e: BaseException) -> str:
    """`Type: first line` of the error, unwrapped from Ray's RayTaskError."""
    cause = getattr(e, "cause", None)
    e = cause if isinstance(cause, BaseException) else e
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__
