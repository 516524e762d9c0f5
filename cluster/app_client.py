"""AppClient: what an offline job needs to send its rows through a running serving app.

A job that runs next to `eaglectl serve` (or a RayService) uses the app's engine replicas instead of
starting its own: `generate` calls the app's `LLMServer` deployment through a DeploymentHandle, so
the app's `LoadAwareRouter` places each row (offline rows prefer replicas with headroom, a freed slot
goes to waiting online requests first) and `cluster.request_retry.stream_outputs` retries a row whose
replica died (and refuses a poison row) exactly as for HTTP requests. Rows go at priority 1 (offline):
the engine schedules priority 0 first and preempts offline rows for online ones.

`report_backlog` tells the app's autoscaler how many rows the job still has to send
(cluster/backlog.py); with autoscaling on, the app grows toward `max_replicas` for a big job and
shrinks after it (cluster/autoscale.py).

The process must already be connected to the Ray cluster the app runs on (`ray.init(address=...)`);
the namespace does not matter for Serve apps, and the backlog board lives in `eagle-serve`.
"""
from __future__ import annotations

from typing import Any, AsyncIterator

from cluster import backlog
from cluster.request_retry import stream_outputs

ENGINE_DEPLOYMENT = "LLMServer"
OFFLINE_PRIORITY = 1


class AppNotFoundError(RuntimeError):
    """No running Serve app of that name with an engine deployment (the message lists the running ones)."""


def running_apps() -> dict[str, str]:
    """Serve apps on the connected cluster: name -> status ({} when Serve is not running)."""
    from ray import serve

    try:
        apps = serve.status().applications
    except Exception:   # Serve not started on this cluster
        return {}
    return {name: str(getattr(app.status, "value", app.status)) for name, app in apps.items()}


class AppClient:
    """Rows of a job -> the engine replicas of the running Serve app `app_name`."""

    def __init__(self, app_name: str, deployment: str = ENGINE_DEPLOYMENT):
        import ray
        from ray import serve

        if not ray.is_initialized():
            raise AppNotFoundError(f"serve app {app_name!r}: not connected to a Ray cluster (ray.init first)")
        self.app_name, self.deployment = app_name, deployment
        apps = running_apps()
        listing = ", ".join(f"{n} ({s})" for n, s in sorted(apps.items())) or "none"
        if app_name not in apps:
            raise AppNotFoundError(f"no Serve app {app_name!r} runs on this Ray cluster; running apps: {listing}")
        deployments = serve.status().applications[app_name].deployments
        if deployment not in deployments:
            raise AppNotFoundError(f"Serve app {app_name!r} has no {deployment} deployment (not an eagle-serve app); "
                                   f"running apps: {listing}")
        self.handle = serve.get_deployment_handle(deployment, app_name=app_name)
        self._engine_config: dict[str, Any] | None = None
        self._board = None

    def engine_config(self) -> dict[str, Any]:
        """What the app's engine runs (model, served_model_name, dtype, device, engine module, draft,
        speculation, tp_size, max_model_len, chat_template, enable_prefix_caching, max_num_seqs,
        max_queued_requests, app_name), as a replica reports it: what a job records in its manifest and
        checks on resume, what it needs to load the matching tokenizer and size its window."""
        if self._engine_config is None:
            self._engine_config = dict(self.handle.engine_info.remote().result(timeout_s=300))
        return dict(self._engine_config)

    async def generate(self, request_id: str, prompt: str | list[int] | None, params: dict[str, Any],
                       priority: int = OFFLINE_PRIORITY, messages: list[dict] | None = None,
                       ) -> AsyncIterator[Any]:
        """The row's outputs as the engine streams them (cumulative: the last one is the result).

        Items are the engine's RequestOutputs, or one `cluster.replica_errors.Rejected` (the engine refused
        the row: an error row) or `Failed` (the engine failed it). A replica dying under the row is
        retried elsewhere, from scratch (outputs restart: keep only the last); raises
        `cluster.request_retry.PoisonRequestError` when two replicas died under it and `ReplicaLostError`
        when no attempt could finish. `messages` (chat rows) are rendered by the replica's template."""
        async for out in stream_outputs(self.handle, request_id, prompt, params, priority, messages,
                                        restartable=True, stream_interval=0):
            yield out

    def num_replicas(self) -> int:
        """Engine replicas of the app running now (Serve's view; autoscaling changes it)."""
        from ray import serve

        try:
            dep = serve.status().applications[self.app_name].deployments[self.deployment]
        except KeyError:
            return 0
        return int(dep.replica_states.get("RUNNING", 0))

    def replica_stats(self) -> dict[str, dict]:
        """Stats of every engine replica this process's router knows (about 1 s old; {} before the
        first row): queue depth, KV usage, torch threads, and the online/offline counters
        (offline_preemptions, offline_rows_preempted, offline_deferred_in_engine, ...)."""
        from cluster.router_state import live_replica_stats

        return live_replica_stats()

    @staticmethod
    def router_counters() -> dict[str, int]:
        """This process's routing counters: `offline_deferred` (rows held back for online work)."""
        from cluster.router_state import router_counters

        return router_counters()

    # ---- backlog for the autoscaler ----------------------------------------------------------
    def _backlog_board(self):
        if self._board is None:
            self._board = backlog.board(self.app_name, create=True)
        return self._board

    def report_backlog(self, job_id: str, queued_rows: int, ttl_s: float = backlog.DEFAULT_TTL_S) -> None:
        """This job still has `queued_rows` rows to send; counts toward scaling the app up (bounded by
        its `max_replicas`). Repeat it (every few seconds, as the number changes): a report expires
        after `ttl_s`, so a killed driver stops holding replicas."""
        self._backlog_board().report.remote(job_id, int(queued_rows), float(ttl_s))

    def clear_backlog(self, job_id: str) -> None:
        """The job sends no more rows (finished, cancelled, failed)."""
        import ray

        ray.get(self._backlog_board().clear.remote(job_id), timeout=30)
