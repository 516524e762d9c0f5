"""Router logic without a cluster: load ranking, priority steering, and retry-on-death semantics."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import ray.exceptions
from ray.serve.exceptions import BackPressureError

from cluster import router_state
from cluster.admission import Admission, OverloadedError
from cluster.death_cause import loss_reason
from cluster.replica_errors import EngineDiedError, Rejected, guess_param
from cluster.request_retry import PoisonRequestError, ReplicaLostError, stream_outputs
from cluster.router import LoadAwareRouter


@pytest.fixture(autouse=True)
def _fresh_router_state():
    router_state.clear()
    yield
    router_state.clear()


class _Cache:
    def __init__(self, d=None):
        self.d = d or {}

    def get(self, k):
        return self.d.get(k)


def _router(queue_lens=None) -> LoadAwareRouter:
    r = LoadAwareRouter.__new__(LoadAwareRouter)  # the ranking needs none of Serve's plumbing
    r.initialize_state()
    r._replica_queue_len_cache = _Cache(queue_lens)
    return r


def _replica(rid, running=0, waiting=0, kv=0.0, alive=True, cap=16):
    return SimpleNamespace(replica_id=rid, max_ongoing_requests=cap, routing_stats=dict(
        num_running=running, num_waiting=waiting, kv_usage=kv, engine_alive=alive))


def _call(call_id, method="submit", args=(), priority=0):
    """A pending request as Serve hands it to `on_request_routed`."""
    return SimpleNamespace(metadata=SimpleNamespace(call_method=method, internal_request_id=call_id),
                           args=list(args), kwargs={"priority": priority})


def _rank(router, replicas, priority=0, rid=None):
    pending = SimpleNamespace(kwargs={"priority": priority}, args=[rid] if rid else [],
                              future=SimpleNamespace(done=lambda: False))
    return [rank[0].replica_id for rank in asyncio.run(router.choose_replicas(replicas, pending))]


def test_least_loaded_first():
    reps = [_replica("busy", running=12, kv=0.6), _replica("idle"), _replica("mid", running=4, kv=0.2)]
    assert _rank(_router(), reps) == ["idle", "mid", "busy"]


def test_kv_pressure_counts():
    reps = [_replica("full-kv", running=2, kv=0.95), _replica("roomy", running=3, kv=0.1)]
    assert _rank(_router(), reps)[0] == "roomy"


def test_local_inflight_reacts_before_stats_refresh():
    r = _router()
    reps = [_replica("a"), _replica("b")]
    for i in range(5):
        r.on_request_routed(_call(f"c{i}"), "a", None)
    assert _rank(r, reps)[0] == "b"
    for i in range(5):
        r.on_request_completed("a", f"c{i}")
    assert r._inflight == {}


def test_calls_ending_before_they_are_seen_routed_or_rejected_leak_no_slot():
    """Serve queues a call's done-callback from another thread, so a call that fails at once can
    end before `on_request_routed` runs; a rejected call ends without ever being routed. Neither
    may leave the replica counted busy (a leaked count kept offline rows off it forever)."""
    r = _router()
    rep = _batch_replica("a", running=0, max_num_seqs=1)
    r.on_request_completed("a", "fast")                 # ended first ...
    r.on_request_routed(_call("fast"), "a", None)       # ... then seen routed
    r.on_request_completed("a", "rejected")             # never routed
    assert r._inflight == {} and r.offline_room(rep, "row-1")
    r.on_request_routed(_call("running"), "a", None)
    r.on_request_completed("a", "rejected-2")           # a rejection does not free the running call's slot
    assert not r.offline_room(rep, "row-2")
    r.on_request_completed("a", "running")
    assert r.offline_room(rep, "row-3")


@pytest.mark.parametrize("events", [
    "done done done routed routed routed",        # orders seen in the ingress for one n=3 request
    "routed done done done routed routed",
    "routed routed routed done done done",
])
def test_the_n_samples_of_one_request_share_a_call_id_and_leak_no_slot(events):
    """Serve stamps every call made while serving one HTTP request with that request's id: the n
    samples' `submit` calls share it. Counted one per id, the last routing outlived its completions,
    and after max_num_seqs such requests a replica never took an offline row again."""
    r = _router()
    rep = _batch_replica("a", running=0, max_num_seqs=1)
    for e in events.split():
        if e == "routed":
            r.on_request_routed(_call("http-1"), "a", None)
        else:
            r.on_request_completed("a", "http-1")
    assert r._inflight == {} and not r._ended_unrouted and r.offline_room(rep, "row-1")
    for _ in range(3):                                  # three in flight under one id count three
        r.on_request_routed(_call("http-2"), "a", None)
    assert r.ongoing(_replica("a")) == 3
    for _ in range(3):
        r.on_request_completed("a", "http-2")
    assert r._inflight == {} and r.offline_room(rep, "row-2")


def test_a_count_that_outlives_the_ttl_stops_holding_the_replica(monkeypatch):
    from cluster import router as router_module

    r = _router()
    rep = _batch_replica("a", running=0, max_num_seqs=1)
    r.on_request_routed(_call("lost"), "a", None)
    assert not r.offline_room(rep, "row-1")
    now = time.time()
    monkeypatch.setattr(router_module.time, "time", lambda: now + router_module.INFLIGHT_TTL_S + 1)
    assert r.offline_room(rep, "row-1") and r._inflight == {}


def test_a_call_one_replica_rejected_counts_where_it_then_runs():
    """Serve ends a rejected attempt (on_request_completed on the replica that refused it) and routes
    the same call again, under the same id: it counted as ended where it then ran, so that replica's
    one batch slot looked free while the call ran there."""
    r = _router()
    b = _batch_replica("b", running=0, max_num_seqs=1)
    r.on_request_completed("a", "c1")                   # replica a refused it ...
    r.on_request_routed(_call("c1"), "b", None)         # ... and b runs it
    assert r.ongoing(b) == 1 and not r.offline_room(b, "row-1")
    r.on_request_completed("b", "c1")
    assert r._inflight == {} and r.offline_room(b, "row-2")


def test_the_stats_less_only_what_they_counted_and_that_ended_since(monkeypatch):
    """`ongoing(fresh)` is the replica's stats (up to a second old) less the requests that ended here
    since: only those routed before the stats were taken, which they counted. Short rows sent and
    ended after them were subtracted too, so the count fell below what the engine ran and offline
    rows overfilled its batch."""
    import cluster.router as router_mod

    r = _router()
    rep = _batch_replica("a", running=8, max_num_seqs=8)   # 7 requests of other callers, and ours
    now = [1000.0]
    monkeypatch.setattr(router_mod.time, "time", lambda: now[0])
    r.on_request_routed(_call("ours"), "a", None)
    now[0] += 0.5
    rep.routing_stats["updated_at"] = now[0]               # the stats count ours
    for i in range(8):                                     # rows sent and ended since: never in the stats
        now[0] += 0.01
        r.on_request_routed(_call(f"short{i}"), "a", None)
        r.on_request_completed("a", f"short{i}")
    assert r.ongoing(rep, fresh=True) == 8 and not r.offline_room(rep, "row-1")
    r.on_request_completed("a", "ours")                    # counted by the stats, ended since: a slot is free
    assert r.ongoing(rep, fresh=True) == 7 and r.offline_room(rep, "row-2")


def serve_sets_replicas(monkeypatch) -> None:
    """Serve's own `update_replicas` needs a live router: here it only sets the replica set."""
    from ray.serve._private.request_router.request_router import RequestRouter

    monkeypatch.setattr(RequestRouter, "update_replicas",
                        lambda self, reps: setattr(self, "_replicas", {x.replica_id: x for x in reps}))


