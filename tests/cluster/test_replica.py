"""EngineReplica on its own (no Ray): streaming, merging, refusals, aborts and engine crashes."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from cluster.config import ServeConfig
from cluster.replica import EngineReplica
from cluster.replica_errors import EngineDiedError, Rejected

FAKE = "tests.cluster.fake_engine"


@pytest.fixture
def replica():
    r = EngineReplica(ServeConfig(engine=FAKE, limits={"max_model_len": 256, "max_tokens": 64, "max_num_seqs": 2}))
    yield r
    r.shutdown()


def _collect(replica, *args, **kw):
    async def run():
        return [o async for o in replica.submit(*args, **kw)]
    return asyncio.run(run())


def test_stream_is_consistent(replica):
    outs = _collect(replica, "a", "hello", {"max_tokens": 8, "temperature": 0})
    final = outs[-1]
    assert final.finished and final.finish_reason == "length" and len(final.token_ids) == 8
    assert "".join(o.delta_text for o in outs) == final.text
    assert [t for o in outs for t in o.new_token_ids] == final.token_ids
    assert final.metrics["replica_id"] == replica.replica_id and "kv_usage" in final.metrics["replica_stats"]


@pytest.mark.parametrize("interval", [0, 3])
def test_stream_interval_holds_outputs_back_but_loses_none(replica, interval):
    """The first output at once, then one item per `interval` new tokens at most (0: none), and the
    last: fewer Ray messages per request, the same tokens, text and result."""
    prompt = "[slow:0.01] hello"    # a step every 10 ms: without an interval, every step is an item
    outs = _collect(replica, f"i{interval}", prompt, {"max_tokens": 10, "temperature": 0}, stream_interval=interval)
    every = _collect(replica, f"all{interval}", prompt, {"max_tokens": 10, "temperature": 0})
    sizes = [len(o.new_token_ids) for o in outs]
    assert len(every) == 10 and sizes[0] == 1 and outs[-1].finished and sum(sizes) == 10
    if interval:
        assert all(n >= interval for n in sizes[1:-1]) and len(outs) <= 1 + 9 // interval + 1
    else:
        assert len(outs) == 2
    assert [t for o in outs for t in o.new_token_ids] == outs[-1].token_ids == every[-1].token_ids
    assert "".join(o.delta_text for o in outs) == outs[-1].text == every[-1].text


def test_the_engine_is_built_and_stepped_on_one_thread(replica):
    """Every torch op of a replica runs from its engine thread: one OpenMP thread team, whose workers
    spin between ops (a team per thread makes libgomp put them to sleep after every op)."""
    _collect(replica, "t", "hello", {"max_tokens": 4, "temperature": 0})
    assert replica.engine.stepped_on == {replica.engine.built_on} == {replica._thread.ident}
    assert replica._thread.ident != threading.get_ident()


def test_refusals_are_items_not_exceptions(replica):
    (bad,) = _collect(replica, "b", "hello", {"max_tokens": 0})
    assert isinstance(bad, Rejected) and bad.param == "max_tokens"
    (long,) = _collect(replica, "c", "x" * 300, {"max_tokens": 8})
    assert isinstance(long, Rejected) and long.param == "prompt"
    (chat,) = _collect(replica, "d", None, {"max_tokens": 2}, messages=[{"role": "user"}])
    assert isinstance(chat, Rejected) and chat.param == "messages"


def test_chat_messages_are_rendered(replica):
    outs = _collect(replica, "e", None, {"max_tokens": 3}, messages=[{"role": "user", "content": "hi"}])
    assert len(outs[-1].prompt_token_ids) == len("user: hi\nassistant:")


def test_leaving_early_aborts_in_the_engine(replica):
    async def run():
        gen = replica.submit("f", "[slow:0.2] long", {"max_tokens": 60})    # 12 s alone: longer than the wait
        await gen.__anext__()
        await gen.aclose()
        for _ in range(100):
            st = await replica.stats()
            if st["num_running"] == 0 and st["num_waiting"] == 0:
                return True
            await asyncio.sleep(0.05)
        return False
    assert asyncio.run(run())


def test_the_requests_of_a_caller_that_died_end_in_the_engine(replica, monkeypatch):
    """A killed ingress replica closes nothing: its requests ran on to max_tokens, holding batch slots.
    Requests from a caller that is gone end (and are aborted); the colocated ingress's own, never."""
    import cluster.caller_watch as watch

    gone = {("serve", "SERVE_REPLICA::app#Ingress#dead")}
    monkeypatch.setattr(watch, "CHECK_S", 0.05)
    monkeypatch.setattr(watch, "caller_alive", lambda caller: caller not in gone)

    async def run():
        async def read(rid, caller):
            return [o async for o in replica.submit(rid, "[slow:0.02] long", {"max_tokens": 60}, caller=caller)]

        dead, alive = await asyncio.gather(read("d", ("serve", "SERVE_REPLICA::app#Ingress#dead")),
                                           read("a", ("serve", "SERVE_REPLICA::app#Ingress#live")))
        for _ in range(100):
            st = await replica.stats()
            if st["num_running"] == 0 and st["num_waiting"] == 0:
                break
            await asyncio.sleep(0.05)
        return dead, alive, st
    dead, alive, st = asyncio.run(run())
    assert not dead[-1].finished and len(dead[-1].token_ids) < 60         # ended early, nothing more sent
    assert alive[-1].finished and len(alive[-1].token_ids) == 60
    assert st["num_running"] == 0 and st["num_waiting"] == 0 and not replica._callers.callers


