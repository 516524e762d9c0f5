"""Prometheus metrics of the HTTP front: what users feel (TTFT, TPOT, throughput) and why (tau, queues, KV).

Kept in the ingress because that is where a request's whole life is visible.

`eagle_requests_total{endpoint,status}` counts every HTTP request by its final status, counted by an
ASGI middleware (`StatusCounter`, outermost) so requests refused before any handler logic (401, 400,
404, 405, 413, bad JSON) count too. A client that disconnects before its response is complete is
`499` (nginx's and vLLM's "client closed request"), not 500; a stream that already sent 200 and then
ends with an error event counts as that error's status (`note_status`).

Per-replica gauges (queue depth, KV usage, ...) are rebuilt on every scrape from the routing stats
of every replica the ingress's router currently knows (`cluster.router_state.live_replica_stats`, about
one second old): a replica that died or was scaled away is gone from the next scrape. So are its
prefix-cache counters (`PREFIX_CACHE_COUNTERS`): the engine's own cumulative totals, exported per
replica as Prometheus counters (a replaced replica is a new series starting at 0, which `rate()`
handles), with each replica's cached blocks and its hit rates since it started as gauges; the hit
rate over a window is `rate(eagle_prefix_cache_hit_tokens_total[5m]) / rate(eagle_prefix_cache_queried_tokens_total[5m])`.
"""
from __future__ import annotations

import asyncio
import contextvars
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from ray.exceptions import RayActorError, TaskCancelledError
from starlette.requests import ClientDisconnect

from cluster.death_cause import loss_reason

disable_created_metrics()  # the *_created series only add noise to every scrape

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)
TAU_BUCKETS = (1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 8)


# engine stats key -> (counter name without _total, help): vLLM's prefix_cache_queries / _hits, in tokens and requests
PREFIX_CACHE_COUNTERS = {
    "prefix_cache_queried_tokens": ("eagle_prefix_cache_queried_tokens", "prompt tokens looked up in the prefix cache"),
    "prefix_cache_hit_tokens": ("eagle_prefix_cache_hit_tokens", "prompt tokens found in the prefix cache (not computed)"),
    "prefix_cache_queried_requests": ("eagle_prefix_cache_queried_requests", "requests looked up in the prefix cache"),
    "prefix_cache_hit_requests": ("eagle_prefix_cache_hit_requests", "requests with at least one cached prompt block"),
    "prefix_cache_evictions": ("eagle_prefix_cache_evictions", "cached blocks evicted to make room"),
    "prefix_cache_blocks_without_head_kv": ("eagle_prefix_cache_blocks_without_head_kv",
                                            "lookups that stopped at a cached block without the EAGLE head's KV"),
}


class _PrefixCacheCollector:
    """Per-replica prefix-cache series, built at each scrape from the replicas' latest stats."""

    def __init__(self, metrics: "ServeMetrics"):
        self.metrics = metrics

    def collect(self):
        model, replicas = self.metrics.model, self.metrics.replica_stats
        labels = ["model", "replica"]
        for key, (name, doc) in PREFIX_CACHE_COUNTERS.items():
            fam = CounterMetricFamily(name, doc, labels=labels)
            for rid, st in replicas.items():
                if key in st:
                    fam.add_metric([model, rid], float(st[key] or 0))
            yield fam
        blocks = GaugeMetricFamily("eagle_replica_prefix_cache_blocks",
                                   "KV blocks holding a cached prefix (evictable ones included)", labels=labels)
        tok_rate = GaugeMetricFamily("eagle_replica_prefix_cache_token_hit_rate",
                                     "prompt tokens found in the prefix cache / looked up, since the replica started",
                                     labels=labels)
        req_rate = GaugeMetricFamily("eagle_replica_prefix_cache_request_hit_rate",
                                     "requests with a prefix-cache hit / looked up, since the replica started",
                                     labels=labels)
        for rid, st in replicas.items():
            if "prefix_cache_blocks" in st:
                blocks.add_metric([model, rid], float(st["prefix_cache_blocks"] or 0))
            for fam, what in ((tok_rate, "tokens"), (req_rate, "requests")):
                queried = st.get(f"prefix_cache_queried_{what}")
                if queried is not None:
                    fam.add_metric([model, rid], float(st.get(f"prefix_cache_hit_{what}") or 0) / max(1.0, float(queried)))
        yield from (blocks, tok_rate, req_rate)