def test_what_is_kept_per_replica_follows_the_live_replicas(monkeypatch):
    """A replica scaled down or replaced after a failed health check is no death this caller saw
    (`on_replica_actor_died` is not called): what the router keeps for it goes when Serve drops it."""
    r = _router()
    for rid in ("a", "b"):
        r.on_request_routed(_call(f"c-{rid}"), rid, None)
        r.on_request_completed(rid, f"c-{rid}")
        r._prefix_capacity[router_state.replica_key(rid)] = 64
    serve_sets_replicas(monkeypatch)
    r.update_replicas([_replica("b")])                  # Serve drops a
    assert set(r._completed) == {"b"} and set(r._prefix_capacity) == {router_state.replica_key("b")}


def test_queue_len_cache_counts():
    assert _rank(_router({"a": 10}), [_replica("a"), _replica("b")])[0] == "b"


def test_offline_work_prefers_headroom():
    reps = [_replica("backlogged", running=1, waiting=3), _replica("hot-kv", running=1, kv=0.9),
            _replica("spare", running=6, kv=0.3)]
    assert _rank(_router(), reps, priority=1)[0] == "spare"
    assert _rank(_router(), reps, priority=0)[0] != "spare"  # online work just takes the least loaded


def test_dead_engines_are_skipped():
    reps = [_replica("crashed", alive=False), _replica("ok", running=10)]
    assert _rank(_router(), reps) == ["ok"]
    assert _rank(_router(), [_replica("crashed", alive=False)]) == ["crashed"]  # nothing better: let Serve wait