def test_priority_reaches_the_engine(replica):
    async def run():
        order = []

        async def one(tag, prio, delay):
            await asyncio.sleep(delay)
            async for o in replica.submit(tag, f"[slow:0.01] {tag}", {"max_tokens": 20}, priority=prio):
                if o.finished:
                    order.append(tag)
        await asyncio.gather(one("off1", 1, 0), one("off2", 1, 0), one("off3", 1, 0.02), one("on", 0, 0.05))
        return order
    order = asyncio.run(run())
    assert order.index("on") < order.index("off3"), order


def test_engine_crash_fails_requests_and_health(replica, tmp_path):
    with pytest.raises(EngineDiedError):
        _collect(replica, "g", f"[crash-once:{tmp_path / 'x'}:2] hi", {"max_tokens": 8})
    with pytest.raises(EngineDiedError):
        replica.check_health()
    with pytest.raises(EngineDiedError):
        _collect(replica, "h", "hi", {"max_tokens": 2})
    assert replica.record_routing_stats()["engine_alive"] is False


def _in_a_step(replica, *request) -> tuple[threading.Thread, list[EngineDiedError]]:
    """A request streaming on a thread, returned once a step runs; the list gets its EngineDiedError."""
    failed = []

    def run():
        try:
            _collect(replica, *request)
        except EngineDiedError as e:
            failed.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    while replica._step_started is None:
        threading.Event().wait(0.01)
    return t, failed


class _RankGone:
    """A TP group (cluster/tp_group.py) whose rank 1 went with its node: `node_loss` is Ray's verdict."""

    def __init__(self, node_loss: str | None, loop_ended: bool = False):
        self.verdict, self.loop_ended, self.asked = node_loss, loop_ended, []

    def node_loss(self, wait_s: float = 30.0) -> str | None:
        self.asked.append(wait_s)
        return self.verdict

    def check_health(self) -> None:
        if self.loop_ended:
            raise RuntimeError("a tensor-parallel rank's worker loop exited")

    def shutdown(self) -> None:
        pass


@pytest.mark.parametrize("verdict", ["preempted", "node_lost", None])
def test_a_step_failed_by_a_rank_lost_with_its_node_fails_its_requests_as_no_death(replica, tmp_path, verdict):
    """Rank 0's step fails because a rank's collective broke: the replica asks the group whether that
    rank went with a node the cluster took away, and its requests' EngineDiedError says so, which
    callers count as no death (cluster/death_cause.py); a rank that died otherwise counts."""
    from cluster.death_cause import loss_reason, lost_with_node

    replica.tp = tp = _RankGone(verdict)
    with pytest.raises(EngineDiedError) as failed:
        _collect(replica, "g", f"[crash-once:{tmp_path / 'x'}:2] hi", {"max_tokens": 8})
    assert tp.asked == [30.0] and failed.value.node_loss == verdict
    assert lost_with_node(failed.value) is (verdict is not None)
    assert loss_reason(failed.value) == (verdict or "EngineDiedError")
    assert ("node was" in str(failed.value)) is (verdict is not None)


