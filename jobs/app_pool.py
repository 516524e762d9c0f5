"""A job's rows through a running Serve application (`--serve-app NAME`), not its own replicas.

The same face to the runner as `jobs.replica_pool.ReplicaPool` (start, accepting, free_slots,
submit, in_flight, poll, shutdown, rows_by_node), so the driver loop, exactly-once commits, resume,
error rows and the manifest are the same code for both. Each row is one
`cluster.app_client.AppClient.generate` call at offline priority (1): the app's router places it
where online load leaves room, the engine admits online requests (priority 0) ahead of it and
preempts it for them (recompute). The calls run on one asyncio loop in a thread of the driver;
finished rows come back through a queue that `poll` drains.

The window (rows in flight at once): per running replica of the app, its engine batch
(`max_num_seqs`) plus a quarter of its queue (`max_queued_requests // 4`). That keeps every engine
batch full with its next rows waiting, while three quarters of each replica's queue (and the
router's whole queue) stay free for online requests: a job never holds the slots that Serve's
per-replica cap (`max_num_seqs + max_queued_requests`) would make online requests wait for. The
window follows the fleet: it is recomputed from the app's replica count every few seconds, so an
app that autoscales for the job's backlog (`report_backlog`) gets more rows. `--max-in-flight`
sets the whole window instead.

A driver that dies (kill -9, its node lost) takes its in-flight rows with it: the app's replicas
watch a named actor the driver owns (`cluster.caller_watch.stand_in_for_driver`) and abort the rows
of a driver that is gone; a rerun redoes them.

Failures: a row the router gave up on because its replica died twice (PoisonRequestError) is an
error row, as on own replicas; a row lost otherwise (replica lost, system overloaded, the call
failing in Serve) goes back to the driver's queue and is sent again (at most `max_row_retries`
times, then an error row). If the
app itself is gone (checked with the window, every few seconds: a deleted app's calls just hang),
the job fails (committed output kept; rerun to resume once the app is back).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from cluster.caller_watch import keep_stand_in, release_stand_in, stand_in_for_driver
from cluster.openai_errors import context_error
from cluster.replica_errors import Failed, Rejected
from jobs.input_reader import Row
from jobs.job_config import JobConfig
from jobs.openai_batch import SERVER_ERROR, openai_logprobs
from jobs.replica_pool import OFFLINE_PRIORITY, JobFailed, _first_line, row_result

logger = logging.getLogger(__name__)
WINDOW_REFRESH_S = 5.0


class _Lost(Exception):
    """The row's call ended without a result it could keep (replica lost, overloaded): send it again."""


@dataclass
class _Call:
    row: Row
    future: Any
    sent_at: float