# ---- stream_outputs ---------------------------------------------------------------------------
def _out(n_new=1, finished=False):
    return SimpleNamespace(new_token_ids=[7] * n_new, finished=finished)


class _Gen:
    def __init__(self, items, exc):
        self.items, self.exc, self.cancelled = items, exc, False

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for it in self.items:
            yield it
        if self.exc is not None:
            raise self.exc

    def cancel(self):
        self.cancelled = True


class _Handle:
    """Plays a script of (items, exception) per call; `raise_on_call` mimics BackPressureError at .remote()."""

    def __init__(self, *script, raise_on_call=None, replicas=None):
        self.script, self.raise_on_call, self.calls, self.gens = list(script), raise_on_call, [], []
        self.replicas = list(replicas or [])  # where the router "routed" each call, as LoadAwareRouter records


    def options(self, **kw):
        return self

    @property
    def submit(self):
        return self

    def remote(self, rid, prompt, params, priority=0, messages=None, stream_interval=1, caller=None):
        self.calls.append((rid, priority))
        if self.raise_on_call:
            raise self.raise_on_call
        if self.replicas:
            router_state.routed[rid] = self.replicas.pop(0)
        gen = _Gen(*self.script.pop(0))
        self.gens.append(gen)
        return gen


async def _collect(handle, **kw):
    return [o async for o in stream_outputs(handle, "req", "p", {}, retry_backoff_s=0, **kw)]


@pytest.mark.parametrize("death", [EngineDiedError("boom"), ray.exceptions.ActorDiedError(),
                                   ray.exceptions.ActorUnavailableError("gone", None)])
def test_retry_when_no_token_was_sent(death):
    h = _Handle(([], death), ([_out(), _out(finished=True)], None))
    outs = asyncio.run(_collect(h, priority=1))
    assert len(outs) == 2 and [c[0] for c in h.calls] == ["req", "req-retry1"] and h.calls[1][1] == 1


def test_error_after_tokens_were_streamed():
    h = _Handle(([_out(), _out()], EngineDiedError("boom")), ([_out(finished=True)], None))
    with pytest.raises(ReplicaLostError, match="after 2 tokens"):
        asyncio.run(_collect(h))
    assert len(h.calls) == 1


def test_restartable_retries_even_after_tokens():
    h = _Handle(([_out(), _out()], EngineDiedError("boom")), ([_out(3, finished=True)], None))
    outs = asyncio.run(_collect(h, restartable=True))
    assert outs[-1].finished and len(h.calls) == 2