def test_a_rank_the_health_check_finds_gone_fails_the_replica_and_its_requests(replica):
    """A rank's loop ended (its actor is gone, rank 0 may still wait in a collective): the health check
    gives the replica up with the rank's verdict, so the requests stuck in the step are retried
    elsewhere at once, as no death when the rank's node was taken away."""
    t, failed = _in_a_step(replica, "stuck", "[slow:0.2] hi", {"max_tokens": 50})
    replica.tp = tp = _RankGone("preempted", loop_ended=True)
    with pytest.raises(RuntimeError, match="worker loop exited"):
        replica.check_health()
    t.join(10)
    assert tp.asked == [2.0] and failed and failed[0].node_loss == "preempted"
    with pytest.raises(EngineDiedError):
        replica.check_health()


def test_a_step_running_past_step_timeout_fails_the_health_check(tmp_path):
    """A hung step (a kernel or collective that never returns) leaves the loop thread alive: the
    health check alone sees it, once the step has run limits.step_timeout_s. The replica then gives
    up at once, as after a crash: its requests fail (callers retry them elsewhere), new ones are
    refused, and in an actor the process exits, so Serve need not wait out a graceful shutdown."""
    r = EngineReplica(ServeConfig(engine=FAKE, limits={"max_model_len": 256, "max_tokens": 64,
                                                       "step_timeout_s": 0.5}))
    try:
        _collect(r, "fast", "hi", {"max_tokens": 4})
        r.check_health()                                  # steps that return: healthy
        t, failed = _in_a_step(r, "slow", "[slow:1.5] hi", {"max_tokens": 3})
        r.check_health()                                  # within the limit: healthy
        threading.Event().wait(0.7)
        with pytest.raises(EngineDiedError, match=r"limits.step_timeout_s \(0.5 s\): the engine is hung"):
            r.check_health()
        t.join(10)
        assert failed and "hung" in str(failed[0])        # the request in the step: failed, not left waiting
        with pytest.raises(EngineDiedError):
            r.check_health()                              # the step returned later: still given up on
        with pytest.raises(EngineDiedError):
            _collect(r, "late", "hi", {"max_tokens": 2})
        assert r.record_routing_stats()["engine_alive"] is False
    finally:
        r.shutdown()


def test_an_idle_tensor_parallel_engine_is_kept_alive(monkeypatch):
    """Ranks 1..n-1 of a TP replica wait for rank 0 in a collective that times out with the process
    group (300 s): the engine loop calls `keep_alive` every TP_KEEPALIVE_S while it has no work (a
    TP replica with no traffic for 5 minutes lost its ranks and was replaced), never while it has."""
    from types import SimpleNamespace

    import cluster.replica as replica_module

    monkeypatch.setattr(replica_module, "TP_KEEPALIVE_S", 0.2)
    r = EngineReplica(ServeConfig(engine=FAKE, limits={"max_model_len": 256, "max_tokens": 64, "max_num_seqs": 2}))
    try:
        time.sleep(1.5)
        assert getattr(r.engine, "keep_alives", 0) == 0        # tp_size 1: nothing to keep alive
        r.tp = SimpleNamespace(shutdown=lambda: None, check_health=lambda: None, node_loss=lambda **kw: None)
        time.sleep(2.0)
        assert r.engine.keep_alives >= 2
        outs = _collect(r, "busy", "[slow:0.1] hello", {"max_tokens": 10, "temperature": 0})
        assert outs[-1].finished and getattr(r.engine, "keep_alives_while_busy", 0) == 0
    finally:
        r.shutdown()
