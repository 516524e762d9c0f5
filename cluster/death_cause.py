"""Why a replica was lost: with a node the cluster took away, stopped by Serve, or otherwise.

A node the cluster took away on purpose (a spot VM taken back after its preemption notice drained it;
a node drained and shut down by the autoscaler or KubeRay, its pod deleted) is no request's doing, so
losing a replica with it (or one of its tensor-parallel ranks) counts as no death of the requests or
job rows that were on it (cluster/request_retry.py, jobs/replica_pool.py), up to FREE_NODE_LOSSES
times each. A replica process that died, or a node that failed unexpectedly (an out-of-memory kill
of the whole pod, a VM gone without notice), may have been brought down by what it ran: that one
counts. So is a healthy replica Serve stops (scale-down, a rolling update) whose requests outlast its
graceful shutdown: the replica ends them with `ReplicaStoppedError` (cluster/replica_stop.py) before
Serve kills it, where the kill would be an ActorDiedError like any crash's.
"""
from __future__ import annotations

from ray.exceptions import ActorUnavailableError, RayActorError

from cluster.replica_errors import EngineDiedError, ReplicaStoppedError

# Ray's GCS words for an actor whose node went on purpose: "The actor died because its node has died.
# ... the actor's node was preempted: ..." or "... was terminated expectedly: received SIGTERM" (a
# node killed after a preemption drain also sets `preempted`); "... terminated unexpectedly" counts
_TAKEN_AWAY = ("the actor's node was preempted", "the actor's node was terminated expectedly")

# losses with a node that count as no death, per request or job row; later ones count (a request
# that somehow takes nodes down with it cannot loop over the fleet)
FREE_NODE_LOSSES = 3


def _node_losses(error: BaseException) -> list[str]:
    """`preempted` / `node_lost` for each loss with a node in `error` (itself, or the cause a
    RayTaskError wraps): Ray's own actor errors, or an EngineDiedError whose TP rank went with its
    node (cluster/tp_group.py sets `node_loss` from Ray's error); never another error's text, which
    a request could have put words into."""
    losses = []
    for e in (error, getattr(error, "cause", None)):
        if isinstance(e, RayActorError) and (e.preempted or any(w in str(e) for w in _TAKEN_AWAY)):
            losses.append("preempted" if e.preempted else "node_lost")
        elif isinstance(e, EngineDiedError) and getattr(e, "node_loss", None) in ("preempted", "node_lost"):
            losses.append(e.node_loss)   # (Ray's RayTaskError-and-cause hybrid has no such attribute)
    return losses


def lost_with_node(error: BaseException) -> bool:
    """The replica's actor, or one of its TP ranks, died because the cluster took its node away."""
    return bool(_node_losses(error))


def stopped_by_serve(error: BaseException) -> bool:
    """The replica ended the request because Serve was stopping it (by type, itself or the cause a
    RayTaskError wraps: no text a request could put words into)."""
    return any(isinstance(e, ReplicaStoppedError) for e in (error, getattr(error, "cause", None)))


def free_loss(error: BaseException) -> bool:
    """No request's doing: lost with a node taken away, stopped by Serve, or unreachable for now (a
    network or GCS blip: Ray has not called the actor dead). Callers allow FREE_NODE_LOSSES of them
    a request."""
    return lost_with_node(error) or stopped_by_serve(error) or isinstance(error, ActorUnavailableError)


def loss_reason(error: BaseException) -> str:
    """A label for a replica loss: `preempted`, `node_lost`, `replica_stopped`, or the error's type."""
    if stopped_by_serve(error):
        return "replica_stopped"
    losses = _node_losses(error)
    if "preempted" in losses:
        return "preempted"
    return losses[0] if losses else type(error).__name__