def test_gives_up_after_max_attempts():
    """The same dead replica chosen again and again (Serve has not noticed yet) is one death, not
    a poison request; attempts are still bounded."""
    h = _Handle(*[([], EngineDiedError("boom"))] * 3, replicas=["a", "a", "a"])
    with pytest.raises(ReplicaLostError, match="3 attempts") as ei:
        asyncio.run(_collect(h, max_attempts=3))
    assert not isinstance(ei.value, PoisonRequestError)


@pytest.mark.parametrize("replicas", [None, ["a", "b", "c"]], ids=["unknown replicas", "routed"])
def test_a_request_two_replicas_died_under_is_not_resubmitted(replicas):
    h = _Handle(*[([], ray.exceptions.ActorDiedError())] * 2, ([_out(finished=True)], None), replicas=replicas)
    with pytest.raises(PoisonRequestError, match="2 replicas died while serving it"):
        asyncio.run(_collect(h, restartable=True))
    assert len(h.calls) == 2


def test_only_deaths_under_the_request_count():
    """a dies under the request; the retry lands on a again (not yet replaced): same death; then on b,
    which another request had already seen die before this attempt was sent: not this one's doing;
    the next death (c) is the second, and the request is answered with an error."""
    router_state.mark_dead("b")
    h = _Handle(*[([], EngineDiedError("boom"))] * 4, replicas=["a", "a", "b", "c"])
    with pytest.raises(PoisonRequestError):
        asyncio.run(_collect(h))
    assert len(h.calls) == 4


# Ray's words for an actor on a node drained and then shut down like a deleted pod (SIGTERM to its raylet)
NODE_SHUT_DOWN = ("The actor died unexpectedly before finishing this task.\n\tclass_name: ServeReplica:app:LLMServer\n"
                  "The actor died because its node has died. Node Id: 4912854e\n"
                  "\tthe actor's node was terminated expectedly: received SIGTERM")


def node_lost_error(how: str) -> BaseException:
    """The error Ray raises for an actor lost with its node: `preempted` (drained, then gone) or
    `node shut down` (drained, then SIGTERM to its raylet); `tp rank's node shut down`: what a caller
    of a tensor-parallel replica gets when a non-zero rank went with its node (cluster/replica.py's
    EngineDiedError, through Ray's pickling and its RayTaskError wrapping)."""
    if how == "tp rank's node shut down":
        from ray import cloudpickle

        died = cloudpickle.loads(cloudpickle.dumps(EngineDiedError("rank 1 gone", node_loss="node_lost")))
        return ray.exceptions.RayTaskError("submit", "Traceback ...", died).as_instanceof_cause()
    e = ray.exceptions.ActorDiedError()
    if how == "preempted":
        e._preempted = True
    else:
        e.error_msg = NODE_SHUT_DOWN
    return e


@pytest.mark.parametrize("how", ["preempted", "node shut down", "tp rank's node shut down"])
def test_replicas_lost_with_their_node_count_no_death_and_make_no_suspect(how):
    """A spot VM taken back (Ray's `preempted`: the node drained, then gone) or a node drained and shut
    down (Ray: "its node has died ... terminated expectedly") took the replicas down, not the request:
    its retries are no suspects (which run one per replica, behind each other) and two such losses are
    no poison verdict; the retries metric names the cause."""
    def preempted():
        return node_lost_error(how)
    assert loss_reason(preempted()) == ("preempted" if how == "preempted" else "node_lost")
    assert loss_reason(ray.exceptions.ActorDiedError()) == "ActorDiedError"
    assert loss_reason(EngineDiedError("crashed")) == "EngineDiedError"   # a crash of the replica's own
    suspect_at_call = []

    class Watched(_Handle):
        def remote(self, rid, *a, **kw):
            suspect_at_call.append(rid in router_state.suspects)
            return super().remote(rid, *a, **kw)
    h = Watched(([], preempted()), ([], preempted()), ([_out(finished=True)], None), replicas=["a", "b", "c"])
    outs = asyncio.run(_collect(h, restartable=True, max_attempts=3))
    assert outs[-1].finished and len(h.calls) == 3 and suspect_at_call == [False, False, False]
    h = Watched(([], ray.exceptions.ActorDiedError()), ([_out(finished=True)], None), replicas=["d", "e"])
    asyncio.run(_collect(h, restartable=True))
    assert suspect_at_call[-1] is True                 # any other death: its retry is a suspect, as before


