"""The offline backlog of a running app: rows jobs still have to send, for Serve's autoscaler.

Why a named actor: the job driver knows how many rows it still has to send, the Serve controller
decides the replica count, and neither can call the other. So drivers write their queued rows to
one small detached actor per app (`BacklogBoard`, named `eagle-backlog:<app>` in namespace
`eagle-serve`), each engine replica reads the total in `record_autoscaling_stats` (Serve's custom
autoscaling metrics, pushed to the controller), and the app's autoscaling policy
(cluster/autoscale.py) adds it to the ongoing requests. A report expires after `ttl_s` unless the
driver repeats it, so a driver killed with SIGKILL stops holding replicas up within a minute.
"""
from __future__ import annotations

import time
from typing import Any

import ray

NAMESPACE = "eagle-serve"
DEFAULT_TTL_S = 60.0


def board_name(app_name: str) -> str:
    return f"eagle-backlog:{app_name}"


@ray.remote(num_cpus=0, max_restarts=-1)
class BacklogBoard:
    """job id -> (queued rows, expiry time). Restarted empty if its node dies; drivers re-report."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple[int, float]] = {}

    def report(self, job_id: str, queued_rows: int, ttl_s: float = DEFAULT_TTL_S) -> None:
        if queued_rows <= 0:
            self.rows.pop(job_id, None)
        else:
            self.rows[job_id] = (int(queued_rows), time.monotonic() + ttl_s)

    def clear(self, job_id: str) -> None:
        self.rows.pop(job_id, None)

    def snapshot(self) -> dict[str, int]:
        now = time.monotonic()
        self.rows = {j: (n, t) for j, (n, t) in self.rows.items() if t > now}
        return {j: n for j, (n, _) in self.rows.items()}

    def total(self) -> int:
        return sum(self.snapshot().values())


def board(app_name: str, create: bool = True) -> Any | None:
    """The app's board (created detached on first use when `create`), or None when there is none."""
    name = board_name(app_name)
    if create:
        return BacklogBoard.options(name=name, namespace=NAMESPACE, lifetime="detached",
                                    get_if_exists=True).remote()
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


class BacklogReader:
    """What a replica reports to the autoscaler: the board's total, 0 when no board exists (yet)."""

    def __init__(self, app_name: str | None):
        self.app_name, self._board = app_name, None

    async def total(self, timeout_s: float = 2.0) -> int:
        import asyncio

        if not self.app_name:
            return 0
        if self._board is None:   # a GCS lookup: off the replica's event loop, which streams tokens
            self._board = await asyncio.to_thread(board, self.app_name, create=False)
            if self._board is None:
                return 0
        try:
            return int(await asyncio.wait_for(self._board.total.remote(), timeout_s))
        except Exception:   # board gone or slow: look it up again next time, report nothing now
            self._board = None
            return 0