# replica stats key -> (counter name without _total, help): online vs offline work (cluster/priority_stats.py)
PRIORITY_COUNTERS = {
    "online_finished": ("eagle_replica_online_finished", "online requests (priority 0) finished by the replica"),
    "offline_finished": ("eagle_replica_offline_finished", "offline requests (priority >= 1) finished by the replica"),
    "offline_preemptions": ("eagle_replica_offline_preemptions", "times the engine preempted an offline request "
                            "(recomputed later) for more urgent work"),
    "offline_rows_preempted": ("eagle_replica_offline_rows_preempted", "offline requests preempted at least once"),
    "online_preemptions": ("eagle_replica_online_preemptions", "times the engine preempted an online request"),
    "offline_deferred_in_engine": ("eagle_replica_offline_deferred", "offline requests still waiting for their first "
                                   "token in the engine when a younger online request got its first"),
    "num_offline_held": ("eagle_replica_offline_held", "offline requests the engine left out of a step, or whose "
                         "prompt chunk it cut, to keep online steps within offline_slowdown"),
}
# router counter -> (counter name without _total, help): this ingress's router (cluster/router_state.py)
ROUTER_COUNTERS = {
    "offline_deferred": ("eagle_router_offline_deferred", "offline requests the router held back for online work "
                         "(every engine batch full, or a freed slot given to online first)"),
    "online_ahead_of_offline": ("eagle_router_online_ahead_of_offline", "freed replica slots given to an online "
                                "request while an older offline one waited"),
}


class _PriorityCollector:
    """Per-replica online/offline counters and torch threads, and this ingress's router counters."""

    def __init__(self, metrics: "ServeMetrics"):
        self.metrics = metrics

    def collect(self):
        from cluster.router_state import router_counters

        model, replicas = self.metrics.model, self.metrics.replica_stats
        labels = ["model", "replica"]
        for key, (name, doc) in PRIORITY_COUNTERS.items():
            fam = CounterMetricFamily(name, doc, labels=labels)
            for rid, st in replicas.items():
                if key in st:
                    fam.add_metric([model, rid], float(st[key] or 0))
            yield fam
        engine = CounterMetricFamily("eagle_replica_engine_preemptions", "sequences the engine preempted "
                                     "(recompute) for more urgent work or KV memory, by the preempted one's priority",
                                     labels=labels + ["priority"])
        for rid, st in replicas.items():
            for prio, n in (st.get("num_preemptions_by_priority") or {}).items():
                engine.add_metric([model, rid, str(prio)], float(n or 0))
        yield engine
        threads = GaugeMetricFamily("eagle_replica_torch_threads", "torch threads of the replica's engine on CPU",
                                    labels=labels)
        for rid, st in replicas.items():
            if st.get("torch_threads"):
                threads.add_metric([model, rid], float(st["torch_threads"]))
        yield threads
        counts = router_counters()
        for key, (name, doc) in ROUTER_COUNTERS.items():
            fam = CounterMetricFamily(name, doc, labels=["model"])
            fam.add_metric([model], float(counts.get(key, 0)))
            yield fam


CLIENT_CLOSED = 499   # nginx's "client closed request", as vLLM's metrics report aborted requests
GONE_REPLICA_SERIES_S = 600.0   # a replica not live for this long: its eagle_replica_requests_total series goes


