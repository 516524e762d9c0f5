"""EngineReplica: one engine replica inside a Ray actor (a Ray Serve replica in production).

Why a thread: `engine.step()` is blocking torch work that can take 100 ms or more. Running it on
the actor's event loop would stall everything else the actor does (new requests, aborts, Serve
health checks and routing-stats probes). So the step loop runs in a daemon thread that owns the
engine; async methods talk to it through a command queue (add/abort) and get outputs back through
per-request asyncio queues (`call_soon_threadsafe`). The engine is only ever touched by that thread.

`submit` is an async generator: under Serve it is called with `handle.options(stream=True)`, as a
plain Ray actor method it is a streaming generator. Items are the engine's `RequestOutput`s; when
the consumer lags, consecutive outputs are merged (deltas concatenated) so a slow reader costs
one item, not one per step. A request the engine refuses yields a single `Rejected` (HTTP 400)
instead of raising, so the caller gets the engine's message without a Ray traceback around it.
If the engine loop crashes, in-flight requests fail with EngineDiedError and the process exits
shortly after, so Serve replaces the replica at once. Requests still running when Serve is about to
kill a replica it stops end with ReplicaStoppedError, a free loss for callers (cluster/replica_stop.py).
The final output of a request carries
`metrics["replica_id"]` and `metrics["replica_stats"]`, which the HTTP layer turns into per-replica
gauges. The engine is reached only through the engine contract (eagle_worker/engine_api.py), from
the module `ServeConfig.engine` names.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import queue
import threading
import time
import uuid
from typing import Any, AsyncIterator

from cluster.autoscale import BACKLOG_METRIC
from cluster.caller_watch import GONE, CallerWatch, this_caller
from cluster.config import ServeConfig
from cluster.engine_settings import engine_config
from cluster.output_stream import OutputStream, merge_outputs, put_all
from cluster.priority_stats import PriorityStats
from cluster.replica_errors import EngineDiedError, Failed, Rejected, ReplicaConfigError, ReplicaStoppedError, guess_param
from cluster.replica_stop import StopWatch
from eagle_worker.engine_api import Engine, EngineModule, load_engine_module

logger = logging.getLogger(__name__)
EXIT_GRACE_S = 1.0  # after an engine crash: time to send the errors out before the process exits
TP_KEEPALIVE_S = 60.0  # an idle TP engine's ranks hear from rank 0 this often (their wait times out at 300 s)


class EngineReplica:
    """Hosts one `LLMEngine` (rank 0 of a tensor-parallel group when tp_size > 1)."""

    def __init__(self, config: dict | ServeConfig):
        self.config = config if isinstance(config, ServeConfig) else ServeConfig.from_dict(config)
        self.replica_id = _replica_id()
        self.torch_threads: int | None = None
        if self.config.device == "cpu":  # its cores, decoupled from Ray's CPU reservation (cluster/cpu_threads.py)
            from cluster.cpu_threads import inside_serve_replica, rank_threads, set_torch_threads

            self.torch_threads = set_torch_threads(rank_threads(self.config, under_serve=inside_serve_replica()))
        backend: EngineModule = load_engine_module(self.config.engine)
        self._sampling_params_cls = backend.SamplingParams
        self.tp = None
        if self.config.tp_size > 1:
            from cluster.tp_group import TPGroup

            self.tp = TPGroup.create(self.config, threads=self.torch_threads)  # rank 0 joins the group here
            self.tp.start_workers()   # ranks 1..n-1 build their shards and wait for rank 0's commands
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, OutputStream] = {}
        self._callers = CallerWatch(this_caller(), self._end_stream)   # requests of callers that died end
        self._priority_stats = PriorityStats()    # engine thread only
        self._backlog = None                      # BacklogReader, made on Serve's first autoscaling poll
        self._dead: BaseException | None = None
        self._step_started: float | None = None   # monotonic start of the step running now
        self._life = threading.Lock()     # giving up on a hung step vs that step returning: one wins
        self._stopping = False
        self._stop_watch = StopWatch(self._end_streams, alive=lambda: self._dead is None)   # Serve stopping us
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run_loop, args=(backend, built), name="engine-loop", daemon=True)
        self._thread.start()
        try:
            built.result()   # the engine, as self.engine
        except BaseException as e:
            if self.tp is not None:
                self.tp.shutdown()
            if isinstance(e, ValueError):
                raise ReplicaConfigError(f"the engine refused this replica's settings: {e}") from e
            raise
        self._stop_watch.start(self.replica_id)
        logger.info("replica %s ready (model=%s tp=%d)", self.replica_id, self.config.model, self.config.tp_size)

    # ---- public API (async actor methods) --------------------------------------------------
    async def submit(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: dict[str, Any],
        priority: int = 0,
        messages: list[dict] | None = None,
        stream_interval: int = 1,
        caller: tuple[str, str] | None = None,
    ) -> AsyncIterator[Any]:
        """Stream the request's outputs. The serving ingress sends `prompt` as token ids (it tokenizes
        and templates, off this replica's engine thread); text and `messages` (chat, rendered with
        the chat template here) are for other callers (jobs). `stream_interval`: after the first
        output, at most one item per that many new tokens, and the last (0: the first and the last
        only, for callers that want the result): each item is a Ray message through every process
        between here and the client, which on a CPU replica takes cycles from the engine's cores.
        `caller`: the calling actor's (namespace, name), so its requests end if it dies (caller_watch.py)."""
        if self._dead is not None:
            raise EngineDiedError(f"replica {self.replica_id}: engine is dead: {self._dead!r}")
        if self._stop_watch.stopped is not None:   # about to be killed: retried elsewhere
            raise ReplicaStoppedError(str(self._stop_watch.stopped))
        if request_id in self._streams:
            yield Rejected(f"duplicate request id {request_id!r}")
            return
        try:
            sp = self._sampling_params_cls(**params)
        except (ValueError, TypeError) as e:
            yield Rejected(str(e), guess_param(str(e)))
            return
        if messages is not None:
            try:
                prompt = self.render_chat(messages)
            except Exception as e:  # no template, malformed messages, a template's raise_exception()
                yield Rejected(f"cannot apply the chat template: {e}", "messages")
                return
        stream = OutputStream(asyncio.get_running_loop(), asyncio.Queue(), max(0, int(stream_interval)))
        self._streams[request_id] = stream
        self._callers.track(request_id, caller)
        added: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(("add", request_id, prompt, sp, priority, added))
        finished = False
        try:
            try:
                await self._admitted(added)
            except ValueError as e:
                finished = True
                param = guess_param(str(e))          # a chat row's prompt is its messages
                yield Rejected(str(e), "messages" if messages is not None and param == "prompt" else param,
                               getattr(e, "code", None))   # context_length_exceeded
                return
            while True:
                items = [await stream.queue.get()]
                while not stream.queue.empty():
                    items.append(stream.queue.get_nowait())
                for item in items:
                    if item is GONE:      # the caller died: nobody reads this; `finally` aborts it
                        return
                    if isinstance(item, BaseException):
                        raise item
                out = merge_outputs(items)
                if out.finished and out.finish_reason == "error":
                    finished = True
                    yield Failed(out.error or "the engine failed this request")
                    return
                if out.finished:
                    finished = True
                    out = dataclasses.replace(out, metrics={
                        **(out.metrics or {}), "replica_id": self.replica_id, "replica_stats": dict(self._stats),
                    }) if dataclasses.is_dataclass(out) else out
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            self._callers.forget(request_id)
            if not finished:  # consumer went away (client disconnect, cancellation): free the slot
                self._cmds.put(("abort", request_id))

    def _end_stream(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(GONE)

    async def _admitted(self, added: concurrent.futures.Future) -> None:
        """Wait for the engine thread to take the request; raises its ValueError, or if it died."""
        waiter = asyncio.wrap_future(added)
        while True:
            done, _ = await asyncio.wait([waiter], timeout=1.0)
            if done:
                return waiter.result()
            if self._dead is not None:  # crashed before it got to our command
                waiter.cancel()
                raise EngineDiedError(f"replica {self.replica_id}: engine is dead: {self._dead!r}")

    def render_chat(self, messages: list[dict]) -> str:
        """Chat messages -> prompt text (the config's `chat_template` reaches the engine config)."""
        return self.engine.apply_chat_template(messages)

    async def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    async def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    async def engine_info(self) -> dict[str, Any]:
        """What this replica's engine runs: a job sending rows through the app records it in its
        manifest, checks it on resume, and loads the matching tokenizer from it (cluster/app_client.py)."""
        c = self.config
        return {"model": c.model, "served_model_name": c.model_name, "dtype": c.dtype, "device": c.device,
                "engine": c.engine, "draft": c.resolved_draft, "tp_size": c.tp_size,
                "speculation": c.speculation.model_dump() if c.speculation is not None else None,
                "enable_prefix_caching": c.enable_prefix_caching, "chat_template": c.chat_template,
                "max_model_len": self.max_model_len, "max_num_seqs": c.limits.max_num_seqs,
                "max_queued_requests": c.limits.max_queued_requests, "app_name": c.app_name}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics: the offline rows jobs still have to send to this app
        (cluster/backlog.py), which the app's policy counts as ongoing requests (cluster/autoscale.py)."""
        if self._backlog is None:
            from cluster.backlog import BacklogReader

            self._backlog = BacklogReader(_app_name() or self.config.app_name)
        return {BACKLOG_METRIC: float(await self._backlog.total())}

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve polls this for the request router (see cluster/router.py)."""
        return dict(self._stats)

    def check_health(self) -> None:
        """Ray Serve health check: a dead engine loop or TP rank, or a step running past
        `limits.step_timeout_s`, makes Serve replace us."""
        if self._dead is not None:
            raise EngineDiedError(f"engine loop died: {self._dead!r}")
        if not self._thread.is_alive():
            raise EngineDiedError("engine loop thread exited")
        started, limit = self._step_started, self.config.limits.step_timeout_s
        if started is not None and limit is not None and time.monotonic() - started > limit:
            err = EngineDiedError(f"replica {self.replica_id}: an engine step has run for "
                                  f"{time.monotonic() - started:.0f} s, over limits.step_timeout_s ({limit:g} s): "
                                  "the engine is hung")
            if self._give_up(err, err, step=started):
                logger.error("%s", err)
                raise err
        if self.tp is not None:
            try:
                self.tp.check_health()
            except Exception as e:  # a rank is gone: its requests are retried elsewhere, free if with its node
                node_loss = self.tp.node_loss(wait_s=2.0)   # its loop ended, so Ray knows why already
                self._give_up(e, EngineDiedError(f"replica {self.replica_id}: a tensor-parallel rank failed: {e!r}",
                                                 node_loss=node_loss))
                raise
        self._stop_watch.passed_health_check()

    def shutdown(self) -> None:
        """Stop the loop; the engine thread itself releases the TP ranks (collectives stay on it)."""
        self._stopping = True
        self._stop_watch.close()
        self._cmds.put(("wake",))
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        if self.tp is not None:
            self.tp.shutdown()
            self.tp = None

    def __del__(self):  # Serve calls this when it stops the replica
        try:
            self.shutdown()
        except Exception:
            pass

    # ---- engine thread ---------------------------------------------------------------------
    def _run_loop(self, backend: EngineModule, built: concurrent.futures.Future) -> None:
        """Build the engine, then step it. Both on this thread: every torch op of the process then
        runs from one thread, so OpenMP keeps one thread team, whose workers spin between ops as
        they do under `LLM` (a second team, e.g. from building the model on the actor's thread,
        makes libgomp count more threads than cores and put every worker to sleep after each op:
        about 20% of a CPU engine's speed)."""
        try:
            self.engine: Engine = backend.LLMEngine(engine_config(self.config))
            self.max_model_len = self.engine.max_model_len
            self._stats: dict[str, Any] = self._snapshot_stats(step_s=0.0)
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result(self.engine)
        try:
            busy_at = time.monotonic()
            while not self._stopping and self._dead is None:     # (a hung step given up on may return)
                self._drain_commands(block=not self.engine.has_unfinished_requests())
                if not self.engine.has_unfinished_requests():
                    if self.tp is not None and time.monotonic() - busy_at > TP_KEEPALIVE_S:
                        self.engine.keep_alive()
                        busy_at = time.monotonic()
                    continue
                busy_at = time.monotonic()
                t0 = time.perf_counter()
                self._step_started = time.monotonic()   # check_health: a step that never returns
                outs = self.engine.step()
                with self._life:
                    self._step_started = None
                    if self._dead is not None:      # given up on while it ran: its requests have their error
                        break
                for out in outs:
                    self._priority_stats.output(out)
                self._stats = self._snapshot_stats(time.perf_counter() - t0)
                self._deliver_all(outs)
            self.engine.shutdown()  # e.g. tells the other TP ranks to stop
        except BaseException as e:  # the engine is unusable: fail everyone, let Serve replace us
            logger.exception("replica %s: engine loop crashed", self.replica_id)
            node_loss = self.tp.node_loss() if self.tp is not None else None   # a rank's collective failed?
            self._give_up(e, EngineDiedError(f"replica {self.replica_id}: engine failed: {e!r}", node_loss=node_loss))

    def _give_up(self, cause: BaseException, err: EngineDiedError, step: float | None = None) -> bool:
        """The engine is unusable (crashed, or the step that started at `step` hung): every request
        gets `err` (callers retry them elsewhere), and the process exits. Dying now, rather than at
        Serve's next health check and its graceful shutdown (which waits for the requests of a hung
        step), makes Serve stop routing to us and start a replacement at once. False where there is
        nothing to do: given up already, or the hung step returned meanwhile."""
        with self._life:
            if self._dead is not None or (step is not None and self._step_started != step):
                return False
            self._dead = cause
        self._stats = {**self._stats, "engine_alive": False}
        self._end_streams(err)
        if _inside_ray_actor():
            threading.Timer(EXIT_GRACE_S, os._exit, args=(1,)).start()
        return True

    def _end_streams(self, err: BaseException) -> None:
        """Every request's held outputs, then `err` (its generator then aborts it), from any thread."""
        for rid in list(self._streams):
            stream = self._streams.get(rid)
            if stream is not None:
                stream.loop.call_soon_threadsafe(put_all, [(stream.queue, [*stream.held, err])])

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=0.5) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, prompt, sp, priority, fut = cmd
            if fut.cancelled() or rid not in self._streams:
                return
            try:
                self.engine.add_request(rid, prompt, sp, priority=priority)
            except ValueError as e:
                fut.set_exception(e)
            else:
                self._priority_stats.added(rid, priority)
                fut.set_result(None)
        elif cmd[0] == "abort":
            self.engine.abort(cmd[1])
            self._priority_stats.forget(cmd[1])

    def _deliver_all(self, outs: list) -> None:
        """A step's outputs to their streams: those due, with one wake-up per event loop (not one per
        request: each wake-up takes the GIL from this thread between torch ops)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is not None and stream.due(out):
                by_loop.setdefault(stream.loop, []).append((stream.queue, stream.held))
                stream.held = []
        for loop, deliveries in by_loop.items():
            loop.call_soon_threadsafe(put_all, deliveries)

    def _snapshot_stats(self, step_s: float) -> dict[str, Any]:
        st = dict(self.engine.stats())
        st.update(replica_id=self.replica_id, engine_alive=True, max_model_len=self.max_model_len,
                  num_streams=len(self._streams), step_s=step_s, updated_at=time.time(),
                  torch_threads=self.torch_threads, cpu_reserved=self.config.resources_per_rank.cpu,
                  **self._priority_stats.snapshot())
        st.setdefault("max_num_seqs", self.config.limits.max_num_seqs)   # the router's offline share
        return st


def _inside_ray_actor() -> bool:
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:
        return False


def _app_name() -> str | None:
    try:
        from ray import serve

        return serve.get_replica_context().app_name
    except Exception:  # plain Ray actor or plain object
        return None


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # plain Ray actor or plain object
        return uuid.uuid4().hex[:8]
