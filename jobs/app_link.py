"""The driver's link to a running Serve application (`--serve-app NAME`): connect, check, report.

Connecting happens before the output is opened, because the app's engine settings (model, dtype,
draft, context, chat template) are the job's: they go into the resume fingerprint and the manifest,
so resuming into an output that another app, or this app now serving another model, wrote is
refused like a changed flag. Without `--address` the driver joins the Ray cluster running here
(`ray.init(address="auto")`); as a Ray job (`--address`) it is already on the app's cluster.

Backlog: the rows the job still has to send are reported to the app (`AppClient.report_backlog`,
on change at most every BACKLOG_EVERY_S, unchanged every BACKLOG_REFRESH_S) so that Serve autoscaling can grow the fleet for the
job, and cleared when the driver ends. The key is the output location (one job per output, the
lock's rule), so a rerun after a crash overwrites the entry its dead predecessor left.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

from jobs.job_config import JobConfig, JobConfigError

logger = logging.getLogger(__name__)
SERVE_NAMESPACE = "eagle-serve"
BACKLOG_EVERY_S = 2.0
BACKLOG_REFRESH_S = 15.0   # the app forgets a report after its TTL (cluster/backlog.py: 60 s)


def backlog_key(output: str) -> str:
    """A job's key on the app's backlog board: its output location (one driver per output)."""
    return "job-" + hashlib.blake2b(output.encode(), digest_size=6).hexdigest()


@dataclass
class AppLink:
    name: str
    client: object
    engine: dict
    job_key: str
    owns_ray: bool = False
    _reported: tuple[int, float] | None = field(default=None, repr=False)

    @classmethod
    def connect(cls, cfg: JobConfig, ray_address: str) -> "AppLink":
        """Join the cluster and find the app; JobConfigError (exit 2, nothing generated) when there is
        no cluster or no such app (the message lists the running ones)."""
        import ray

        owns = False
        if not ray.is_initialized():
            address = "auto" if ray_address in (None, "local") else ray_address
            try:
                ray.init(address=address, namespace=SERVE_NAMESPACE, logging_level=logging.WARNING,
                         log_to_driver=False)   # the app's replicas log to Serve, not one line per row here
            except (ConnectionError, RuntimeError, ValueError) as e:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise JobConfigError(f"--serve-app {cfg.serve_app}: no Ray cluster to join here ({first}); pass "
                                     "--address of the cluster the app runs on (its dashboard, e.g. "
                                     "http://127.0.0.1:8265 for an `eaglectl serve` on this machine), or start Ray "
                                     "with `ray start --head` and the app with `eaglectl serve --address auto`") from None
            owns = True
        from cluster.app_client import AppClient, AppNotFoundError

        try:
            client = AppClient(cfg.serve_app)
            engine = dict(client.engine_config())
        except AppNotFoundError as e:
            if owns:
                ray.shutdown()
            raise JobConfigError(str(e)) from None
        key = backlog_key(cfg.output or cfg.input)
        logger.info("serve app %s: model %s, dtype %s, draft %s", cfg.serve_app, engine.get("model"),
                    engine.get("dtype"), engine.get("draft"))
        return cls(cfg.serve_app, client, engine, key, owns)

    def pool(self, cfg: JobConfig, run_id: str):
        from jobs.app_pool import AppPool

        return AppPool(cfg, self.client, self.engine, run_id)

    def replicas(self) -> int | None:
        from jobs.app_pool import app_replicas

        try:
            return app_replicas(self.client, self.name)
        except Exception:   # Serve's status unavailable for a moment
            return None

    def report_backlog(self, rows: int) -> None:
        now = time.monotonic()
        if self._reported is not None:
            last_rows, last_at = self._reported
            # on change, at most every BACKLOG_EVERY_S; unchanged, often enough that the report never expires
            if now - last_at < (BACKLOG_EVERY_S if rows != last_rows else BACKLOG_REFRESH_S):
                return
        try:
            self.client.report_backlog(self.job_key, rows)
        except Exception as e:      # autoscaling help, not the job's correctness: keep going
            logger.warning("cannot report the backlog to app %s: %s", self.name, e)
        self._reported = (rows, now)

    def clear_backlog(self) -> None:
        try:
            self.client.clear_backlog(self.job_key)
        except Exception as e:
            logger.warning("cannot clear the backlog at app %s: %s", self.name, e)