def test_node_losses_are_free_a_few_times_then_count():
    """FREE_NODE_LOSSES losses with a node taken away are no death; after them each counts, so a
    request that somehow takes nodes down with it meets the poison rule like any other."""
    from cluster.death_cause import FREE_NODE_LOSSES

    n = FREE_NODE_LOSSES + 2
    h = _Handle(*[([], node_lost_error("preempted"))] * n, ([_out(finished=True)], None),
                replicas=[chr(ord("a") + i) for i in range(n + 1)])
    with pytest.raises(PoisonRequestError, match="2 replicas died while serving it"):
        asyncio.run(_collect(h, restartable=True, max_attempts=n + 1))
    assert len(h.calls) == n


def test_retry_after_one_death_succeeds():
    h = _Handle(([_out()], EngineDiedError("boom")), ([_out(2, finished=True)], None), replicas=["a", "b"])
    outs = asyncio.run(_collect(h, restartable=True))
    assert outs[-1].finished and router_state.seen_dead("a") and not router_state.seen_dead("b")
    assert not router_state.routed  # nothing left behind


def test_router_state_survives_serve_pickling_the_router_by_value():
    """Serve pickles the router class by value (its module's globals copied): the state it shares with
    stream_outputs must live elsewhere, or the router would record routes into a copy."""
    from ray import cloudpickle

    import cluster.router

    cloudpickle.register_pickle_by_value(cluster.router)
    try:   # (a class comes back as itself in the same process; its methods show the copying)
        routed = cloudpickle.loads(cloudpickle.dumps(LoadAwareRouter.on_request_routed))
    finally:
        cloudpickle.unregister_pickle_by_value(cluster.router)
    assert routed.__globals__ is not LoadAwareRouter.on_request_routed.__globals__
    routed(_router(), _call("c7", args=["req-7", "p", {}]), "replica-a", None)
    assert router_state.routed == {"req-7": "replica-a"}   # what stream_outputs reads


def test_an_unavailable_replica_is_not_taken_for_dead():
    h = _Handle(([], ray.exceptions.ActorUnavailableError("blip", None)), ([_out(finished=True)], None),
                replicas=["a", "b"])
    assert asyncio.run(_collect(h))[-1].finished and not router_state.seen_dead("a")


def test_unavailable_replicas_are_no_deaths_of_the_request_a_few_times():
    """Ray raises ActorUnavailableError for a replica it cannot reach now (a network or GCS blip) and
    does not call it dead: two such on two replicas answered an innocent request with 500
    `replicas_died`, and made its retries suspects. They are free as node losses are, a few times."""
    blip = ray.exceptions.ActorUnavailableError("blip", None)
    suspect_at_call = []

    class Watched(_Handle):
        def remote(self, rid, *a, **kw):
            suspect_at_call.append(rid in router_state.suspects)
            return super().remote(rid, *a, **kw)
    h = Watched(([], blip), ([], blip), ([_out(finished=True)], None), replicas=["a", "b", "c"])
    assert asyncio.run(_collect(h, restartable=True, max_attempts=3))[-1].finished
    assert suspect_at_call == [False, False, False]


