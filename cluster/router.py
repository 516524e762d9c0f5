"""Routing requests across engine replicas: a Ray Serve custom request router plus retry on death.

Why Serve's request router and not a router actor: a router actor would sit on every token's path
(one more hop, one more process to keep alive, a single point of failure) and would have to
re-implement what Serve already does well: replica discovery, health checks and replacement,
autoscaling on ongoing requests, per-replica concurrency caps (`max_ongoing_requests`) and a
bounded caller-side queue (`max_queued_requests` -> `BackPressureError` -> HTTP 503). Serve's
`RequestRouter` extension point lets us keep all of that and replace only the *choice*: each
replica publishes its engine stats through `record_routing_stats` (cluster/replica.py) and
`LoadAwareRouter` ranks replicas with them. It runs inside every caller (our FastAPI ingress), so
routing adds no hop and scales with the ingress.

Load of a replica = max(requests this caller has in flight there, running + waiting from its
last stats) / its capacity, plus its KV-cache usage. The local count reacts instantly (so a
burst does not pile onto the replica that looked idle a second ago); the stats add what other
callers sent and how full the KV cache is. Offline work (priority >= 1) prefers replicas with
KV headroom and no backlog, so batch traffic fills idle capacity instead of queueing in front of
online users, and it may only fill a replica's engine batch (`max_num_seqs` ongoing requests, from
its stats), never the queue slots beyond it: those stay free for online requests, which therefore
wait for one engine slot at most; an offline row finding every batch full waits in its caller's
router (`offline_deferred`). When every replica is full, a freed slot goes to the oldest waiting
online request before any offline one; inside a replica the engine schedules by priority too
(0 = online first) and preempts the least urgent sequence for a more urgent one.

Replica death and poison requests are `stream_outputs`'s (cluster/request_retry.py); the router
records where each attempt went (`on_request_routed`) and skips a replica a request saw die until
Serve replaces it. Retries of requests a replica died under ("suspects") run one request per replica
(`choose_replicas` and `_fulfill_next_pending_request` keep another request's suspect off a replica
that has one; the n samples of one request are one suspect and stay together): were one of them the
poison, the other would otherwise follow it onto the only replica left and die a second time.
That bookkeeping lives in cluster/router_state.py, which the router and `stream_outputs` share:
Serve pickles this module's router class by value, with copies of its globals.
Admission (how many requests the ingress lets in) is cluster/admission.py.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, defaultdict, deque
from typing import Any, List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cluster import router_state as state
from cluster.prefix_affinity import PrefixMemory, prefer_prefix, prompt_hashes

WAIT_S = 0.1   # how often a request with no replica it may use looks again
PROMISE_TTL_S = 10.0   # an offline request ranked but never routed stops counting against a replica
INFLIGHT_TTL_S = 3600.0   # an engine request counted this long without ending stops counting (see _sent)


class LoadAwareRouter(FIFOMixin, RequestRouter):
    """Ranks replicas by engine load (see the module docstring); Serve enforces capacity."""

    def initialize_state(self, offline_kv_threshold: float = 0.8, kv_weight: float = 1.0, prefix_aware: bool = True,
                         prefix_block_size: int = 16, prefix_max_blocks: int = 512, prefix_memory_blocks: int = 16384,
                         prefix_match_threshold: float = 0.1, prefix_load_slack: float = 0.1, **kwargs):
        """The `prefix_*` knobs: see cluster/prefix_affinity.py (block size of the hashes, blocks hashed
        per prompt at most, blocks remembered per replica at most, the share of a prompt's blocks a
        match must cover, and how much busier than the least-loaded replica a prefix's holder may be)."""
        self.offline_kv_threshold = offline_kv_threshold
        self.kv_weight = kv_weight
        # engine requests (`submit`) sent: call id -> wall times routed. Counted per id, not one per id:
        # Serve gives every call made while it serves one HTTP request that request's id, so the n
        # samples of a request (and a retry on the same replica) are calls under one id
        self._inflight: dict[ReplicaID, dict[str, list[float]]] = defaultdict(dict)
        self._control_ids: Counter[str] = Counter()   # other calls in flight (stats, engine_info): no engine slot
        # (replica, call id) -> calls that ended there unrouted, oldest first: see on_request_completed
        self._ended_unrouted: dict[tuple[ReplicaID, str], int] = {}
        self._promised: dict[str, tuple[Any, float]] = {}   # offline request id -> (replica given, when)
        # engine requests that ended, as (wall time routed, wall time ended): see `ongoing`
        self._completed: dict[ReplicaID, deque] = defaultdict(lambda: deque(maxlen=256))
        self.prefix_aware = prefix_aware
        self.prefix_block_size, self.prefix_max_blocks = max(1, prefix_block_size), max(1, prefix_max_blocks)
        self.prefix_match_threshold, self.prefix_load_slack = prefix_match_threshold, prefix_load_slack
        self._prefix = PrefixMemory(prefix_memory_blocks)
        self._prefix_capacity: dict[str, int] = {}    # replica key -> KV blocks it reported (bounds its memory)
        self._hashes: dict[str, list[int]] = {}       # request id -> its prompt's hashes, until it is routed
        self._affinity: dict[str, str] = {}           # request id -> replica its prefix or group chose, until routed
        state.routers.add(self)  # live_replica_stats reads the replica set

    def ongoing(self, replica: RunningReplica, fresh: bool = False) -> int:
        """Requests on the replica: what this caller sent there, or what its stats or Serve's
        queue-length cache say, the most. `fresh` (the engine-batch count offline rows are admitted
        by): the stats less what finished here since they were taken (they are up to a second old),
        so a freed batch slot is refilled at once, and not Serve's cache, which counts every call
        (a caller polling `stats` kept it one above the engine's requests, and a job's rows then ran
        one at a time). Only requests routed before the stats were taken are subtracted: the stats
        never counted later ones, and short rows sent and ended meanwhile would otherwise drive the
        count below what the engine runs (times are wall clock: the stats' from the replica's host)."""
        stats = replica.routing_stats or {}
        queued = int(stats.get("num_running", 0)) + int(stats.get("num_waiting", 0))
        done = self._completed.get(replica.replica_id)
        if fresh and done and queued and stats.get("updated_at"):
            taken = float(stats["updated_at"])
            queued -= sum(1 for routed, ended in done if routed <= taken < ended)
        cached = 0 if fresh else self.replica_queue_len_cache.get(replica.replica_id) or 0
        return max(self._sent(replica.replica_id), queued, cached)

    def _sent(self, replica_id: ReplicaID) -> int:
        """Engine requests this caller has in flight on the replica. Entries older than INFLIGHT_TTL_S
        go (a backstop: a count that leaked kept offline rows off the replica for good; one that
        really runs that long is still in the replica's stats)."""
        calls = self._inflight.get(replica_id)
        if not calls:
            return 0
        old = time.time() - INFLIGHT_TTL_S
        for cid in [c for c, times in calls.items() if times[0] < old]:
            calls[cid] = [t for t in calls[cid] if t >= old]
            if not calls[cid]:
                del calls[cid]
        if not calls:
            self._inflight.pop(replica_id, None)
        return sum(len(times) for times in calls.values())

    def load(self, replica: RunningReplica) -> float:
        """Lower is better: fraction of capacity in use plus weighted KV usage."""
        stats = replica.routing_stats or {}
        capacity = max(1, replica.max_ongoing_requests)
        return self.ongoing(replica) / capacity + self.kv_weight * float(stats.get("kv_usage", 0.0))

    def offline_room(self, replica: RunningReplica, rid: str | None = None) -> bool:
        """Offline work may fill the engine's batch (`max_num_seqs`), never the queue slots beyond it:
        those stay free for online requests, which then wait for one engine slot at most. Offline
        requests given a replica but not yet routed there count too (`_promised`): Serve hands out
        a burst of slots before any is recorded as routed."""
        slots = int((replica.routing_stats or {}).get("max_num_seqs") or replica.max_ongoing_requests)
        now = time.monotonic()
        for other, (_, t) in list(self._promised.items()):
            if t < now - PROMISE_TTL_S:     # cancelled before it was routed
                self._promised.pop(other, None)
        promised = sum(1 for other, (r, _) in list(self._promised.items())
                       if other != rid and r == replica.replica_id)
        return self.ongoing(replica, fresh=True) + promised < max(1, slots)

    def has_headroom(self, replica: RunningReplica) -> bool:
        stats = replica.routing_stats or {}
        return float(stats.get("kv_usage", 0.0)) < self.offline_kv_threshold and not stats.get("num_waiting", 0)

    async def choose_replicas(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> List[List[RunningReplica]]:
        """Replicas in preference order, one per rank; Serve skips the ones that are full."""
        candidates = [r for r in candidate_replicas if not state.seen_dead(r.replica_id)]
        rid = state.request_id(pending_request)
        if state.is_suspect(pending_request):  # one suspect per replica (see _fulfill_next_pending_request)
            hosts = state.suspect_hosts(rid)
            candidates = [r for r in candidates if state.replica_key(r.replica_id) not in hosts]
        if candidate_replicas and not candidates:
            # every replica died under some request (or hosts a suspect): wait for Serve to replace
            # it. Serve calls again at once for an empty answer (no backoff): pace it here.
            await asyncio.sleep(WAIT_S)
            return []
        alive = [r for r in candidates if (r.routing_stats or {}).get("engine_alive", True)]
        replicas = alive or candidates  # a crashed engine waits for Serve to replace it
        random.shuffle(replicas)  # break ties randomly so equal replicas share the load
        ranked, holder = sorted(replicas, key=self.load), None
        if self.prefix_aware:
            ranked, holder = self._prefer_prefix(ranked, pending_request)
        home = state.group_replica(rid, ranked[0].replica_id if ranked else None)
        ranked.sort(key=lambda r: state.replica_key(r.replica_id) != home)   # stable: the rest keep their order
        affinity = home if home is not None else holder and state.replica_key(holder.replica_id)
        if rid is not None and affinity:   # that replica serves this request (_fulfill_next_pending_request)
            self._affinity.pop(rid, None)
            while len(self._affinity) >= 4096:   # requests cancelled before routing: oldest go first
                self._affinity.pop(next(iter(self._affinity)))
            self._affinity[rid] = affinity
        if request_priority(pending_request) > 0:
            roomy = [r for r in ranked if self.offline_room(r, rid)]
            if ranked and not roomy:   # every engine batch is full: the row waits here, online goes first
                if not (pending_request is not None and pending_request.future.done()):   # not after its
                    state.note_deferred(rid)        # caller cleaned up (it would stay for good)
                if self._online_waiting():   # this routing task finds a slot, which goes to online work
                    return [[r] for r in ranked]
                await asyncio.sleep(WAIT_S)
                return []
            ranked = [r for r in roomy if self.has_headroom(r)] + [r for r in roomy if not self.has_headroom(r)]
        return [[r] for r in ranked]

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._forget_gone()

    def _forget_gone(self) -> None:
        """Drop what is kept per replica for replicas Serve no longer has (scaled down, replaced after
        a failed health check: `on_replica_actor_died` sees only deaths this caller saw); run when Serve
        updates the replica set."""
        live = getattr(self, "curr_replicas", None)
        if live is None:
            return
        for rid in [k for k in self._completed if k not in live]:
            del self._completed[rid]
        keys = {state.replica_key(k) for k in live}
        for key in [k for k in self._prefix_capacity if k not in keys]:
            del self._prefix_capacity[key]
        self._prefix.keep_only(keys)

    def _online_waiting(self) -> bool:
        return any(request_priority(pr) == 0 and not pr.future.done()
                   for pr in list(getattr(self, "_pending_requests_to_fulfill", ())))

    def _prefer_prefix(self, ranked: list, pending_request: Optional[PendingRequest]) -> tuple[list, Any]:
        """`ranked` with the replica holding the request's prompt prefix first, when its load allows
        (cluster/prefix_affinity.py has the rule), and that replica (None: the load order stands)."""
        for r in ranked:
            total = int((r.routing_stats or {}).get("num_total_blocks") or 0)
            if total:
                self._prefix_capacity[state.replica_key(r.replica_id)] = total
        hashes = self._prompt_hashes(pending_request)
        return prefer_prefix(ranked, hashes, self._prefix, self.load, lambda r: state.replica_key(r.replica_id),
                             self.prefix_load_slack, self.prefix_match_threshold)

    def _prompt_hashes(self, pending_request: Optional[PendingRequest], keep: bool = True) -> list[int]:
        """Block hashes of a `submit(request_id, prompt, ...)` call's prompt, computed once per request."""
        rid = state.request_id(pending_request)
        if rid is None:
            return []
        hashes = self._hashes.get(rid)
        if hashes is None:
            args = pending_request.args
            hashes = prompt_hashes(args[1] if len(args) > 1 else None, self.prefix_block_size, self.prefix_max_blocks)
            if keep:
                # requests cancelled before routing: oldest go first (up to prefix_max_blocks ints
                # each; one dropped is computed again if asked)
                while len(self._hashes) >= 1024:
                    self._hashes.pop(next(iter(self._hashes)))
                self._hashes[rid] = hashes
        return hashes

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata: Any = None) -> None:
        """A free replica slot goes to the request whose routing task ranked it first for its prefix or
        group (`request_metadata` names that request, as Serve's own RequestRouter matches it;
        FIFOMixin gave it to the oldest, so the holder served an unrelated request and the prefix's
        request went elsewhere), an offline one only while no online request waits. Otherwise to
        the oldest waiting online request, else the oldest offline one whose batch has room
        (`offline_room`): FIFOMixin's strict arrival order would let queued batch work delay
        interactive users. Same bookkeeping as FIFOMixin, whose private queue this reorders.

        A suspect (a retry of a request a replica died under) never joins another request's suspect
        on a replica: were one of them a poison request, the other would die with it a second time.
        """
        queue = self._pending_requests_to_fulfill
        replica_id = getattr(replica, "replica_id", replica)
        key = state.replica_key(replica_id)
        pick = self._affinity_request(request_metadata, key)
        if pick is not None and (not self._may_take(pick, replica, key)
                                 or request_priority(pick) > 0 and self._online_waiting()):
            pick = None
        for pr in () if pick is not None else queue:
            if pr.future.done() or not self._may_take(pr, replica, key):
                continue
            if request_priority(pr) == 0:
                if pick is not None:     # an older offline request waits: the online one goes first
                    state.counters["online_ahead_of_offline"] += 1
                    state.note_deferred(state.request_id(pick))
                pick = pr
                break
            pick = pick or pr
        if pick is None:
            if all(pr.future.done() for pr in queue):
                queue.clear()  # only finished/cancelled entries were left
            return
        if pick in queue:
            queue.remove(pick)
        if request_priority(pick) > 0 and state.request_id(pick) is not None:   # counts until on_request_routed
            self._promised[state.request_id(pick)] = (replica_id, time.monotonic())
        if state.is_suspect(pick):  # claim the replica now; on_request_routed confirms it
            state.routed[state.request_id(pick)] = replica_id
        self._cancel_routing_task_for_pending_request(pick)
        self._record_queue_wait_time(pick)
        pick.future.set_result(replica)
        self._remove_pending_request_from_indices(pick)

    def _affinity_request(self, request_metadata: Any, key: str) -> Optional[PendingRequest]:
        """The waiting request whose routing task chose this replica (`request_metadata`), if its
        prefix or group chose it (Serve's own index of pending requests by id)."""
        if request_metadata is None:
            return None
        pr = self._get_pending_request_matching_internal_request_id(request_metadata)   # (None once done)
        rid = state.request_id(pr)
        return pr if rid is not None and self._affinity.get(rid) == key else None

    def _may_take(self, pr: PendingRequest, replica: RunningReplica, key: str) -> bool:
        """The suspect rule, and offline work only into a batch with room (else counted deferred)."""
        rid = state.request_id(pr)
        if state.is_suspect(pr) and key in state.suspect_hosts(rid):
            return False
        if request_priority(pr) > 0 and hasattr(replica, "routing_stats") and not self.offline_room(replica, rid):
            state.note_deferred(rid)    # that replica's batch is full: online only
            return False
        return True

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        metadata = pending_request.metadata
        call_id = metadata.internal_request_id
        ended = self._ended_unrouted.pop((replica_id, call_id), 0)     # a call under this id ended there first
        if ended > 1:
            self._ended_unrouted[(replica_id, call_id)] = ended - 1
        if metadata.call_method != "submit":   # no engine request: not counted
            if not ended:
                self._control_ids[call_id] += 1
            return
        now = time.time()
        if ended:
            self._completed[replica_id].append((now, now))
        else:
            self._inflight[replica_id].setdefault(call_id, []).append(now)
        rid = state.request_id(pending_request)
        self._promised.pop(rid, None)
        self._affinity.pop(rid, None)
        if self.prefix_aware and rid is not None:    # that replica computes (and caches) this prompt now
            key = state.replica_key(replica_id)
            hashes = self._hashes.pop(rid, None)
            if hashes is None:
                hashes = self._prompt_hashes(pending_request, keep=False)
            self._prefix.record(key, hashes, self._prefix_capacity.get(key))
        if rid is not None:  # `submit(request_id, ...)`: stream_outputs asks where it went
            state.routed[rid] = replica_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Serve calls this for every call it sent, also for ones the replica rejected (never routed)
        and, racing, for ones that ended before `on_request_routed` ran (its done-callback is queued
        from another thread). Counted by id, so neither leaks a slot (a leaked one kept offline rows
        off the replica for good); an id not seen yet is remembered, with the replica, for
        `on_request_routed`: Serve routes a rejected call again under the same id, and the rejection
        must not make it look ended on the replica that then runs it. Several calls may share an id
        (the n samples of one HTTP request): each completion ends one of them."""
        calls = self._inflight.get(replica_id)
        if calls is not None and internal_request_id in calls:
            times = calls[internal_request_id]
            routed = times.pop(0)
            if not times:
                del calls[internal_request_id]
            if not calls:
                self._inflight.pop(replica_id, None)
            self._completed[replica_id].append((routed, time.time()))
            return
        if self._control_ids[internal_request_id] > 0:
            self._control_ids[internal_request_id] -= 1
            if not self._control_ids[internal_request_id]:
                del self._control_ids[internal_request_id]
            return
        key = (replica_id, internal_request_id)
        self._ended_unrouted[key] = self._ended_unrouted.pop(key, 0) + 1
        while len(self._ended_unrouted) > 4096:     # rejected calls are never routed: oldest go first
            self._ended_unrouted.pop(next(iter(self._ended_unrouted)))

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self._inflight.pop(replica_id, None)
        self._completed.pop(replica_id, None)
        self._prefix.forget(state.replica_key(replica_id))


def request_priority(pending_request: Optional[PendingRequest]) -> int:
    if pending_request is None:
        return 0
    try:
        return int(pending_request.kwargs.get("priority", 0))
    except (TypeError, ValueError, AttributeError):
        return 0


def router_config(stats_period_s: float = 1.0, prefix_aware: bool = True) -> dict[str, Any]:
    """`request_router_config` for the engine deployment (`prefix_aware`: with the engine's prefix caching)."""
    return {
        "request_router_class": "cluster.router.LoadAwareRouter",
        "request_router_kwargs": {"prefix_aware": prefix_aware},
        "request_routing_stats_period_s": stats_period_s,
        "request_routing_stats_timeout_s": max(2.0, 2 * stats_period_s),
    }
