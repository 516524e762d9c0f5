"""Why a replica was lost: with its node, or by itself.

A node that went away (a spot VM taken back, a node drained and shut down by the autoscaler or
KubeRay, a node that failed) is no request's doing, so losing a replica with it counts as no death
of the requests or job rows that were on it (cluster/request_retry.py, jobs/replica_pool.py). A
replica process that died on a live node may have been killed by what it ran: that one counts.
"""
from __future__ import annotations

from ray.exceptions import RayActorError

# Ray's GCS words for an actor lost with its node ("...; the actor's node was preempted: ...",
# "... terminated expectedly: received SIGTERM", ...); a drained-then-killed node also sets `preempted`
_NODE_DIED = "because its node has died"


def lost_with_node(error: BaseException) -> bool:
    """The replica's actor died because its node did: Ray's own actor error says so (never the text of
    another error, which a request could have put words into)."""
    cause = getattr(error, "cause", None)
    errors = (error, cause) if isinstance(cause, BaseException) else (error,)
    return any(isinstance(e, RayActorError) and (e.preempted or _NODE_DIED in str(e)) for e in errors)


def loss_reason(error: BaseException) -> str:
    """A label for a replica loss: `preempted`, `node_lost`, or the error's type."""
    if isinstance(error, RayActorError) and error.preempted:
        return "preempted"
    return "node_lost" if lost_with_node(error) else type(error).__name__