def test_replicas_seen_dead_are_not_chosen():
    router_state.mark_dead("a")
    assert _rank(_router(), [_replica("a"), _replica("b", running=10)]) == ["b"]
    assert _rank(_router(), [_replica("a")]) == []  # only dead ones: wait (paced) for a replacement


def test_samples_of_one_prompt_follow_their_sibling():
    """The n samples of a prompt (one group) go where a sibling went, so that replica prefills the
    prompt once; requests outside the group still go by load."""
    router_state.groups.update({"c-0": "c", "c-1": "c", "d-0": "d"})
    reps = [_replica("a", running=2), _replica("b")]
    assert _rank(_router(), reps, rid="c-0") == ["b", "a"]          # the group's first: by load
    reps = [_replica("a"), _replica("b", running=4)]                # (b got busier meanwhile)
    assert _rank(_router(), reps, rid="c-1") == ["b", "a"]          # its sibling follows it
    assert _rank(_router(), reps, rid="d-0") == ["a", "b"]
    assert _rank(_router(), reps, rid="other") == ["a", "b"]
    router_state.leave_group("c-0")
    assert router_state.group_replicas["c"] == "b"
    router_state.leave_group("c-1")
    assert "c" not in router_state.group_replicas                   # forgotten with its last request


def test_two_suspects_never_share_a_replica():
    """Retries of requests a replica died under (suspects) run one per replica: if one of them is a
    poison request, the other does not die with it a second time."""
    from collections import deque

    r = _router()
    loop = asyncio.new_event_loop()
    try:
        def pending(rid):
            return SimpleNamespace(args=[rid, "p", {}], kwargs={"priority": 0}, future=loop.create_future())

        router_state.suspects.update({"p-retry1", "x-retry1"})
        reqs = [pending("p-retry1"), pending("x-retry1"), pending("fresh")]
        r._pending_requests_to_fulfill = deque(reqs)
        r._cancel_routing_task_for_pending_request = r._record_queue_wait_time = lambda pr: None
        r._remove_pending_request_from_indices = lambda pr: None
        t = SimpleNamespace(replica_id="t")
        r._fulfill_next_pending_request(t)
        assert reqs[0].future.result() is t and router_state.routed["p-retry1"] == "t"   # claimed at once
        r._fulfill_next_pending_request(t)           # t hosts a suspect: the other suspect is passed over
        assert not reqs[1].future.done() and reqs[2].future.result() is t
        r._fulfill_next_pending_request(t)           # nothing it may take: the suspect keeps waiting
        assert not reqs[1].future.done() and list(r._pending_requests_to_fulfill) == [reqs[1]]
        assert _rank(r, [_replica("t"), _replica("u")], rid="x-retry1") == ["u"]
        assert _rank(r, [_replica("t")], rid="x-retry1") == []
        assert _rank(r, [_replica("t")], rid="fresh-2") == ["t"]
        r._fulfill_next_pending_request(SimpleNamespace(replica_id="u"))
        assert reqs[1].future.result().replica_id == "u"
    finally:
        loop.close()


def test_admission_takes_a_requests_samples_all_or_none():
    adm = Admission(4)
    adm.enter(0, 3)
    with pytest.raises(OverloadedError, match="limit is 4 and this request's n asks for 2"):
        adm.enter(0, 2)                                   # nothing taken: one still fits
    adm.enter(0)
    with pytest.raises(OverloadedError, match="limit is 4 "):
        adm.enter(0)
    adm.leave(0, 3)
    assert adm.in_flight == 1


def test_backpressure_becomes_overloaded():
    h = _Handle(raise_on_call=BackPressureError(num_queued_requests=4, max_queued_requests=4))
    with pytest.raises(OverloadedError, match="overloaded"):
        asyncio.run(_collect(h))


def test_rejections_pass_through_without_retry():
    h = _Handle(([Rejected("SamplingParams.top_p must be in (0, 1]", "top_p")], None))
    assert isinstance(asyncio.run(_collect(h))[0], Rejected) and len(h.calls) == 1


