"""Prefix-aware routing without a cluster: a prompt prefix stays on the replica that holds it while the
load allows, distinct prefixes spread, and the router's other rules (offline headroom, n samples on one
replica, suspects, dead replicas) still win. Fake replicas, no clock."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from cluster import router_state
from cluster.prefix_affinity import PrefixMemory, prompt_hashes
from cluster.router import LoadAwareRouter, router_config
from eagle_worker.engine_api import block_hashes

SYSTEM = list(range(1000, 1512))            # a 512-token system prompt: 32 blocks of 16


@pytest.fixture(autouse=True)
def _fresh_router_state():
    router_state.clear()
    yield
    router_state.clear()


class _Cache:
    def get(self, k):
        return None


def _router(**kw) -> LoadAwareRouter:
    r = LoadAwareRouter.__new__(LoadAwareRouter)  # the ranking needs none of Serve's plumbing
    r.initialize_state(**kw)
    r._replica_queue_len_cache = _Cache()
    return r


def _replica(rid, running=0, kv=0.0, alive=True, cap=16, blocks=None):
    stats = dict(num_running=running, num_waiting=0, kv_usage=kv, engine_alive=alive)
    if blocks:
        stats["num_total_blocks"] = blocks
    return SimpleNamespace(replica_id=rid, max_ongoing_requests=cap, routing_stats=stats)


def _pending(rid, prompt, priority=0):
    return SimpleNamespace(args=[rid, prompt, {}], kwargs={"priority": priority},
                           metadata=SimpleNamespace(call_method="submit", internal_request_id=rid))


def _choose(router, replicas, pending) -> list[str]:
    return [rank[0].replica_id for rank in asyncio.run(router.choose_replicas(replicas, pending))]


_n = iter(range(10**6))


def _send(router, replicas, prompt, priority=0, done=True) -> str:
    """Route one request the way Serve does (rank, then route to the first); `done`: it also finishes."""
    rid = f"r{next(_n)}"
    p = _pending(rid, prompt, priority)
    first = _choose(router, replicas, p)[0]
    router.on_request_routed(p, first, None)
    if done:
        router.on_request_completed(first, rid)
    return first


def _question(i: int, n: int = 20) -> list[int]:
    return [5000 + 37 * i + j for j in range(n)]


def test_requests_sharing_a_system_prompt_go_to_the_replica_that_holds_it():
    r = _router()
    reps = [_replica("a"), _replica("b"), _replica("c")]
    home = _send(r, reps, SYSTEM + _question(0))
    # each new request stays in flight: the holder gets busier, but within the slack (0.1 = 1.6 of 16 slots)
    assert _send(r, reps, SYSTEM + _question(1), done=False) == home
    assert _send(r, reps, SYSTEM + _question(2)) == home


def test_a_busy_holder_loses_the_prefix_to_an_idle_replica_and_then_both_hold_it():
    r = _router()
    reps = [_replica("a"), _replica("b")]
    home = _send(r, reps, SYSTEM + _question(0))
    other = "b" if home == "a" else "a"
    for i in range(1, 3):                    # 2 in flight = 0.125 over the idle replica's load: past the slack
        assert _send(r, reps, SYSTEM + _question(i), done=False) == home
    assert _send(r, reps, SYSTEM + _question(3), done=False) == other
    # both hold it now: the request goes to the less loaded of the two (2 vs 1 in flight)
    assert _send(r, reps, SYSTEM + _question(4), done=False) == other
    assert _send(r, reps, SYSTEM + _question(5), done=False) in (home, other)


def test_the_longest_match_wins():
    r = _router()
    reps = [_replica("a"), _replica("b")]
    conv = SYSTEM[:64] + _question(0, 200)
    first = _send(r, reps, conv)
    r._prefix.record("b" if first == "a" else "a", block_hashes(SYSTEM[:64], 16))    # only the system part
    turn2 = conv + _question(1, 40)          # a conversation's next turn resends its history
    assert _send(r, reps, turn2) == first


def test_distinct_prefixes_spread_over_idle_replicas():
    r = _router()
    reps = [_replica("a"), _replica("b"), _replica("c")]
    got = [_send(r, reps, _question(100 + i, 64)) for i in range(6)]   # each finishes before the next
    assert sorted(got) == ["a", "a", "b", "b", "c", "c"]               # the replica remembering least first


def test_a_small_match_does_not_count():
    r = _router()
    reps = [_replica("a"), _replica("b", running=1)]
    r._prefix.record("b", block_hashes(SYSTEM, 16)[:1])
    prompt = SYSTEM[:16] + _question(7, 400)                           # 1 of 26 blocks shared: < 10%
    assert _choose(r, reps, _pending("x", prompt))[0] == "a"
    r2 = _router(prefix_match_threshold=0.0)         # any full block counts: b holds one, within the slack
    r2._prefix.record("b", block_hashes(SYSTEM, 16)[:1])
    assert _choose(r2, reps, _pending("z", prompt))[0] == "b"


def test_prefix_awareness_off_keeps_the_least_load_rule():
    r = _router(prefix_aware=False)
    reps = [_replica("a"), _replica("b", running=1)]
    r._prefix.record("b", block_hashes(SYSTEM, 16))
    assert _choose(r, reps, _pending("x", SYSTEM + _question(1)))[0] == "a"
    assert router_config(prefix_aware=False)["request_router_kwargs"] == {"prefix_aware": False}


def test_the_other_rules_still_win():
    r = _router()
    holder = _replica("holder", kv=0.05)
    reps = [holder, _replica("roomy")]
    r._prefix.record("holder", block_hashes(SYSTEM, 16))
    prompt = SYSTEM + _question(1)
    assert _choose(r, reps, _pending("on", prompt))[0] == "holder"
    holder.routing_stats["kv_usage"] = 0.9   # no KV headroom: offline work goes elsewhere ...
    r.prefix_load_slack = 1.0                  # ... even when its load would let the prefix win
    assert _choose(r, reps, _pending("off", prompt, priority=1))[0] == "roomy"
    assert _choose(r, reps, _pending("on2", prompt))[0] == "holder"
    # the n samples of one prompt follow their sibling's replica
    router_state.groups.update({"g-0": "g", "g-1": "g"})
    router_state.group_replicas["g"] = "roomy"
    assert _choose(r, reps, _pending("g-1", prompt))[0] == "roomy"
    # dead or crashed holders are not chosen
    router_state.mark_dead("holder")
    assert _choose(r, reps, _pending("after-death", prompt)) == ["roomy"]
    router_state.clear()
    holder.routing_stats["engine_alive"] = False
    assert _choose(r, reps, _pending("crashed", prompt)) == ["roomy"]


def test_a_suspect_never_joins_another_suspect_even_on_its_prefix_holder():
    r = _router()
    reps = [_replica("holder"), _replica("other")]
    r._prefix.record("holder", block_hashes(SYSTEM, 16))
    router_state.suspects.update({"s1-retry1", "s2-retry1"})
    router_state.routed["s1-retry1"] = "holder"
    assert _choose(r, reps, _pending("s2-retry1", SYSTEM + _question(1))) == ["other"]


def test_memory_is_bounded_by_the_replica_kv_cache_and_keeps_prefixes_longest():
    r = _router(prefix_memory_blocks=1000)
    reps = [_replica("a", blocks=40), _replica("b", blocks=40)]
    home = _send(r, reps, SYSTEM + _question(0))                      # 33 full blocks remembered
    assert r._prefix.size(home) == 33
    _send(r, [rep for rep in reps if rep.replica_id == home], _question(9, 16 * 20))   # 20 more: 13 go
    assert r._prefix.size(home) == 40
    assert r._prefix.match(home, block_hashes(SYSTEM, 16)) == 20      # the oldest prompt's tail went first
    m = PrefixMemory(3)
    m.record("x", [1, 2, 3, 4])
    assert m.match("x", [1, 2, 3, 4]) == 3 and m.size("x") == 3


def test_a_dead_replica_is_forgotten_and_memories_follow_the_replica_set(monkeypatch):
    from tests.cluster.test_router import serve_sets_replicas

    serve_sets_replicas(monkeypatch)
    r = _router()
    r._replicas, r._replica_id_set, r._queue_len_gauge_last_update = {}, set(), {}   # Serve's own sets
    reps = [_replica("a"), _replica("b")]
    for rep in reps:
        r._prefix.record(rep.replica_id, block_hashes(SYSTEM, 16))
    r.on_replica_actor_died("a")
    assert r._prefix.replicas() == ["b"]
    r.update_replicas([_replica("c")])           # Serve replaced b by c: b's memory goes
    assert r._prefix.replicas() == []


def test_prompts_are_hashed_once_per_request_as_token_ids_or_text():
    assert prompt_hashes(SYSTEM, 16, 512) == block_hashes(SYSTEM, 16)
    assert len(prompt_hashes(SYSTEM, 16, 4)) == 4                      # at most max_blocks
    assert len(prompt_hashes("x" * 200, 16, 512)) == 3                 # text: 64 characters a block
    assert prompt_hashes(None, 16, 8) == [] and prompt_hashes([], 16, 8) == []
    r = _router()
    p = _pending("once", SYSTEM)
    asyncio.run(r.choose_replicas([_replica("a")], p))
    assert r._hashes["once"] == block_hashes(SYSTEM, 16)
    r.on_request_routed(p, "a", None)
    assert "once" not in r._hashes and r._prefix.size("a") == 32
    stats_call = SimpleNamespace(args=[], kwargs={})                  # not a submit: no prefix, no error
    assert _choose(r, [_replica("a")], stats_call) == ["a"]