class ServeMetrics:
    def __init__(self, model: str, window_s: float = 10.0):
        self.registry = r = CollectorRegistry()
        self.model, self.window_s = model, window_s
        lb = ["model"]
        self.requests = Counter("eagle_requests", "HTTP requests by endpoint and status", lb + ["endpoint", "status"], registry=r)
        self.inflight = Gauge("eagle_requests_in_flight", "requests being served by this ingress", lb, registry=r)
        self.e2e = Histogram("eagle_e2e_latency_seconds", "request latency", lb, buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("eagle_ttft_seconds", "time to first token", lb, buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("eagle_tpot_seconds", "time per output token after the first", lb, buckets=TPOT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("eagle_prompt_tokens", "prompt tokens processed", lb, registry=r)
        self.gen_tokens = Counter("eagle_generation_tokens", "tokens generated", lb, registry=r)
        self.cached_tokens = Counter("eagle_prompt_cached_tokens", "prompt tokens whose KV was shared, not computed "
                                     "(vLLM's num_cached_tokens)", lb, registry=r)
        self.target_forwards = Counter("eagle_target_forwards", "target-model forwards (tau = tokens / forwards)",
                                       lb, registry=r)
        self.tau = Histogram("eagle_mean_accepted_tokens", "per-request mean tokens per target forward (tau)",
                             lb, buckets=TAU_BUCKETS, registry=r)
        self.tokens_per_s = Gauge("eagle_generation_tokens_per_second",
                                  f"generation throughput over the last {window_s:.0f}s", lb, registry=r)
        rl = lb + ["replica"]
        self.running = Gauge("eagle_replica_num_running", "sequences running in a replica", rl, registry=r)
        self.waiting = Gauge("eagle_replica_queue_depth", "requests waiting in a replica", rl, registry=r)
        self.kv_usage = Gauge("eagle_replica_kv_usage", "fraction of KV-cache blocks in use", rl, registry=r)
        self.free_blocks = Gauge("eagle_replica_free_kv_blocks", "free KV-cache blocks", rl, registry=r)
        self.retries = Counter("eagle_request_retries", "requests re-run on another replica after theirs failed",
                               lb + ["reason"], registry=r)
        self.replica_requests = Counter("eagle_replica_requests", "finished requests by the replica that served them",
                                        rl, registry=r)
        self._recent: deque[tuple[float, int]] = deque()
        self._replica_seen: dict[str, float] = {}   # replica id -> when last live: its requests_total series
        self.replica_stats: dict[str, dict] = {}    # the replicas' latest stats (prefix-cache series)
        r.register(_PrefixCacheCollector(self))
        r.register(_PriorityCollector(self))

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests.labels(self.model, endpoint, str(status)).inc()

    def retried(self, error: BaseException) -> None:
        """reason: `preempted` or `node_lost` for a replica lost with its node, else the error's type."""
        self.retries.labels(self.model, loss_reason(error)).inc()

    def first_token(self, ttft_s: float) -> None:
        self.ttft.labels(self.model).observe(ttft_s)

    def tokens(self, n: int) -> None:
        if n:
            now = time.monotonic()
            self._recent.append((now, n))
            self._forget_before(now - self.window_s)   # here too: a server nobody scrapes keeps a window only

    def _forget_before(self, t: float) -> None:
        while self._recent and self._recent[0][0] < t:
            self._recent.popleft()

    def finished(self, out, e2e_s: float, ttft_s: float | None) -> None:
        """Record a finished request from its final engine output."""
        m, n_out = out.metrics or {}, len(out.token_ids)
        self.e2e.labels(self.model).observe(e2e_s)
        self.prompt_tokens.labels(self.model).inc(len(out.prompt_token_ids))
        self.gen_tokens.labels(self.model).inc(n_out)
        self.cached_tokens.labels(self.model).inc(int(m.get("num_cached_tokens") or 0))
        if ttft_s is not None and n_out > 1:
            self.tpot.labels(self.model).observe((e2e_s - ttft_s) / (n_out - 1))
        if m.get("num_target_forwards"):
            self.target_forwards.labels(self.model).inc(m["num_target_forwards"])
        if m.get("mean_accepted_tokens"):
            self.tau.labels(self.model).observe(float(m["mean_accepted_tokens"]))
        if m.get("replica_id"):
            self.replica_requests.labels(self.model, str(m["replica_id"])).inc()
            self._replica_seen.setdefault(str(m["replica_id"]), time.monotonic())

    def replica_gauges(self, replicas: dict[str, dict]) -> None:
        """Per-replica gauges for exactly these replicas (id -> stats); others' series are removed."""
        for g in (self.running, self.waiting, self.kv_usage, self.free_blocks):
            g.clear()
        self.replica_stats = dict(replicas)
        now = time.monotonic()
        for rid in replicas:
            self._replica_seen[rid] = now
        for rid, seen in list(self._replica_seen.items()):   # an autoscaled fleet's replicas come and go
            if now - seen > GONE_REPLICA_SERIES_S:
                del self._replica_seen[rid]
                try:
                    self.replica_requests.remove(self.model, rid)
                except KeyError:
                    pass
        for rid, st in replicas.items():
            self.running.labels(self.model, rid).set(st.get("num_running", 0))
            self.waiting.labels(self.model, rid).set(st.get("num_waiting", 0))
            self.kv_usage.labels(self.model, rid).set(st.get("kv_usage", 0.0))
            self.free_blocks.labels(self.model, rid).set(st.get("num_free_blocks", 0))

    def render(self, replicas: dict[str, dict] | None = None) -> bytes:
        """The exposition text; `replicas` (id -> stats of every live replica) replaces the per-replica
        gauges, None keeps them."""
        self._forget_before(time.monotonic() - self.window_s)
        self.tokens_per_s.labels(self.model).set(sum(n for _, n in self._recent) / self.window_s)
        if replicas is not None:
            self.replica_gauges(replicas)
        return generate_latest(self.registry)


# ---- counting every HTTP request by final status ------------------------------------------------
_active: ServeMetrics | None = None           # this process's ingress metrics (one ingress per process)
_final: contextvars.ContextVar[dict | None] = contextvars.ContextVar("eagle_final_status", default=None)
ENDPOINTS = (("/v1/chat/completions", "chat"), ("/v1/completions", "completions"), ("/v1/models", "models"),
             ("/health", "health"), ("/metrics", "metrics"))
RETRY_AFTER_S = 1


def set_active(metrics: ServeMetrics) -> None:
    """The ServeMetrics `StatusCounter` counts into (the ingress sets it when it starts)."""
    global _active
    _active = metrics


def note_status(status: int) -> None:
    """The request's final status differs from the one sent in its headers (a stream that ended
    with an error event after `200`): count it as `status`."""
    holder = _final.get()
    if holder is not None:
        holder["status"] = int(status)


def endpoint_label(path: str) -> str:
    path = path.rstrip("/")
    for suffix, label in ENDPOINTS:
        if path.endswith(suffix):
            return label
    return "other"   # unknown routes: one label, whatever the path (bounded cardinality)


class StatusCounter:
    """ASGI middleware (keep it the outermost one): counts each HTTP request in
    `eagle_requests_total` by its final status, adds `Retry-After` to 429/503 answers, and hands the
    app a client's disconnect as ASGI's `http.disconnect` (Serve's `receive` raises
    TaskCancelledError instead, which Serve then logs as a failed request with a traceback; where
    Serve's proxy died, `receive` and `send` raise its ActorDiedError: a disconnect too, 499)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"status": None, "complete": False}
        holder: dict = {}
        token = _final.set(holder)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                if message["status"] in (429, 503):
                    headers = list(message.get("headers") or [])
                    if not any(k.lower() == b"retry-after" for k, _ in headers):
                        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
                    message = {**message, "headers": headers}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["complete"] = True
            try:
                await send(message)
            except RayActorError:        # Serve's proxy died: nobody is left to answer
                raise ClientDisconnect() from None

        async def receive_or_disconnect():
            try:
                return await receive()
            except (TaskCancelledError, RayActorError):     # the client, or the proxy holding it, is gone
                return {"type": "http.disconnect"}

        status = None
        try:
            await self.app(scope, receive_or_disconnect, counting_send)
            status = holder.get("status") or state["status"] or 500
            if state["status"] is not None and not state["complete"]:
                status = CLIENT_CLOSED       # the body was cut off: the client went away
        except (asyncio.CancelledError, TaskCancelledError, ClientDisconnect):
            status = CLIENT_CLOSED           # Serve cancels the request (or its `receive`) when the client goes
            raise
        except OSError:
            status = CLIENT_CLOSED if state["status"] is not None else 500
            raise
        except BaseException:
            status = 500
            raise
        finally:
            _final.reset(token)
            if _active is not None and status is not None:
                _active.request_done(endpoint_label(scope.get("path", "")), status)