def test_consumer_leaving_cancels_the_replica_call():
    h = _Handle(([_out(), _out(), _out(finished=True)], None))

    async def take_one():
        it = stream_outputs(h, "req", "p", {})
        await it.__anext__()
        await it.aclose()

    asyncio.run(take_one())
    assert h.gens[0].cancelled


@pytest.mark.parametrize("message,param", [
    ("SamplingParams.max_tokens must be a positive integer, got 0", "max_tokens"),
    ("prompt has 900 tokens; the maximum context is 512 tokens", "prompt"),
    ("prompt is too long: 300 prompt tokens + max_tokens 16 exceeds max_model_len 256", "prompt"),
    ("model 'x' has no chat template; set `chat_template`", None),
    ("messages[0] must be an object with 'role' and 'content'", "messages"),
])
def test_guess_param(message, param):
    assert guess_param(message) == param


def test_freed_slot_goes_to_the_oldest_online_request():
    from collections import deque

    r = _router()
    loop = asyncio.new_event_loop()
    try:
        def pending(tag, prio, cancelled=False):
            pr = SimpleNamespace(tag=tag, kwargs={"priority": prio}, future=loop.create_future())
            if cancelled:
                pr.future.cancel()
            return pr

        reqs = [pending("off-old", 1), pending("gone", 0, cancelled=True), pending("on-1", 0), pending("on-2", 0),
                pending("off-new", 1)]
        r._pending_requests_to_fulfill = deque(reqs)
        r._cancel_routing_task_for_pending_request = r._record_queue_wait_time = lambda pr: None
        r._remove_pending_request_from_indices = lambda pr: None
        served = []
        for _ in range(4):
            r._fulfill_next_pending_request("replica")
            served += [pr.tag for pr in reqs if pr.future.done() and not pr.future.cancelled() and pr.tag not in served]
        assert served == ["on-1", "on-2", "off-old", "off-new"]
        r._fulfill_next_pending_request("replica")  # only the cancelled one left: dropped, nothing served
        assert not r._pending_requests_to_fulfill
    finally:
        loop.close()


def _batch_replica(rid, running, max_num_seqs=4, cap=8):
    rep = _replica(rid, running=running, cap=cap)
    rep.routing_stats["max_num_seqs"] = max_num_seqs
    return rep


def test_offline_rows_fill_only_the_engine_batch_and_wait_when_every_batch_is_full():
    """Offline rows may take a replica's engine batch (max_num_seqs), never the queue slots beyond it
    (kept for online requests); with every batch full they wait in the router, counted as deferred."""
    reps = [_batch_replica("full", running=4), _batch_replica("room", running=2)]
    assert _rank(_router(), reps, priority=1, rid="row-1") == ["room"]
    assert set(_rank(_router(), reps, priority=0, rid="chat-1")) == {"full", "room"}   # online may queue
    both_full = [_batch_replica("a", running=4), _batch_replica("b", running=5)]
    assert _rank(_router(), both_full, priority=1, rid="row-2") == []
    assert _rank(_router(), both_full, priority=1, rid="row-2") == []       # asked again: still one row
    assert router_state.router_counters()["offline_deferred"] == 1
    assert _rank(_router(), both_full, priority=0, rid="chat-2") != []


