"""Serve stopping a replica (scale-down, a rolling update, the app deleted, its node drained): the
requests still running when Serve is about to kill it end as no request's doing.

How Serve (2.60) stops a replica: the controller calls the actor's `perform_graceful_shutdown`, which
waits for the replica's ongoing requests with no bound of its own, and `ray.kill`s the actor
`graceful_shutdown_timeout_s` after it asked. A request still running then ends in its caller with
an ActorDiedError, the error a crash gives, so it counted as a death of the request: two rolling
updates under one long request answered it 500 `replicas_died`. The replica's own code hears nothing
in time: the `__del__` Serve calls runs after the drain, so never while requests run; Serve stops
health checks and stats probes of a stopping replica. The one exact signal is the flag Serve's
replica sets as the stop begins (`Replica._shutting_down`, "may be used by replica subclass
implementations"), on the actor instance Ray keeps in the process (`worker.actors`). Private names:
tests/cluster/test_replica_stop.py checks them against the pinned Ray; where they are missing (and
outside Serve: a job's own replicas, tests) there is no watch, and a stop counts as before.

Serve stops a replica that failed its health checks the same way, and that one may be a request's
doing (a hang): only a replica that was healthy when the stop began (its engine alive, Serve's last
health check answered within HEALTHY_CHECKS periods) ends its requests as free losses.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from cluster.replica_errors import ReplicaStoppedError

logger = logging.getLogger(__name__)
POLL_S = 0.5          # how often the flag is read (an attribute: nothing is sent anywhere)
MARGIN_S = 3.0        # before Serve's kill (half its grace at most): the poll's lag, the errors' way out
HEALTHY_CHECKS = 3    # a stop within this many health-check periods of a passed check: not for health


def serve_replica() -> Any | None:
    """Serve's replica object (`ray.serve._private.replica.Replica`) of the actor this runs in, or
    None (no Ray, not a Serve replica, or Ray's internals moved)."""
    try:
        import ray
        from ray._private.worker import global_worker

        actor_id = ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None
        actor = global_worker.actors.get(ray.ActorID.from_hex(actor_id)) if actor_id else None
    except Exception:
        return None
    impl = getattr(actor, "_replica_impl", None)
    return impl if hasattr(impl, "_shutting_down") and hasattr(impl, "_deployment_config") else None


class StopWatch:
    """Calls `on_stop(error)` once, shortly before Serve kills this replica, if Serve began stopping it
    while it was healthy (`alive()` and a health check passed lately: `passed_health_check`); the
    error stays in `stopped`, for requests that still come (refused with it)."""

    def __init__(self, on_stop: Callable[[BaseException], None], alive: Callable[[], bool],
                 replica: Any = None, poll_s: float = POLL_S, margin_s: float = MARGIN_S):
        self._on_stop, self._alive = on_stop, alive
        self._replica = replica
        self._poll_s, self._margin_s = poll_s, margin_s
        self._healthy_at = time.monotonic()     # Serve's first check comes after the constructor
        self._closed = threading.Event()
        self.stopped: ReplicaStoppedError | None = None

    def start(self, name: str) -> bool:
        """Watch in a daemon thread; False (no watch) outside a Serve replica."""
        self._replica = self._replica or serve_replica()
        if self._replica is None:
            return False
        self._name = name
        threading.Thread(target=self._run, name="serve-stop-watch", daemon=True).start()
        return True

    def passed_health_check(self) -> None:
        self._healthy_at = time.monotonic()

    def close(self) -> None:
        """The replica shuts down (Serve's `__del__` after the drain): nothing left to end."""
        self._closed.set()

    def _run(self) -> None:
        while not self._replica._shutting_down:
            if self._closed.wait(self._poll_s):
                return
        config = self._replica._deployment_config
        since_check = time.monotonic() - self._healthy_at
        if not self._alive() or since_check > HEALTHY_CHECKS * float(config.health_check_period_s) + self._poll_s:
            logger.warning("replica %s: Serve stops it after failed health checks; its requests end as "
                           "deaths", self._name)
            return
        grace = float(config.graceful_shutdown_timeout_s)
        if self._closed.wait(grace - min(self._margin_s, grace / 2)) or not self._alive():
            return     # drained in time, or the engine died meanwhile (its requests have that error)
        self.stopped = ReplicaStoppedError(f"replica {self._name}: Serve stopped it (scale-down or update) and "
                                           f"this request outlasted its graceful_shutdown_timeout_s ({grace:g} s)")
        self._on_stop(self.stopped)