class AppPool:
    def __init__(self, cfg: JobConfig, client, engine: dict, run_id: str):
        self.cfg, self.client, self.engine, self.run_id = cfg, client, engine, run_id
        self.cpus = None                       # the app's replicas have their own resources
        self.rows_by_node: dict[str, int] = {}  # the router hides which replica ran a row: one key, the app
        self.calls: dict[int, _Call] = {}
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._keys = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="app-pool", daemon=True)
        self._tokenizer = None
        self._window = 0
        self._window_at = 0.0
        self._lost_streak = self._missing = 0

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        stand_in_for_driver()    # a driver killed mid-job: the app ends its rows (cluster/caller_watch.py)
        self._thread.start()
        self._refresh_window(force=True)

    def shutdown(self) -> None:
        """Cancel the rows in flight (the app aborts them) and stop the loop."""
        for call in self.calls.values():
            call.future.cancel()
        self.calls.clear()
        if self._thread.is_alive():
            async def _cancel_all():
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            try:
                asyncio.run_coroutine_threadsafe(_cancel_all(), self._loop).result(timeout=30)
            except Exception:   # a stuck call: the daemon thread ends with the driver
                logger.debug("cancelling rows in flight failed", exc_info=True)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        release_stand_in()

    # ---- the window --------------------------------------------------------------------------
    def replicas(self) -> int:
        return app_replicas(self.client, self.cfg.serve_app)

    def _refresh_window(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._window_at < WINDOW_REFRESH_S:
            return
        self._window_at = time.monotonic()
        if not force:
            self._check_app()       # a deleted app leaves its calls hanging: notice it here
        if self.cfg.max_in_flight is not None:
            self._window = self.cfg.max_in_flight
            return
        try:
            n = self.replicas()
        except Exception as e:      # Serve status unavailable for a moment: keep the last window
            logger.debug("app replica count unavailable: %s", e)
            n = None
        if n is not None:
            seqs = int(self.engine.get("max_num_seqs") or 64)
            queued = int(self.engine.get("max_queued_requests") or 64)
            window = n * (seqs + queued // 4)
            if window != self._window:
                logger.info("app %s: %d replica(s), up to %d rows in flight", self.cfg.serve_app, n, window)
            self._window = window

    # ---- dispatch ----------------------------------------------------------------------------
    accepting = True        # the app is running before the job starts

    def free_slots(self) -> int:
        self._refresh_window()
        return self._window - len(self.calls)

    @property
    def in_flight(self) -> int:
        return len(self.calls)

    def submit(self, row: Row, params: dict) -> None:
        key = next(self._keys)
        # unique in the app across jobs and runs (engine request ids must be); the seed stays the row's
        rid = f"job-{self.run_id}/{row.id}" + (f"#retry{row.attempts}" if row.attempts else "")
        coro = self._one(key, rid, row.prompt, params, row.messages,
                         check_context=row.strict_max_tokens and "max_tokens" in row.params)
        self.calls[key] = _Call(row, asyncio.run_coroutine_threadsafe(coro, self._loop), time.monotonic())

    async def _one(self, key: int, rid: str, prompt, params: dict, messages, check_context: bool) -> None:
        try:
            res = await self._generate(rid, prompt, params, messages, check_context)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            res = e
        self._done.put((key, res))

    async def _generate(self, rid: str, prompt, params: dict, messages, check_context: bool) -> dict:
        """The whole result of one row (what JobReplica.generate returns on own replicas)."""
        from cluster.admission import OverloadedError
        from cluster.request_retry import PoisonRequestError, ReplicaLostError

        last = None
        max_len = self.engine.get("max_model_len")
        try:
            # aclosing: a row left early (a refusal, the context check, cancellation) is aborted in the app now
            async with aclosing(self.client.generate(rid, prompt, params, priority=OFFLINE_PRIORITY,
                                                      messages=messages)) as outs:
                async for out in outs:
                    if isinstance(out, Rejected):
                        return {"error": out.message, "error_param": out.param, **({"error_code": out.code} if out.code else {})}
                    if isinstance(out, Failed):
                        return {"error": out.message, **SERVER_ERROR}
                    if last is None and check_context and max_len:
                        n = len(out.prompt_token_ids)
                        if n + params["max_tokens"] > max_len:
                            return {"error": context_error(n, params["max_tokens"], max_len),
                                    "error_param": "max_tokens", "error_code": "context_length_exceeded"}
                    last = out
        except PoisonRequestError as e:
            return {"error": f"the replicas running this row died: {_first_line(e)}", **SERVER_ERROR}
        except (ReplicaLostError, OverloadedError) as e:
            raise _Lost(_first_line(e)) from None
        if last is None:
            raise _Lost("the app returned no output")
        res = row_result(last)
        if params.get("logprobs") is not None:
            tok = await asyncio.to_thread(self.tokenizer)
            res["logprobs"] = openai_logprobs(list(last.logprobs or []), list(last.token_ids), tok,
                                              chat=messages is not None)
        return res

    def tokenizer(self):
        """The app's tokenizer, loaded on first need (rows asking for logprobs: token texts)."""
        if self._tokenizer is None:
            from eagle_worker.engine_api import load_engine_module

            engine = load_engine_module(self.cfg.engine)
            self._tokenizer = engine.load_prompt_tokenizer(
                engine.EngineConfig(model=self.cfg.model, chat_template=self.cfg.chat_template, draft=None))
        return self._tokenizer

    # ---- collecting --------------------------------------------------------------------------
    def poll(self, timeout: float) -> tuple[list[tuple[Row, dict]], list[tuple[Row, bool]]]:
        """(finished rows with results, rows to send again, each counting against its
        `max_row_retries`: the app's own retries (cluster/request_retry.py) already went past replicas lost
        with their node or unreachable for now, `death_cause.free_loss`; Ray's actor errors never get here)."""
        if not self.calls:
            time.sleep(min(timeout, 0.05))
            return [], []
        items = []
        try:
            items.append(self._done.get(timeout=timeout))
            while True:
                items.append(self._done.get_nowait())
        except queue.Empty:
            pass
        done, retry = [], []
        for key, res in items:
            call = self.calls.pop(key, None)
            if call is None:            # cancelled meanwhile
                continue
            if isinstance(res, _Lost):
                retry.append((call.row, True))
                self._lost_streak += 1
                logger.warning("row %r lost (%s); it is sent again", call.row.id, res)
            elif isinstance(res, BaseException):
                # not the row's answer (those are Rejected/Failed outputs): the app going away, Serve
                # failing the call... The app gone fails the job; else the row is sent again (then, after
                # max_row_retries, an error row)
                self._check_app()
                retry.append((call.row, True))
                logger.warning("row %r: the call failed (%s: %s); it is sent again", call.row.id,
                               type(res).__name__, _first_line(res))
            else:
                self._lost_streak = 0
                done.append((call.row, res))
                self.rows_by_node[self.cfg.serve_app] = self.rows_by_node.get(self.cfg.serve_app, 0) + 1
        if retry:
            keep_stand_in()         # before they go again: rows a replica ended because the stand-in is gone
            if self._lost_streak >= 2 * max(1, self._window):
                self._check_app()
        return done, retry

    def _check_app(self) -> None:
        """Rows fail or keep getting lost: is the app still there? If not, the job cannot go on (rather
        than turning every row left into an error row)."""
        from cluster.app_client import running_apps

        try:
            apps = running_apps()
        except Exception as e:      # Serve's controller busy for a moment: ask again next time
            logger.debug("serve status unavailable: %s", e)
            return
        status = apps.get(self.cfg.serve_app)
        if status == "DELETING":
            self._missing = 2
        elif status is not None:
            self._missing = 0
        else:
            self._missing += 1      # twice in a row: one empty answer may be a controller hiccup
        if self._missing >= 2:   # each app with its state: one being deleted is listed, but not as running
            listing = ", ".join(f"{n} ({s})" for n, s in sorted(apps.items())) or "none"
            raise JobFailed(f"serve app {self.cfg.serve_app!r} is gone ({'being deleted; ' if status else ''}"
                            f"apps on the cluster: {listing}); committed output is kept, run the "
                            "same command again once it is back")
        self._lost_streak = 0


def app_replicas(client, app_name: str) -> int:
    """Running engine replicas of the app (Serve's status), at least 1."""
    if hasattr(client, "num_replicas"):
        return max(1, int(client.num_replicas()))
    from ray import serve

    app = serve.status().applications.get(app_name)
    dep = app.deployments.get("LLMServer") if app is not None else None
    states = dict(getattr(dep, "replica_states", None) or {})
    return max(1, int(states.get("RUNNING", 0)))
