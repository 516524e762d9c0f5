"""ReplicaPool's bookkeeping of replica losses, without Ray: which losses use one of the job's
restarts, and how long a replacement may take to start. (Whole jobs losing replicas run in
test_job_tiny.py and, to a preempted node on a real cluster, in test_job_cluster.py.)"""
from __future__ import annotations

import itertools
import types

import pytest
import ray.exceptions

from cluster.death_cause import FREE_NODE_LOSSES
from jobs import replica_pool
from jobs.input_reader import Row
from jobs.job_config import JobConfig
from jobs.replica_pool import JobFailed, ReplicaPool, _Replica
from tests.cluster.test_router import node_lost_error


@pytest.fixture
def pool(tmp_path, monkeypatch):
    cfg = JobConfig(input=str(tmp_path / "in.parquet"), engine="tests.cluster.fake_engine", model="fake", draft="none",
                    replicas=2, cpus_per_replica=1, max_replica_restarts=1, startup_timeout_s=60)
    p = ReplicaPool(cfg)
    spawned = itertools.count(2)
    monkeypatch.setattr(p, "_spawn", lambda index: _Replica(index, actor=f"actor-{next(spawned)}", ready_ref="starting",
                                                            spawned_at=replica_pool.time.monotonic()))
    monkeypatch.setattr(p, "_kill", lambda r: setattr(r, "dead", True))
    p.replicas = [_Replica(0, actor="actor-0"), _Replica(1, actor="actor-1")]
    return p


@pytest.mark.parametrize("how", ["preempted", "node shut down", "tp rank's node shut down"])
def test_a_replica_lost_with_its_node_is_replaced_without_using_a_restart(pool, how):
    for _ in range(3):                              # more losses than the job has restarts
        pool._on_death(pool.replicas[0], node_lost_error(how))
        pool.replicas[0].ready_ref = None           # the replacement started and served
    assert pool.restarts_left == 1 and pool.replicas_lost_with_node == 3
    assert pool.replicas[0].actor == "actor-4" and not pool.replicas[0].dead   # the third replacement
    unexpected = ray.exceptions.ActorDiedError()    # a node that failed without notice (an OOM-killed pod)
    unexpected.error_msg = "The actor died because its node has died.\n\tthe actor's node was terminated unexpectedly"
    pool._on_death(pool.replicas[1], unexpected)                              # counts: uses the restart
    assert pool.restarts_left == 0 and pool.replicas[1].actor == "actor-5"
    pool._on_death(pool.replicas[1], node_lost_error(how))  # lost while starting (a start that kills its node)
    assert pool.replicas[1].dead and pool.replicas_lost_with_node == 3        # counts; none left: not replaced


