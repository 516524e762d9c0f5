"""The router's choices that outlive one ranking, without a cluster: the retries of the n samples of
one request (one group) are one suspect and stay together, and a replica ranked first for a request's
prefix or group serves that request, not an older one."""
from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace

import pytest

from cluster import router_state
from cluster.router import LoadAwareRouter
from eagle_worker.engine_api import block_hashes
from tests.cluster.test_prefix_routing import SYSTEM, _Cache, _fresh_router_state  # noqa: F401 - autouse fixture


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _router() -> LoadAwareRouter:
    r = LoadAwareRouter.__new__(LoadAwareRouter)  # none of Serve's plumbing but its pending-request index
    r.initialize_state()
    r._replica_queue_len_cache = _Cache()
    r._pending_requests_by_id = {}
    r._cancel_routing_task_for_pending_request = r._record_queue_wait_time = lambda pr: None
    r._remove_pending_request_from_indices = lambda pr: r._pending_requests_by_id.pop(
        pr.metadata.internal_request_id, None)
    return r


def _replica(rid, running=0):
    return SimpleNamespace(replica_id=rid, max_ongoing_requests=16, routing_stats=dict(
        num_running=running, num_waiting=0, kv_usage=0.0, engine_alive=True))


def _queue(router, loop, *reqs):
    """Requests waiting in the router, oldest first, as Serve queues and indexes them."""
    pending = [SimpleNamespace(args=[rid, prompt, {}], kwargs={"priority": prio}, future=loop.create_future(),
                               metadata=SimpleNamespace(internal_request_id=f"call-{rid}"))
               for rid, prompt, prio in reqs]
    router._pending_requests_to_fulfill = deque(pending)
    router._pending_requests_by_id = {pr.metadata.internal_request_id: pr for pr in pending}
    return pending


def _choose(router, replicas, pending) -> list[str]:
    return [rank[0].replica_id for rank in asyncio.run(router.choose_replicas(replicas, pending))]


def test_the_retries_of_one_requests_samples_are_one_suspect_and_stay_together(loop):
    """Replica x died under the 2 samples of request g and under request y: the samples' retries may
    share a replica (one prompt: poison or not for both) and go where the first went, as groups do;
    y's retry still never joins them."""
    router_state.mark_dead("x")
    router_state.group_replicas["g"] = "x"                      # the group's home died
    router_state.groups.update({"g-0-retry1": "g", "g-1-retry1": "g"})
    router_state.suspects.update({"g-0-retry1", "g-1-retry1", "y-retry1"})
    r = _router()
    t, u = _replica("t"), _replica("u", running=1)
    y, g0, g1 = _queue(r, loop, ("y-retry1", "p", 0), ("g-0-retry1", "p", 0), ("g-1-retry1", "p", 0))
    assert _choose(r, [t, u], g0) == ["t", "u"]                 # by load: the group's new home
    r._fulfill_next_pending_request(t, g0.metadata)             # its home: g-0 gets it, not the older y
    assert g0.future.result() is t and router_state.routed["g-0-retry1"] == "t"
    t.routing_stats["num_running"] = 2                          # t is busier than u now
    assert _choose(r, [t, u], g1) == ["t", "u"]                 # its sibling follows it, suspect or not
    assert _choose(r, [t, u], y) == ["u"]                       # another request's suspect: never there
    r._fulfill_next_pending_request(t)
    assert g1.future.result() is t and not y.future.done()


def test_a_replica_ranked_for_a_requests_prefix_serves_that_request(loop):
    """b's routing task ranks the replica holding b's prompt prefix first and finds it free: b gets
    it, not the older a (which then went to the prefix holder, b elsewhere, without its cache)."""
    r = _router()
    holder, other = _replica("holder", running=1), _replica("other")
    r._prefix.record("holder", block_hashes(SYSTEM, 16))
    a, b = _queue(r, loop, ("a", [7] * 40, 0), ("b", SYSTEM + [3] * 20, 0))
    assert _choose(r, [holder, other], b) == ["holder", "other"]
    r._fulfill_next_pending_request(holder, b.metadata)
    assert b.future.result() is holder and not a.future.done() and list(r._pending_requests_to_fulfill) == [a]
    assert _choose(r, [holder, other], a) == ["other", "holder"]   # a: no affinity, plain FIFO
    c, d = _queue(r, loop, ("c", [9] * 40, 0), ("d", [8] * 40, 0))
    r._fulfill_next_pending_request(other, d.metadata)           # d: no affinity recorded, so the oldest
    assert c.future.result() is other and not d.future.done()


def test_a_group_home_serves_its_sample_and_online_work_still_goes_first(loop):
    r = _router()
    home, other = _replica("home", running=3), _replica("other")
    router_state.groups.update({"n-0": "n", "n-1": "n", "row-0": "rows"})
    router_state.group_replicas.update({"n": "home", "rows": "home"})
    a, n1 = _queue(r, loop, ("a", "p", 0), ("n-1", "p", 0))
    assert _choose(r, [home, other], n1)[0] == "home"
    r._fulfill_next_pending_request(home, n1.metadata)
    assert n1.future.result() is home and not a.future.done()
    chat, row = _queue(r, loop, ("chat", "p", 0), ("row-0", "p", 1))  # an offline sample and an online request
    assert _choose(r, [home, other], row)[0] == "home"
    r._fulfill_next_pending_request(home, row.metadata)
    assert chat.future.result() is home and not row.future.done()   # online first, affinity or not



def test_a_row_whose_caller_gave_up_is_not_counted_deferred_after_its_cleanup(loop):
    """Serve's routing task may rank a request once more after its caller cancelled it and cleaned
    up (`request_retry` drops its id from `deferred`): an id added then stayed for good."""
    r = _router()
    full = _replica("full", running=16)
    (row,) = _queue(r, loop, ("row-0", "p", 1))
    row.future.cancel()
    assert _choose(r, [full], row) == [] and "row-0" not in router_state.deferred
    (live,) = _queue(r, loop, ("row-1", "p", 1))
    assert _choose(r, [full], live) == [] and "row-1" in router_state.deferred    # a live one still counts
