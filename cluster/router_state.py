"""State the request router (cluster/router.py) shares with `stream_outputs` (cluster/request_retry.py)
in the caller's process.

Its own module because Serve pickles the request-router class *by value* (with its module's globals
copied) when the deployment is created: state kept in cluster/router.py would exist twice in the
ingress, once for the router, once for `stream_outputs`. Modules are pickled by reference, so both
reach this one.
"""
from __future__ import annotations

import time
import weakref
from typing import Any

DEAD_TTL_S = 60.0                               # how long a replica seen dying is skipped
routed: dict[str, Any] = {}                     # attempt's request id -> ReplicaID it was routed to
_seen_dead: dict[str, float] = {}               # replica unique id -> when a request saw it die
routers: weakref.WeakSet = weakref.WeakSet()    # every LoadAwareRouter in this process
suspects: set[str] = set()                      # attempt ids of requests a replica already died under
groups: dict[str, str] = {}                     # attempt id -> its group (the n samples of one prompt)
group_replicas: dict[str, str] = {}             # group -> the replica (key) its first request was given
deferred: set[str] = set()                      # attempt ids of offline requests held back (counted once)
counters: dict[str, int] = {"offline_deferred": 0, "online_ahead_of_offline": 0}


def request_id(pending_request: Any) -> str | None:
    """The request id of a `submit(request_id, ...)` call (None for other calls, e.g. stats)."""
    args = getattr(pending_request, "args", None)
    return args[0] if args and isinstance(args[0], str) else None


def is_suspect(pending_request: Any) -> bool:
    return request_id(pending_request) in suspects


def suspect_hosts(rid: str | None = None) -> set[str]:
    """Replicas running (or just given) a suspect request other than `rid`'s group: a second suspect
    waits for another one, so a poison request cannot take an innocent suspect down with it a second
    time. The n samples of one request (a group) are one suspect: one prompt, poison or not for all
    of them, so they share a replica (and go to one, as groups do)."""
    group = groups.get(rid) if rid else None
    return {replica_key(r) for s, r in list(routed.items())
            if s in suspects and (group is None or groups.get(s) != group)}


def group_replica(rid: str | None, first_choice: Any) -> str | None:
    """The replica (key) `rid`'s group goes to: the first choice of the group's first request to be
    ranked (siblings are ranked before any is routed, so routing records would come too late), or of
    the first ranked after that replica was seen dying (the samples' retries stay together)."""
    group = groups.get(rid) if rid else None
    if group is None:
        return None
    home = group_replicas.get(group)
    if first_choice is not None and (home is None or seen_dead(home)):
        group_replicas[group] = replica_key(first_choice)
    return group_replicas.get(group)


def leave_group(rid: str) -> None:
    group = groups.pop(rid, None)
    if group is not None and group not in groups.values():
        group_replicas.pop(group, None)


def note_deferred(rid: str | None) -> None:
    """An offline request was held back for online work (no replica had room for offline rows, or
    a freed slot went to a younger online request): counted once per attempt."""
    if rid is not None and rid not in deferred:
        deferred.add(rid)
        counters["offline_deferred"] += 1


def router_counters() -> dict[str, int]:
    """This process's routing counters (the ingress exports them; a job reads them from AppClient)."""
    return dict(counters)


def replica_key(replica_id: Any) -> str:
    return getattr(replica_id, "unique_id", None) or str(replica_id)


def mark_dead(replica_id: Any) -> None:
    _seen_dead.setdefault(replica_key(replica_id), time.monotonic())


def seen_dead(replica_id: Any, before: float | None = None) -> bool:
    """A request saw this replica die (before `before`, when given), within DEAD_TTL_S."""
    now = time.monotonic()
    for key, t in list(_seen_dead.items()):
        if t < now - DEAD_TTL_S:
            _seen_dead.pop(key, None)   # (the router runs on its own thread)
    t = _seen_dead.get(replica_key(replica_id))
    return t is not None and (before is None or t < before)


def live_replica_stats() -> dict[str, dict]:
    """Routing stats of every replica this process's routers currently know (Serve drops a dead
    replica from the set once it notices; one a request saw die is dropped at once), keyed by
    replica id; {} before the first request."""
    out: dict[str, dict] = {}
    for router in list(routers):
        for rid, replica in list(router.curr_replicas.items()):
            stats = dict(replica.routing_stats or {})
            if not stats or seen_dead(rid) or stats.get("engine_alive") is False:
                continue
            out[str(stats.get("replica_id") or replica_key(rid))] = stats
    return out


def clear() -> None:
    """Forget everything (tests)."""
    routed.clear()
    groups.clear()
    group_replicas.clear()
    _seen_dead.clear()
    suspects.clear()
    deferred.clear()
    for k in counters:
        counters[k] = 0
