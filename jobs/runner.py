"""The job driver: stream rows in, keep every replica busy, write results out, exactly once.

One loop, one thread: pull rows from the input until the replicas' free slots are covered, send
them, collect whatever finished (ray.wait), hand results to the part writer, commit on schedule.
Memory is bounded by design: one input batch, the rows in flight (replicas x in_flight), one
output row group, and 16 bytes per row id seen.

Exactly once: the committed output files are the only record of progress. At start their ids are
read (`OutputDir.open`) and those rows are skipped; a row is handed to the writer once (rows lost
to a dead replica were never handed over, so they are simply sent again); a temp file is renamed
into place whole. So whenever the driver dies (SIGKILL included), a rerun redoes exactly the rows
that were not committed. Ray starts lazily, at the first row that needs generating, so resuming a
finished job costs no model load.
"""
from __future__ import annotations

import hashlib
import logging
import os
import signal
import socket
import sys
import time
from collections import deque

import psutil

from cluster.death_cause import FREE_NODE_LOSSES
from cluster.openai_requests import format_refusal
from cluster.signals import on_stop_signals, restore_signals
from jobs.id_set import IdSet
from jobs.input_reader import Row, iter_rows, open_input
from jobs.job_config import JobConfig, JobConfigError, builtin_head_error
from jobs.openai_batch import SERVER_ERROR
from jobs.output_writer import BASE_SCHEMA, KEPT, OutputDir, OutputError, PartWriter, new_run_id, output_schema
from jobs.progress import Progress, RowCounts

logger = logging.getLogger(__name__)
_EMPTY = dict.fromkeys(n for n in BASE_SCHEMA.names if n != "id")   # every output column of a row not generated


def row_seed(row_id: str | int) -> int:
    """A stable per-row seed: sampled rows come out the same on a resume as on the first run."""
    key = str(row_id).encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 2


