"""Requests whose caller died: an engine replica stops generating for them.

Ray does not cancel an actor's streaming call when the caller's process dies. A client that hangs
up closes the ingress's reader and the replica's generator with it (the engine aborts the request),
but an ingress replica that dies (killed, OOM, its node gone) closes nothing: its requests ran on to
`max_tokens`, holding batch slots and Serve's ongoing-request slots that the restarted ingress
starts counting from zero. So a caller that is a named actor (a Serve replica: Serve never restarts
a replica actor, it makes a new one) says who it is, and the replica looks the names up every
`CHECK_S` seconds while it has requests from them; a name that is gone ends its requests. A driver
(a job's, `--serve-app`) is no actor: it starts a named one of its own (`stand_in_for_driver`), which
Ray kills with the driver that owns it, so a driver killed mid-job ends its in-flight rows too.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from typing import Callable

logger = logging.getLogger(__name__)
CHECK_S = 2.0
GONE = object()     # put in a request's output queue: its generator returns (and aborts it)


_caller: list = []     # this process's answer, once known (an actor's name and namespace never change)


def this_caller() -> tuple[str, str] | None:
    """(namespace, name) of the named actor this runs in, or of a driver's stand-in; None in a
    driver without one or an unnamed actor. The namespace is looked up: a Serve replica lives in
    Serve's, not in the job's (`ctx.namespace`)."""
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE

    if _caller:
        return _caller[0]
    if not ray.is_initialized():
        return None
    ctx = ray.get_runtime_context()
    own = ctx.get_actor_id()
    name = ctx.get_actor_name() if own else None
    found = None
    for namespace in (SERVE_NAMESPACE, ctx.namespace) if name else ():
        try:
            if ray.get_actor(name, namespace=namespace)._actor_id.hex() == own:
                found = (namespace, name)
                break
        except ValueError:
            continue
    _caller.append(found)
    return found


@functools.cache
def _stand_in_class():
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class DriverStandIn:
        """Lives exactly as long as the driver that created it (its owner): Ray kills an actor that
        is not detached when its owner's process ends, however that ends."""

        def ready(self) -> bool:
            return True
    return DriverStandIn


def stand_in_for_driver(timeout_s: float = 60.0) -> tuple[str, str] | None:
    """Make this driver a caller that replicas can watch: a named actor it owns, on its own node
    (a node lost takes both), whose (namespace, name) `this_caller` returns from now on. None where
    no actor could be started (then the driver sends no caller, as before: its rows run on if it
    dies)."""
    import uuid

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if _caller and _caller[0] is not None:
        return _caller[0]
    name = f"driver-job-{uuid.uuid4().hex[:8]}"
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = None
    try:
        actor = _stand_in_class().options(name=name, scheduling_strategy=here).remote()
        ray.get(actor.ready.remote(), timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 - a watch is a courtesy to the app, not the job's correctness
        logger.warning("no stand-in actor for this driver (%s): rows of a killed driver will run on", e)
        if actor is not None:
            ray.kill(actor)
        return None
    _stand_ins.append(actor)        # referenced for the driver's life
    _caller[:] = [(ray.get_runtime_context().namespace, name)]
    return _caller[0]


def keep_stand_in() -> None:
    """A stand-in that died while its driver lives (killed by hand, its worker OOM-killed) would
    make every replica end this driver's rows: start another."""
    if _stand_ins and _caller and _caller[0] is not None and not caller_alive(_caller[0]):
        logger.warning("this driver's stand-in actor %s is gone: starting another", _caller[0][1])
        release_stand_in()
        stand_in_for_driver()


_stand_ins: list = []


def release_stand_in() -> None:
    """The driver is done with the app (before it leaves Ray): its stand-in goes, and this process
    is no caller any more (a later Ray session in it asks again)."""
    import ray

    while _stand_ins:
        actor = _stand_ins.pop()
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - Ray already gone: so is the actor
            pass
    _caller.clear()


def caller_alive(caller: tuple[str, str]) -> bool:
    """False only where Ray says no such actor exists; any other failure (a GCS hiccup) counts as
    alive: ending live requests on a guess would be worse than running on."""
    import ray

    try:
        ray.get_actor(caller[1], namespace=caller[0])
        return True
    except ValueError:
        return False
    except Exception:  # noqa: BLE001 - see the docstring
        return True


class CallerWatch:
    """Request id -> its caller, and the loop that ends the requests of callers that are gone."""

    def __init__(self, own: tuple[str, str] | None, end: Callable[[str], None]):
        self.own, self.end = own, end      # end(request_id): make its generator return
        self.callers: dict[str, tuple[str, str]] = {}
        self._task: asyncio.Task | None = None

    def track(self, request_id: str, caller) -> None:
        caller = tuple(caller) if caller else None
        if caller is None or caller == self.own:      # the colocated ingress dies with this replica
            return
        self.callers[request_id] = caller
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch())

    def forget(self, request_id: str) -> None:
        self.callers.pop(request_id, None)

    async def _watch(self) -> None:
        while self.callers:
            await asyncio.sleep(CHECK_S)
            for caller in set(self.callers.values()):
                if await asyncio.to_thread(caller_alive, caller):
                    continue
                gone = [rid for rid, c in self.callers.items() if c == caller]
                logger.warning("caller %s is gone: ending its %d request(s)", caller[1], len(gone))
                for rid in gone:
                    self.forget(rid)
                    self.end(rid)