def test_calls_that_are_not_engine_requests_do_not_fill_the_batch_offline_rows_see():
    """A caller polling `stats` through the handle: Serve's queue-length cache counts those calls (it
    read one above the engine's requests, and a job's rows ran one at a time), so the engine batch
    offline rows may fill is counted from the replica's stats and this caller's `submit` calls."""
    r = _router({"b": 4})                                   # Serve's cache: 4 calls on the replica
    rep = _batch_replica("b", running=1)                    # the engine: 1 of max_num_seqs 4 running
    assert _rank(r, [rep], priority=1, rid="row-1") == ["b"]
    assert _rank(r, [rep], priority=0, rid="chat-1") == ["b"]
    for i in range(3):
        r.on_request_routed(_call(f"s{i}", "stats"), "b", None)
    assert r._inflight == {} and r.offline_room(rep, "row-2")
    for i in range(3):
        r.on_request_completed("b", f"s{i}")
    assert not r._control_ids and "b" not in r._completed   # its end frees no engine slot
    for i in range(3):
        r.on_request_routed(_call(f"r{i}", args=[f"row-{i}"], priority=1), "b", None)
    assert len(r._inflight["b"]) == 3 and r.offline_room(rep, "row-4")
    r.on_request_routed(_call("r3", args=["row-3"], priority=1), "b", None)
    assert not r.offline_room(rep, "row-5")                 # 4 rows sent here: the batch is full


def test_offline_requests_have_their_own_admission_budget():
    adm = Admission(1, offline_limit=2)
    adm.enter(0)
    adm.enter(1)                 # online full: offline still admitted (and the reverse below)
    adm.enter(1)
    with pytest.raises(OverloadedError, match="offline"):
        adm.enter(1)
    with pytest.raises(OverloadedError, match="limit is 1"):
        adm.enter(0)
    adm.leave(1)
    adm.leave(1)
    assert (adm.in_flight, adm.offline_in_flight) == (1, 0)


def test_a_slot_freed_on_a_full_batch_goes_to_online_work_only():
    from collections import deque

    r = _router()
    loop = asyncio.new_event_loop()
    try:
        def pending(tag, prio):
            return SimpleNamespace(tag=tag, kwargs={"priority": prio}, args=[tag], future=loop.create_future())

        reqs = [pending("row-old", 1), pending("chat", 0)]
        r._pending_requests_to_fulfill = deque(reqs)
        r._cancel_routing_task_for_pending_request = r._record_queue_wait_time = lambda pr: None
        r._remove_pending_request_from_indices = lambda pr: None
        r._fulfill_next_pending_request(_batch_replica("full", running=4))
        assert reqs[1].future.done() and not reqs[0].future.done()
        r._fulfill_next_pending_request(_batch_replica("full", running=4))
        assert not reqs[0].future.done()          # the batch is still full: the row keeps waiting
        r._fulfill_next_pending_request(_batch_replica("room", running=1))
        assert reqs[0].future.done()
        assert router_state.router_counters() == {"offline_deferred": 1, "online_ahead_of_offline": 0}
        reqs = [pending("row-2", 1), pending("chat-2", 0)]      # room for both: the online one still first
        r._pending_requests_to_fulfill = deque(reqs)
        r._fulfill_next_pending_request(_batch_replica("room", running=1))
        assert reqs[1].future.done() and not reqs[0].future.done()
        assert router_state.router_counters() == {"offline_deferred": 2, "online_ahead_of_offline": 1}
    finally:
        loop.close()


def test_a_burst_of_offline_rows_cannot_overfill_a_batch_before_any_is_routed():
    """Serve hands out slots to a burst before `on_request_routed` records any: rows given a replica
    count against its batch until then."""
    from collections import deque

    r = _router()
    loop = asyncio.new_event_loop()
    try:
        reqs = [SimpleNamespace(tag=f"row-{i}", kwargs={"priority": 1}, args=[f"row-{i}"], future=loop.create_future())
                for i in range(3)]
        r._pending_requests_to_fulfill = deque(reqs)
        r._cancel_routing_task_for_pending_request = r._record_queue_wait_time = lambda pr: None
        r._remove_pending_request_from_indices = lambda pr: None
        replica = _batch_replica("one-slot-left", running=3)       # max_num_seqs 4
        for _ in range(3):
            r._fulfill_next_pending_request(replica)
        assert [pr.future.done() for pr in reqs] == [True, False, False]
        r.on_request_routed(_call("c0", args=["row-0"], priority=1), "one-slot-left", None)
        assert r._promised == {}
    finally:
        loop.close()
