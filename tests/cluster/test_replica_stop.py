"""A replica Serve stops (scale-down, rolling update) ends the requests that outlast its graceful
shutdown as no request's doing (cluster/replica_stop.py), and callers retry them as free losses."""
from __future__ import annotations

import asyncio
import inspect
import time
from types import SimpleNamespace

import pytest
import ray.exceptions

from cluster import router_state
from cluster.config import ServeConfig
from cluster.death_cause import FREE_NODE_LOSSES, free_loss, loss_reason
from cluster.replica import EngineReplica
from cluster.replica_errors import EngineDiedError, ReplicaStoppedError
from cluster.replica_stop import StopWatch
from tests.cluster.test_router import _collect, _Handle, _out

FAKE = "tests.cluster.fake_engine"


@pytest.fixture(autouse=True)
def _fresh_router_state():
    router_state.clear()
    yield
    router_state.clear()


def _serve_replica(grace: float = 1.0, period: float = 2.0):
    """What StopWatch reads of Serve's replica object."""
    return SimpleNamespace(_shutting_down=False, _deployment_config=SimpleNamespace(
        graceful_shutdown_timeout_s=grace, health_check_period_s=period))


def _as_caller_sees_it(error: BaseException) -> BaseException:
    """A replica's exception as its caller gets it: pickled, wrapped in Ray's RayTaskError."""
    from ray import cloudpickle

    return ray.exceptions.RayTaskError("submit", "Traceback ...", cloudpickle.loads(cloudpickle.dumps(error))
                                       ).as_instanceof_cause()


def test_a_request_cut_by_a_serve_stop_is_a_free_loss_and_no_suspect():
    stopped = _as_caller_sees_it(ReplicaStoppedError("replica r: Serve stopped it"))
    assert free_loss(stopped) and loss_reason(stopped) == "replica_stopped"
    assert not free_loss(ray.exceptions.ActorDiedError())          # Serve's kill itself: a crash's error
    assert not free_loss(_as_caller_sees_it(EngineDiedError("ReplicaStoppedError: Serve stopped it")))  # by type
    suspect_at_call = []

    class Watched(_Handle):
        def remote(self, rid, *a, **kw):
            suspect_at_call.append(rid in router_state.suspects)
            return super().remote(rid, *a, **kw)
    h = Watched(([], stopped), ([], stopped), ([_out(finished=True)], None), replicas=["a", "b", "c"])
    assert asyncio.run(_collect(h, restartable=True, max_attempts=3))[-1].finished   # two stops: no poison
    assert suspect_at_call == [False, False, False]
    h = _Handle(*[([], stopped)] * (FREE_NODE_LOSSES + 2), replicas=list("defghi"))
    with pytest.raises(Exception, match="2 replicas died"):     # free FREE_NODE_LOSSES times, as node losses
        asyncio.run(_collect(h, restartable=True, max_attempts=FREE_NODE_LOSSES + 3))


@pytest.fixture
def replica():
    r = EngineReplica(ServeConfig(engine=FAKE, limits={"max_model_len": 256, "max_tokens": 64, "max_num_seqs": 2}))
    yield r
    r.shutdown()


def test_a_healthy_replica_serve_stops_ends_its_requests_before_the_kill(replica):
    serve = _serve_replica(grace=1.0)          # the kill would come 1 s after the stop began: cut at 0.5 s
    replica._stop_watch = StopWatch(replica._end_streams, alive=lambda: replica._dead is None, replica=serve,
                                    poll_s=0.05)
    assert replica._stop_watch.start(replica.replica_id)

    async def run():
        outs, t0 = [], None
        with pytest.raises(ReplicaStoppedError, match="graceful_shutdown_timeout_s"):
            async for out in replica.submit("long", "[slow:0.05] hi", {"max_tokens": 60, "temperature": 0}):
                outs.append(out)
                if t0 is None:
                    serve._shutting_down, t0 = True, time.monotonic()
        assert 0.4 < time.monotonic() - t0 < 2.0 and outs and not outs[-1].finished
        with pytest.raises(ReplicaStoppedError):
            [o async for o in replica.submit("late", "hi", {"max_tokens": 2})]
    asyncio.run(run())
    time.sleep(0.2)
    assert not replica.engine.has_unfinished_requests()       # the cut request was aborted in the engine


@pytest.mark.parametrize("why", ["engine dead", "health checks failing", "drained in time"])
def test_no_free_loss_for_a_replica_stopped_for_its_health_or_one_that_drained(why):
    """Serve stops a replica that failed its health checks the same way, and that may be a request's
    doing; a drain that ended first (`close`, from Serve's `__del__`) leaves nothing to end."""
    ended = []
    serve = _serve_replica(grace=0.2, period=0.05)
    watch = StopWatch(ended.append, alive=lambda: why != "engine dead", replica=serve, poll_s=0.02)
    watch.start("r")
    if why == "health checks failing":
        time.sleep(0.3)                       # no check passed for 3 periods and more
    else:
        watch.passed_health_check()
    serve._shutting_down = True
    if why == "drained in time":
        time.sleep(0.05)
        watch.close()
    time.sleep(0.4)
    assert ended == [] and watch.stopped is None
    ok = StopWatch(ended.append, alive=lambda: True, replica=_serve_replica(grace=0.2), poll_s=0.02)
    ok.start("r")
    ok._replica._shutting_down = True
    time.sleep(0.4)
    assert ended == [ok.stopped] and isinstance(ok.stopped, ReplicaStoppedError)


def test_the_serve_internals_the_watch_reads_are_there():
    """Private names of the pinned Ray (pyproject.toml): when an upgrade moves them, this says so (the
    watch itself then quietly does nothing and a stop counts as a death again)."""
    from ray._private.worker import global_worker
    from ray.serve._private.config import DeploymentConfig
    from ray.serve._private.replica import Replica, ReplicaActor

    assert isinstance(global_worker.actors, dict)     # actor id -> the actor instance of this process
    assert "self._replica_impl" in inspect.getsource(ReplicaActor.__init__)
    assert "self._shutting_down = False" in inspect.getsource(Replica.__init__)
    assert inspect.getsource(Replica._perform_graceful_shutdown).count("self._shutting_down = True") == 1
    assert "self._deployment_config" in inspect.getsource(Replica.__init__)
    assert {"graceful_shutdown_timeout_s", "health_check_period_s"} <= set(DeploymentConfig.model_fields)
