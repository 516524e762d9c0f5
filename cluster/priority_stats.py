"""Online vs offline counters of one replica, derived from the engine's per-request outputs.

What shows that batch rows made way for interactive users: offline rows the engine preempted
(their `metrics["num_preemptions"]`, recompute), and offline rows still waiting for their first
token in the engine when a younger online request got its first token (deferred in the engine).
Rows held back before reaching a replica are counted by the router in their caller
(`cluster.router_state.counters["offline_deferred"]`). Kept by the replica's engine thread only.
"""
from __future__ import annotations

from typing import Any

KEYS = ("online_finished", "offline_finished", "online_preemptions", "offline_preemptions",
        "offline_rows_preempted", "offline_deferred_in_engine")


class PriorityStats:
    def __init__(self) -> None:
        self.counts = dict.fromkeys(KEYS, 0)
        self._seq = 0
        self._live: dict[str, tuple[int, int]] = {}      # request id -> (priority, arrival number)
        self._no_output: dict[str, int] = {}            # offline request id -> arrival number, until its first output

    def added(self, request_id: str, priority: int) -> None:
        self._seq += 1
        self._live[request_id] = (int(priority), self._seq)
        if priority > 0:
            self._no_output[request_id] = self._seq

    def output(self, out: Any) -> None:
        rid = out.request_id
        live = self._live.get(rid)
        if live is None:
            return
        priority, arrival = live
        if priority > 0:
            self._no_output.pop(rid, None)
        elif arrival > 0:                       # an online request's first output: older offline rows wait
            waiting = [r for r, a in self._no_output.items() if a < arrival]
            for r in waiting:
                del self._no_output[r]          # counted once
            self.counts["offline_deferred_in_engine"] += len(waiting)
            self._live[rid] = (priority, 0)      # (first output seen)
        if out.finished:
            self._finished(rid, priority, out)

    def _finished(self, rid: str, priority: int, out: Any) -> None:
        self._live.pop(rid, None)
        self._no_output.pop(rid, None)
        n = int((getattr(out, "metrics", None) or {}).get("num_preemptions") or 0)
        kind = "offline" if priority > 0 else "online"
        self.counts[f"{kind}_finished"] += 1
        self.counts[f"{kind}_preemptions"] += n
        if priority > 0 and n:
            self.counts["offline_rows_preempted"] += 1

    def forget(self, request_id: str) -> None:
        """A request the engine refused (never added)."""
        self._live.pop(request_id, None)
        self._no_output.pop(request_id, None)

    def snapshot(self) -> dict[str, int]:
        return dict(self.counts)