def test_a_replacement_mid_job_gets_its_own_startup_time(pool, monkeypatch):
    """Counted from the pool's start, or from the first replica still waiting, a replica replaced after
    `startup_timeout_s` of a job failed it at the next poll (a one-replica job losing its replica an
    hour in could never restart it)."""
    now = [1000.0]
    monkeypatch.setattr(replica_pool.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(replica_pool.ray, "cluster_resources", lambda: {"CPU": 1.0})   # for the message
    pool.replicas = [_Replica(0, actor="actor-0", spawned_at=0.0),                  # ready since the job began
                     _Replica(1, actor="actor-1", ready_ref="starting", spawned_at=0.0)]   # never placed
    pool._on_death(pool.replicas[0], ray.exceptions.ActorDiedError())
    now[0] += 30
    pool._check_startup()                            # 30 s into the replacement's start: still waiting
    now[0] += 31
    with pytest.raises(JobFailed, match="no replica became ready within 60s"):
        pool._check_startup()                        # 61 s: over startup_timeout_s


def test_min_ready_replicas_gates_the_first_rows_only(pool):
    """All replicas ready before rows go (min_ready_replicas = replicas, as benchmarks ask); a
    replacement that cannot be placed later (the spot capacity gone) must not stop the others."""
    pool.cfg.min_ready_replicas = 2
    pool.replicas[1].ready_ref = "starting"
    assert not pool.accepting                        # 1 of 2 up at the start: wait
    pool.replicas[1].ready_ref = None
    assert pool.accepting
    pool._on_death(pool.replicas[0], node_lost_error("preempted"))
    assert pool.replicas[0].ready_ref == "starting" and pool.accepting   # 1 up, its peer pending: keeps going


class _NodeLosingPool:
    """Stands in for ReplicaPool: every row sent is lost with its replica's node, except `ok_id`'s."""

    def __init__(self, ok_id):
        self.ok_id, self.sent, self.out = ok_id, [], []
        self.accepting, self.cpus, self.rows_by_node, self.replicas_lost_with_node = True, 1.0, {}, 0

    def start(self):
        pass

    def free_slots(self):
        return 4 - len(self.out)

    @property
    def in_flight(self):
        return len(self.out)

    def submit(self, row, params):
        assert len(self.sent) < 50, "a row lost with nodes is sent again without end"
        self.sent.append(row.id)
        self.out.append(row)

    def poll(self, timeout):
        rows, self.out = self.out, []
        done = [(r, {"text": "ok", "token_ids": [1], "finish_reason": "length"}) for r in rows if r.id == self.ok_id]
        return done, [(r, False) for r in rows if r.id != self.ok_id]

    def shutdown(self):
        pass


def test_a_row_lost_with_nodes_over_and_over_ends_as_an_error_row(tmp_path, monkeypatch):
    """Node losses are free for a row only FREE_NODE_LOSSES times; after those they count against
    max_row_retries like any death, so a row that took nodes down with it cannot loop forever."""
    from jobs import runner
    from tests.jobs.conftest import read_rows, write_parquet

    inp = write_parquet(tmp_path / "in.parquet", prompt=["fine", "takes nodes down"])
    cfg = JobConfig(input=str(inp), engine="tests.cluster.fake_engine", model="fake", draft="none",
                    max_row_retries=1)
    pool = _NodeLosingPool(ok_id="in.parquet:0")
    monkeypatch.setattr(runner.JobRunner, "_start_pool", lambda self: setattr(self, "pool", pool))
    m = runner.JobRunner(cfg).run()
    assert pool.sent.count("in.parquet:1") == FREE_NODE_LOSSES + 2   # 3 free, then 1 + max_row_retries
    rows = {r["id"]: r for r in read_rows(tmp_path / "in.out")}
    assert rows["in.parquet:0"]["error"] is None
    assert "died 2 times (and was lost with its node or unreachable 3 times)" in rows["in.parquet:1"]["error"]
    assert m["error_rows"] == 1


class _Ref:
    """A finished call (its value, or the error it raises), or with `pending` one that never answers."""

    def __init__(self, value=None, pending=False):
        self.value, self.pending = value, pending


class _Actor:
    """A replica whose health checks answer `probes` in turn (then: healthy)."""

    def __init__(self, *probes):
        self.probes = list(probes)
        self.check_health = types.SimpleNamespace(remote=lambda: self.probes.pop(0) if self.probes else _Ref())


@pytest.fixture
def fake_ray(pool, monkeypatch):
    """Ray's wait/get over `_Ref`s (a replacement's start never ends), and a clock the test moves."""
    now = [1000.0]
    monkeypatch.setattr(replica_pool.time, "monotonic", lambda: now[0])

    def get(ref):
        if isinstance(ref.value, BaseException):
            raise ref.value
        return ref.value

    def wait(refs, num_returns=1, timeout=None):
        pending = [r for r in refs if getattr(r, "pending", True)]
        return [r for r in refs if r not in pending], pending
    monkeypatch.setattr(replica_pool.ray, "wait", wait)
    monkeypatch.setattr(replica_pool.ray, "get", get)
    for r in pool.replicas:
        r.actor, r.spawned_at = _Actor(), 0.0
    return now


def _blip() -> ray.exceptions.ActorUnavailableError:
    return ray.exceptions.ActorUnavailableError("a network blip", None)


def _lose_row_to_a_blip(pool, replica) -> Row:
    """One row in flight on `replica` whose call fails as unreachable; polled."""
    row = Row(id="r")
    pool.calls[_Ref(_blip())] = replica_pool._Call(row, replica, 0.0)
    replica.in_flight += 1
    assert pool.poll(0.01) == ([], [(row, False)])     # sent again as a free loss, not one of max_row_retries
    return row


def test_an_unreachable_replica_is_probed_not_replaced_and_serves_again(pool, fake_ray):
    """ActorUnavailableError (a network or GCS blip: Ray has not called the actor dead) is no death:
    the replica keeps its process and the job its restarts; it takes no rows until a probe answers."""
    r0 = pool.replicas[0]
    r0.actor = _Actor(_Ref(_blip()), _Ref())           # the first probe: still unreachable; the second: back
    _lose_row_to_a_blip(pool, r0)
    assert pool.replicas[0] is r0 and not r0.dead and pool.restarts_left == 1 and pool.replicas_lost_with_node == 0
    assert not r0.ready and pool.free_slots() == pool.cfg.in_flight_per_replica   # r1's slots only
    pool.cfg.startup_timeout_s, pool.replicas[1].unreachable_since = 10, fake_ray[0]   # r1 too (a GCS blip)
    fake_ray[0] += 11
    pool.poll(0.01)                                    # the first probe's answer: still unreachable
    assert not r0.ready and not r0.dead                # and no replica ready is no start timing out
    pool.poll(0.01)                                    # probed again,
    assert not r0.ready
    pool.poll(0.01)                                    # and it answers
    assert r0.ready and pool.replicas[0] is r0 and pool.restarts_left == 1


@pytest.mark.parametrize("probe", ["hung", "unreachable", "node lost", "dead"])
def test_an_unreachable_replica_that_does_not_come_back_is_replaced(pool, fake_ray, probe):
    """Probed until UNREACHABLE_LIMIT_S (a hung replica never answers): then replaced with a restart.
    Ray calling it dead meanwhile replaces it at once, without a restart when its node was taken away."""
    answer = {"hung": _Ref(pending=True), "unreachable": _Ref(_blip()), "node lost": _Ref(node_lost_error("preempted")),
              "dead": _Ref(ray.exceptions.ActorDiedError())}[probe]
    r0 = pool.replicas[0]
    r0.actor = _Actor(*[answer] * 100)
    _lose_row_to_a_blip(pool, r0)
    for _ in range(int(replica_pool.UNREACHABLE_LIMIT_S) - 1):
        fake_ray[0] += 1
        pool.poll(0.01)
    if probe in ("hung", "unreachable"):
        assert pool.replicas[0] is r0 and not r0.dead       # within the limit: kept
        fake_ray[0] += 2
        pool.poll(0.01)
    assert r0.dead and pool.replicas[0].actor == "actor-2"   # replaced, once
    assert (pool.restarts_left, pool.replicas_lost_with_node) == ((1, 1) if probe == "node lost" else (0, 0))
