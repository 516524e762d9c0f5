"""Admission: how many requests one caller (the ingress) lets in at once, online and offline apart.

The ingress admits at most `ServeConfig.admission_limit` online engine requests at once (every
replica's `max_ongoing_requests`, plus `limits.max_router_queue` waiting for a slot); beyond that
`OverloadedError` (HTTP 503 with Retry-After) at once. A request with `n` samples counts as `n`,
admitted together before any header goes out, held until the request ends. Offline requests (priority >= 1) have a budget
of their own, so batch work never takes the online one. Serve's own caller-side queue limit is off
(`max_queued_requests: -1`): Serve counts a request as queued until it is routed, so a burst well
within capacity reached it in the few milliseconds routing takes.
"""
from __future__ import annotations


class OverloadedError(RuntimeError):
    """Every replica is at capacity and the router queue is full (HTTP 503 with Retry-After)."""

    retry_after_s = 1



class Admission:
    """At most `limit` online requests in flight through this caller (routed or waiting for a slot),
    and separately at most `offline_limit` offline ones (priority >= 1), so batch work never uses
    up what online users are admitted on.

    Serve's caller-side queue limit counts a request as queued until the router has placed it, so
    a burst far below capacity can hit it; this counts what is really outstanding instead."""

    def __init__(self, limit: int, offline_limit: int | None = None):
        self.limit, self.in_flight = max(1, int(limit)), 0
        self.offline_limit, self.offline_in_flight = max(1, int(offline_limit or limit)), 0

    def enter(self, priority: int = 0, count: int = 1) -> None:
        """Admit `count` requests (a prompt's `n` samples) all at once, or none: OverloadedError."""
        if priority > 0:
            if self.offline_in_flight + count > self.offline_limit:
                raise OverloadedError(
                    f"the server is overloaded: {self.offline_in_flight} offline requests in flight, the limit "
                    f"is {self.offline_limit}{_asking(count)}; retry later")
            self.offline_in_flight += count
            return
        if self.in_flight + count > self.limit:
            raise OverloadedError(
                f"the server is overloaded: {self.in_flight} requests in flight, the limit is {self.limit}"
                f"{_asking(count)} (every replica at capacity and the queue full); retry later")
        self.in_flight += count

    def leave(self, priority: int = 0, count: int = 1) -> None:
        if priority > 0:
            self.offline_in_flight = max(0, self.offline_in_flight - count)
        else:
            self.in_flight = max(0, self.in_flight - count)


def _asking(count: int) -> str:
    return f" and this request's n asks for {count}" if count > 1 else ""
