"""Job progress: a bar on a terminal, periodic plain log lines otherwise (Ray job logs, CI), a summary.

Rates are over this run only (rows skipped on resume are shown as done but do not inflate the
throughput or the ETA). Tau = tokens produced per target forward over all rows so far (1.0 without
a draft head).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field


def fmt_duration(s: float | None) -> str:
    if s is None or s != s or s == float("inf"):
        return "?"
    s = int(s)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


@dataclass
class RowCounts:
    """Rows and tokens counted from finished output records: what this run produced (rows counted
    when finished, committed yet or not), and what committed files hold (jobs/output_writer.py)."""

    rows: int = 0
    error_rows: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    decode_tokens: int = 0
    forwards: int = 0
    cache_queried_tokens: int = 0   # prompt tokens of generated rows (prefix cache lookups)
    cached_tokens: int = 0          # ... of which came from the prefix cache
    started: float = field(default_factory=time.monotonic)

    def add(self, rec: dict) -> None:
        self.rows += 1
        self.error_rows += rec.get("error") is not None
        self.prompt_tokens += rec.get("prompt_tokens") or 0
        self.completion_tokens += rec.get("completion_tokens") or 0
        if rec.get("cached_tokens") is not None:
            self.cache_queried_tokens += rec.get("prompt_tokens") or 0
            self.cached_tokens += rec["cached_tokens"]
        f = rec.get("forwards") or 0    # error rows and committed files have none
        self.forwards += f
        self.decode_tokens += round((rec.get("accepted_tokens_per_step") or 1.0) * f)

    def merge(self, other: "RowCounts") -> None:
        for k in ("rows", "error_rows", "prompt_tokens", "completion_tokens", "decode_tokens", "forwards",
                  "cache_queried_tokens", "cached_tokens"):
            setattr(self, k, getattr(self, k) + getattr(other, k))

    @property
    def elapsed(self) -> float:
        return max(1e-9, time.monotonic() - self.started)

    @property
    def tau(self) -> float:
        return self.decode_tokens / self.forwards if self.forwards else 1.0

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.elapsed

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed


class Progress:
    def __init__(self, total: int, initial: int, interval_s: float = 10.0, stream=None, tty: bool | None = None,
                 initial_errors: int = 0):
        self.total, self.initial = total, initial
        self.initial_errors = initial_errors    # error rows already in the output (a resume)
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval_s = interval_s
        self._last_log = time.monotonic()
        self._bar = None
        if self.tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="row", file=self.stream, dynamic_ncols=True,
                             smoothing=0.1)

    def update(self, stats: RowCounts, extra: str = "", force: bool = False) -> None:
        done = self.initial + stats.rows
        now = time.monotonic()
        if self._bar is not None:
            if not force and now - self._last_log < 0.2:   # a terminal needs 5 redraws a second at most
                return
            self._last_log = now
            self._bar.n = done
            self._bar.set_postfix_str(f"{stats.tokens_per_s:.0f} tok/s, tau {stats.tau:.2f}, "
                                      f"{self.initial_errors + stats.error_rows} errors{extra}", refresh=False)
            self._bar.refresh()
            return
        if force or now - self._last_log >= self.interval_s:
            self._last_log = now
            print(self.line(stats) + extra, file=self.stream, flush=True)

    def line(self, stats: RowCounts) -> str:
        done = self.initial + stats.rows
        pct = 100.0 * done / self.total if self.total else 100.0
        left = max(0, self.total - done)
        eta = left / stats.rows_per_s if stats.rows else None
        return (f"rows {done}/{self.total} ({pct:.1f}%) | {stats.rows_per_s:.1f} rows/s | "
                f"{stats.tokens_per_s:.1f} tok/s | tau {stats.tau:.2f} | errors {self.initial_errors + stats.error_rows} | "
                f"ETA {fmt_duration(eta)}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def summary(manifest: dict) -> str:
    """The end-of-job report, from the manifest."""
    run = (manifest.get("runs") or [{}])[-1]
    lost = run.get("replicas_lost_with_node")
    lines = [
        f"job {manifest.get('status')}: {manifest.get('rows', 0)}/{manifest.get('input_rows', 0)} rows in "
        f"{manifest.get('output')} ({manifest.get('error_rows', 0)} error rows, "
        f"{manifest.get('duplicate_ids_skipped', 0)} duplicate ids skipped)",
        f"this run: {run.get('rows', 0)} rows in {fmt_duration(run.get('wall_s'))} | "
        f"{run.get('rows_per_s', 0):.2f} rows/s | {run.get('output_tokens_per_s', 0):.1f} output tok/s | "
        f"tau {run.get('tau', 1.0):.2f} | {run.get('replicas') or 0} replica(s)"
        f"{' of serve app ' + manifest['serve_app']['name'] if manifest.get('serve_app') else ''}"
        f"{' | %d rows preempted (recomputed)' % run['preempted_rows'] if run.get('preempted_rows') else ''}"
        f"{' | %d replica(s) lost with their node' % lost if lost else ''}"
        f"{' | driver peak RSS %.0f MB' % run['driver_peak_rss_mb'] if run.get('driver_peak_rss_mb') else ''}",
    ]
    noop = manifest.get("last_noop_rerun")
    if noop and noop.get("at", 0) >= run.get("updated_at", 0):
        lines[1] = (f"this run: nothing to do ({noop.get('skipped_already_done', 0)} rows already in the output); "
                    f"last run that generated: " + lines[1].removeprefix("this run: "))
    if manifest.get("unreadable_rows"):
        first = manifest["unreadable"][0]
        lines.append(f"unreadable: {manifest['unreadable_rows']} rows whose ids could not be read either, "
                     f"not in the output (first: {first['error']})")
    if manifest.get("error"):
        lines.append(f"error: {manifest['error']}")
    return "\n".join(lines)
