"""Prometheus metrics of the HTTP front: what users feel (TTFT, TPOT, throughput) and why (tau, queues, KV).

Kept in the ingress because that is where a request's whole life is visible. Engine-side numbers
(queue depth, KV usage) come from the replica stats each finished request carries back, plus a
stats probe on every scrape, so they are per replica and at most one request old; gauges of a
replica not heard from for `stale_s` are dropped (it was replaced or scaled away).
"""
from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # the *_created series only add noise to every scrape

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)
TAU_BUCKETS = (1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 8)


class ServeMetrics:
    def __init__(self, model: str, window_s: float = 10.0, stale_s: float = 120.0):
        self.registry = r = CollectorRegistry()
        self.model, self.window_s, self.stale_s = model, window_s, stale_s
        lb = ["model"]
        self.requests = Counter("eagle_requests", "HTTP requests by endpoint and status", lb + ["endpoint", "status"], registry=r)
        self.inflight = Gauge("eagle_requests_in_flight", "requests being served by this ingress", lb, registry=r)
        self.e2e = Histogram("eagle_e2e_latency_seconds", "request latency", lb, buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("eagle_ttft_seconds", "time to first token", lb, buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("eagle_tpot_seconds", "time per output token after the first", lb, buckets=TPOT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("eagle_prompt_tokens", "prompt tokens processed", lb, registry=r)
        self.gen_tokens = Counter("eagle_generation_tokens", "tokens generated", lb, registry=r)
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
        self._replica_seen: dict[str, float] = {}

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests.labels(self.model, endpoint, str(status)).inc()

    def retried(self, error: BaseException) -> None:
        self.retries.labels(self.model, type(error).__name__).inc()

    def first_token(self, ttft_s: float) -> None:
        self.ttft.labels(self.model).observe(ttft_s)

    def tokens(self, n: int) -> None:
        if n:
            self._recent.append((time.monotonic(), n))

    def finished(self, out, e2e_s: float, ttft_s: float | None) -> None:
        """Record a finished request from its final engine output."""
        m, n_out = out.metrics or {}, len(out.token_ids)
        self.e2e.labels(self.model).observe(e2e_s)
        self.prompt_tokens.labels(self.model).inc(len(out.prompt_token_ids))
        self.gen_tokens.labels(self.model).inc(n_out)
        if ttft_s is not None and n_out > 1:
            self.tpot.labels(self.model).observe((e2e_s - ttft_s) / (n_out - 1))
        if m.get("num_target_forwards"):
            self.target_forwards.labels(self.model).inc(m["num_target_forwards"])
        if m.get("mean_accepted_tokens"):
            self.tau.labels(self.model).observe(float(m["mean_accepted_tokens"]))
        if m.get("replica_id"):
            self.replica_requests.labels(self.model, str(m["replica_id"])).inc()
        if isinstance(m.get("replica_stats"), dict):
            self.replica_stats(m["replica_stats"])

    def replica_stats(self, st: dict) -> None:
        rid = str(st.get("replica_id", "unknown"))
        self._replica_seen[rid] = time.monotonic()
        self.running.labels(self.model, rid).set(st.get("num_running", 0))
        self.waiting.labels(self.model, rid).set(st.get("num_waiting", 0))
        self.kv_usage.labels(self.model, rid).set(st.get("kv_usage", 0.0))
        self.free_blocks.labels(self.model, rid).set(st.get("num_free_blocks", 0))

    def render(self) -> bytes:
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()
        self.tokens_per_s.labels(self.model).set(sum(n for _, n in self._recent) / self.window_s)
        for rid, seen in list(self._replica_seen.items()):
            if seen < now - self.stale_s:
                del self._replica_seen[rid]
                for g in (self.running, self.waiting, self.kv_usage, self.free_blocks):
                    g.remove(self.model, rid)
        return generate_latest(self.registry)