def row_params(cfg: JobConfig, row: Row) -> dict:
    p = {"max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
         "seed": cfg.seed, "stop": cfg.stop}
    if cfg.truncate_prompt_tokens is not None:
        p["truncate_prompt_tokens"] = cfg.truncate_prompt_tokens
    p.update(row.params)
    if isinstance(p["stop"], str):
        p["stop"] = [p["stop"]]
    if p["seed"] is None:
        p["seed"] = row_seed(row.id)
    return p


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def _trim_malloc() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them; a days-long driver's RSS would creep)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class JobRunner:
    def __init__(self, cfg: JobConfig, ray_address: str = "local", progress_stream=None):
        self.cfg = cfg.absolute()
        self.ray_address = ray_address
        self.progress_stream = progress_stream
        self._set_format()
        self.run_id = new_run_id()
        self.stats = RowCounts()
        self.first_ready: float | None = None   # when the first replica could take rows
        self.pool = None
        self.stopping: str | None = None
        self.duplicates = self.skipped_done = 0
        self.rss_peak = 0.0
        self.rss_by_decile: list[float] = []   # driver RSS when 10%, 20%, ... of this run's rows were done
        self.preempted_rows = self.preemptions = 0   # row metrics: rows the engine preempted (for online work)
        self._owns_ray = False
        self.app = None                          # --serve-app: jobs.app_link.AppLink

    # ---- the whole job -----------------------------------------------------------------------
    def run(self) -> dict:
        """Run to completion (or cancellation/failure); returns the final manifest."""
        self.plan = open_input(self.cfg.input, self.cfg.keep_columns, exclude=self.cfg.output)  # before any model
        self._set_format(self.plan.kind)
        if self.cfg.serve_app is not None:     # the app's engine settings become the job's (fingerprint, manifest)
            from jobs.app_link import AppLink

            self.app = AppLink.connect(self.cfg, self.ray_address)
            self._owns_ray = self.app.owns_ray
            self._install_signals()
            self.cfg = self.cfg.with_app_engine(self.app.engine)
        else:
            self._check_this_machine()
            if self.cfg.draft not in ("auto", "none"):
                why = builtin_head_error(self.cfg.engine, self.cfg.model, self.cfg.draft)
                if why is not None:
                    raise JobConfigError(f"--draft {self.cfg.draft}: {why}")
        self.out = OutputDir(self.cfg.output, self.fmt)
        try:
            try:
                self.done_ids, self.prior = self.out.open(self.cfg.generation_fingerprint(), self.cfg.overwrite,
                                                          self.plan.identity, self.cfg.retry_errors)
            except OutputError as e:
                if self.app is None or "different settings" not in str(e):
                    raise
                raise OutputError(f"{e} (serve app {self.cfg.serve_app!r} serves {self.cfg.model}, dtype "
                                  f"{self.cfg.dtype}, draft {self.cfg.resolved_draft() or 'none'})") from None
            parts = set(self.out.parts())     # a part deleted by hand: its rows run again, counted once
            by_part = self.out.manifest.get("prefix_cache_by_part")
            if by_part is None and self.out.manifest.get("prefix_cache"):   # written before counts by part
                old = self.out.manifest["prefix_cache"]
                by_part = {"earlier runs": [old.get("prompt_tokens", 0), old.get("cached_prompt_tokens", 0)]}
            self.prior_cache = {name: counts for name, counts in (by_part or {}).items()
                                if name in parts or not name.startswith("part-")}
            if self.out.retried_error_rows:
                logger.info("--retry-errors: %d error rows taken out of the output; they run again",
                            self.out.retried_error_rows)
            self.writer = PartWriter(self.out, output_schema(self.plan.kept, self.plan.id_type), self.run_id,
                                     self.cfg.rows_per_file,
                                     self.cfg.row_group_rows, self.cfg.commit_interval_s,
                                     on_commit=self._on_commit)
            self.started_at = time.time()
            self._write_manifest("running")
            if len(self.done_ids):
                logger.info("resuming: %d rows already in %s", len(self.done_ids), self.cfg.output)
            status, error = "completed", None
            old = self._install_signals()
            try:
                self._loop()
                status = "cancelled" if self.stopping else "completed"
            except KeyboardInterrupt:    # a second Ctrl-C / SIGTERM: stop without waiting
                status = "cancelled"
                raise
            except BaseException as e:
                status, error = "failed", f"{type(e).__name__}: {e}"
                raise
            finally:
                restore_signals(old)
                if self.pool is not None:
                    self.pool.shutdown()
                if self.app is not None:
                    self.app.clear_backlog()
                self.writer.commit()   # rows that finished are good whatever happened to the rest
                manifest = self._write_manifest(status, error)
                if self.progress:
                    self.progress.close()
                self._shutdown_ray()
        finally:
            self.out.close()
        return manifest

    def _loop(self) -> None:
        cfg = self.cfg
        rows = iter_rows(self.plan, cfg.read_batch_rows)
        self.seen = IdSet()
        queue: deque[Row] = deque()
        exhausted = False
        total = self.plan.total_rows
        self.progress = Progress(total, min(len(self.done_ids), total), cfg.log_interval_s, self.progress_stream,
                                 initial_errors=self.prior.error_rows)
        while True:
            accepting = self.pool is not None and self.pool.accepting
            want = max(1, self.pool.free_slots()) if accepting else 1
            while not exhausted and not self.stopping and len(queue) < want:
                row = next(rows, None)
                if row is None:
                    exhausted = True
                elif self._admit(row):
                    queue.append(row)
            if queue and self.pool is None and not self.stopping:
                self._start_pool()
            while queue and self.pool is not None and self.pool.accepting and self.pool.free_slots() > 0 \
                    and not self.stopping:
                row = queue.popleft()
                self.pool.submit(row, row_params(cfg, row))
            in_flight = self.pool.in_flight if self.pool is not None else 0
            if self.stopping or (exhausted and not queue and not in_flight):
                return
            if self.pool is not None:
                done, lost = self.pool.poll(timeout=0.5)
                for row, res in done:
                    self._emit(row, res)
                for row, counts in reversed(lost):
                    if not counts and row.free_losses < FREE_NODE_LOSSES:   # no row's doing
                        row.free_losses += 1
                        queue.appendleft(row)
                        continue
                    row.attempts += 1
                    if row.attempts > cfg.max_row_retries:
                        lost = f" (and was lost with its node or unreachable {row.free_losses} times)" if row.free_losses else ""
                        self._emit(row, {"error": f"the replica running this row died {row.attempts} times{lost}",
                                         **SERVER_ERROR})
                    else:
                        queue.appendleft(row)
            if self.writer.due():
                self.writer.commit()
            self.out.folder.renew()     # object storage: keep the lease (cheap: a write every 30 s)
            if self.app is not None:    # rows still to send: the app's autoscaling counts them
                in_flight = self.pool.in_flight if self.pool is not None else 0
                self.app.report_backlog(len(queue) + (0 if exhausted else self._unread_rows()) + in_flight)
            self._sample_rss(total - min(len(self.done_ids), total))
            starting = self.pool is not None and not self.pool.accepting
            if self.pool is not None and not starting and self.first_ready is None:
                self.first_ready = time.monotonic()
            self.progress.update(self.stats, " | waiting for replicas to load the model" if starting else "")

    def _set_format(self, kind: str | None = None) -> None:
        """`auto` follows the opened input's kind once known (a folder of JSONL files too), written into the
        config: the fingerprint and the manifest hold the format the parts have."""
        if kind is not None:
            self.cfg = self.cfg.model_copy(update={"format": self.cfg.output_format(kind)})
        self.fmt = self.cfg.output_format()
        if self.fmt == "openai-batch" and self.cfg.keep_columns:
            raise JobConfigError("--keep-columns has no place in the OpenAI Batch output format; use --format parquet")

    def _check_this_machine(self) -> None:
        """Replicas on a Ray this job starts here: a missing model folder or CUDA without a GPU would only
        fail once Ray and a replica start (or wait for a GPU forever), so they are refused up front. On a
        cluster (`--address`), paths and GPUs are the cluster's: its nodes are not this machine."""
        ray = sys.modules.get("ray")
        if self.ray_address != "local" or (ray is not None and ray.is_initialized()):
            return
        model = self.cfg.model
        if model.startswith(("/", "./", "../", "~")) and not os.path.exists(os.path.expanduser(model)):
            raise JobConfigError(f"--model {model}: no such file or folder")
        if self.cfg.max_model_len is not None and self.cfg.engine == "eagle_worker":
            from eagle_worker.engine_api import local_context

            context = local_context(model)
            if context is not None and self.cfg.max_model_len > context:
                raise JobConfigError(f"--max-model-len {self.cfg.max_model_len}: more than the model's context "
                                     f"of {context} tokens ({model})")
        if self.cfg.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise JobConfigError("--device cuda: CUDA is not available on this machine (torch.cuda.is_available() "
                                     "is false); use --device cpu, or --address to run on a cluster with GPUs")

    def _admit(self, row: Row) -> bool:
        """False for rows not to send: already committed, duplicate id, or bad (written as error now)."""
        if not self.seen.add(row.id):
            self.duplicates += 1
            if self.duplicates <= 5:
                logger.warning("duplicate id %r in the input: only its first row is generated", row.id)
            return False
        if row.id in self.done_ids:
            self.skipped_done += 1
            return False
        if row.error is None and row.model is not None and row.model not in self._model_names():
            row.error, row.error_param = (f"model {row.model!r} does not exist; this job runs {self.cfg.model!r}",
                                          "model")
            self._emit(row, {"error": row.error, "error_code": "model_not_found"})
            return False
        if row.error is None and self.fmt == "parquet" and "logprobs" in row.params:   # never dropped unsaid
            row.error, row.error_param = ("logprobs: the Parquet output has no logprobs; use --format openai-batch "
                                          "(the default for JSONL input)"), "logprobs"
        if row.error is not None:
            self._emit(row, {"error": row.error})
            return False
        return True

    def _model_names(self) -> tuple[str, ...]:
        """What an OpenAI request's `model` may name: the job's model, or the app's served name for it."""
        served = self.app.engine.get("served_model_name") if self.app is not None else None
        return (self.cfg.model,) + ((served,) if served else ())

    def _unread_rows(self) -> int:
        """Input rows not read yet that may need generating (an estimate: duplicates count too)."""
        read = len(self.seen) + self.duplicates
        return max(0, self.plan.total_rows - read - max(0, len(self.done_ids) - self.skipped_done))

    def _emit(self, row: Row, res: dict) -> None:
        p = res.get("num_preemptions") or 0
        self.preemptions += p
        self.preempted_rows += p > 0
        # carried input columns apart: a column named `model`, `chat` or `forwards` is data, not the row's result
        rec = {"id": row.id, **_EMPTY, **res, "chat": row.chat, "model": row.model or self.cfg.model, KEPT: row.extra}
        if rec.get("error") is not None:
            rec["error_param"] = rec.get("error_param") or row.error_param
            if rec["error"].startswith("SamplingParams.structured_outputs"):   # the engine's, in the row's field
                rec["error"], rec["error_param"] = format_refusal(row.format_field, rec["error"]), row.format_field
        self.writer.add(rec)
        self.stats.add(rec)

    # ---- Ray and replicas --------------------------------------------------------------------
    def _start_pool(self) -> None:
        import ray

        from jobs.replica_pool import ReplicaPool

        if self.app is not None:
            self.pool = self.app.pool(self.cfg, self.run_id)
            self.pool.start()
            logger.info("sending rows to serve app %s (%s, draft: %s) at offline priority", self.cfg.serve_app,
                        self.cfg.model, self.cfg.resolved_draft() or "none")
            return
        if not ray.is_initialized():
            self._owns_ray = True
            try:
                if self.ray_address == "local":
                    ray.init(address="local", num_cpus=len(os.sched_getaffinity(0)), include_dashboard=False,
                             namespace="eagle-jobs", logging_level=logging.WARNING)
                else:
                    ray.init(address=self.ray_address, namespace="eagle-jobs", logging_level=logging.WARNING)
            except SystemExit as e:   # SIGTERM under the handler ray.init installs: a cancel, not a failure
                if e.code != signal.SIGTERM:
                    raise
                self.stopping = "SIGTERM"
                raise KeyboardInterrupt from None
            self._install_signals()   # ray.init replaces SIGTERM's handler with its own (SystemExit)
        self.pool = ReplicaPool(self.cfg)
        self.pool.start()
        logger.info("starting %d replica(s) of %s (draft: %s, %s CPUs each)", self.cfg.replicas, self.cfg.model,
                    self.cfg.resolved_draft() or "none", self.pool.cpus)

    def _shutdown_ray(self) -> None:
        if self._owns_ray:
            import ray

            ray.shutdown()
            self._owns_ray = False

    # ---- signals -----------------------------------------------------------------------------
    def _install_signals(self) -> dict:
        return on_stop_signals(self._on_stop_signal)

    def _on_stop_signal(self, name: str) -> None:
        if self.stopping:      # second signal: stop now
            raise KeyboardInterrupt
        self.stopping = name
        logger.warning("%s: stopping; finished rows are committed, the rest is redone on resume", self.stopping)

    # ---- bookkeeping -------------------------------------------------------------------------
    progress: Progress | None = None

    def _on_commit(self) -> None:
        self._write_manifest("running")
        _trim_malloc()

    def _sample_rss(self, todo: int) -> None:
        rss = _rss_mb()
        self.rss_peak = max(self.rss_peak, rss)
        while len(self.rss_by_decile) < 10 and self.stats.rows >= (len(self.rss_by_decile) + 1) * todo / 10:
            self.rss_by_decile.append(round(rss, 1))

    def _write_manifest(self, status: str, error: str | None = None) -> dict:
        self.rss_peak = max(self.rss_peak, _rss_mb())   # also a run that read no row (an empty input) has one
        c = self.writer.committed
        rows = self.prior.rows + c.rows
        prev_runs = [r for r in self.out.manifest.get("runs", []) if r.get("run_id") != self.run_id]
        s = self.stats
        run = {
            "run_id": self.run_id, "host": socket.gethostname(), "status": status, "stopped_by": self.stopping,
            "started_at": self.started_at, "updated_at": time.time(), "wall_s": s.elapsed,
            "startup_s": (self.first_ready - s.started) if self.first_ready else None,
            "generation_s": (time.monotonic() - self.first_ready) if self.first_ready else None,
            "rows": s.rows, "rows_committed": c.rows, "error_rows": s.error_rows,
            "completion_tokens": s.completion_tokens, "decode_tokens": s.decode_tokens, "target_forwards": s.forwards,
            "rows_per_s": s.rows_per_s, "output_tokens_per_s": s.tokens_per_s, "tau": s.tau,
            "skipped_already_done": self.skipped_done, "retried_error_rows": self.out.retried_error_rows,
            "replicas": self.cfg.replicas if self.app is None else self.app.replicas(),
            "cpus_per_replica": getattr(self.pool, "cpus", None),
            "preempted_rows": self.preempted_rows, "preemptions": self.preemptions,
            "rows_by_node": dict(getattr(self.pool, "rows_by_node", {})),
            "replicas_lost_with_node": getattr(self.pool, "replicas_lost_with_node", 0),
            # sampled (ru_maxrss is no use: Linux keeps it across exec, so it includes a forking parent)
            "driver_peak_rss_mb": round(self.rss_peak, 1), "driver_rss_mb_by_decile": self.rss_by_decile,
        }
        noop = status != "running" and s.rows == 0 and self.pool is None and bool(prev_runs)
        # a rerun that found nothing to do keeps the last real run as the one the summary reports
        runs = prev_runs if noop else prev_runs + [run]
        forwards = sum(r.get("target_forwards", 0) for r in runs)
        input_rows = self.plan.total_rows
        unreadable_rows = sum(u["rows"] for u in self.plan.unreadable)
        cache_by_part = {**self.prior_cache, **self.writer.prefix_cache_by_part}
        manifest = {
            "status": status, "error": error, "input": self.cfg.input, "input_files": len(self.plan.files),
            "input_rows": input_rows, "output": self.cfg.output, "format": self.fmt,
            "rows": rows, "ok_rows": rows - self.prior.error_rows - c.error_rows,
            "error_rows": self.prior.error_rows + c.error_rows,
            "duplicate_ids_skipped": self.duplicates,
            "unreadable_rows": unreadable_rows, "unreadable": self.plan.unreadable[:100],
            # a skipped duplicate's row is not in the output (its id is, with the first row's answer)
            "complete": status == "completed" and rows == input_rows and not self.duplicates,
            "prompt_tokens": self.prior.prompt_tokens + c.prompt_tokens,
            "completion_tokens": self.prior.completion_tokens + c.completion_tokens,
            "prefix_cache": {"prompt_tokens": sum(q for q, _ in cache_by_part.values()),
                             "cached_prompt_tokens": sum(h for _, h in cache_by_part.values())},
            "prefix_cache_by_part": cache_by_part,
            "mean_accepted_tokens_per_step": (sum(r.get("decode_tokens", 0) for r in runs) / forwards) if forwards else 1.0,
            "fingerprint": self.cfg.generation_fingerprint(), "input_identity": self.plan.identity,
            "config": self.cfg.model_dump(mode="json"), "runs": runs,
        }
        if self.app is not None:   # what served the rows: the app and its engine settings
            manifest["serve_app"] = {"name": self.cfg.serve_app, "engine": self.app.engine}
        if noop:
            manifest["last_noop_rerun"] = {"run_id": self.run_id, "at": time.time(),
                                           "skipped_already_done": self.skipped_done}
        self.out.write_manifest(manifest)
        if status != "running" and self.progress:
            self.progress.update(self.stats, force=True)
            self.progress.close()
        return manifest


def run_job(cfg: JobConfig, ray_address: str = "local", progress_stream=None) -> dict:
    return JobRunner(cfg, ray_address, progress_stream).run()
