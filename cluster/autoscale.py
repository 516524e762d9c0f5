"""The engine deployment's Serve autoscaling policy: Serve's own rule, plus the jobs' queued rows.

Serve's default policy sizes a deployment as ongoing requests / `target_ongoing_requests`. A job
sending its rows through the app (cluster/app_client.py) keeps only a window of rows in flight, so
on that rule a 100 000-row job looks like a few dozen requests and never grows the fleet. Each job
driver therefore reports the rows it still has to send (`AppClient.report_backlog`, kept on the
app's BacklogBoard, cluster/backlog.py); every engine replica passes the board's total to Serve as
the custom autoscaling metric `offline_backlog` (`EngineReplica.record_autoscaling_stats`), and this
policy counts those rows as ongoing requests:

    desired = (ongoing requests + offline backlog) / target_ongoing_requests

Serve then applies `min_replicas`/`max_replicas` (so a job grows the app at most to max_replicas),
`upscale_delay_s`/`downscale_delay_s` and the scaling factors, as for its default policy. When the
job is done (or its driver dies: reports expire) the backlog is 0 and the app shrinks back after
`downscale_delay_s`.

Serve pickles this function by value into its controller (Ray 2.60 `AutoscalingPolicy`), so the
module imports nothing of the project.
"""
from __future__ import annotations

BACKLOG_METRIC = "offline_backlog"
POLICY = "cluster.autoscale:offline_backlog_policy"


def backlog_of(ctx) -> float:
    """The queued offline rows the replicas last reported (each reports the app's total: the max)."""
    try:
        per_replica = (ctx.aggregated_metrics or {}).get(BACKLOG_METRIC) or {}
    except Exception:   # no replica has reported custom metrics yet
        return 0.0
    return max((float(v) for v in per_replica.values()), default=0.0)


def desired_replicas(ongoing: float, backlog: float, target: float, current: int) -> float:
    """Serve's rule (ongoing / target) with the backlog counted as ongoing requests."""
    if current == 0 and ongoing + backlog <= 0:
        return 0.0
    return (ongoing + backlog) / max(target, 1e-9)


def offline_backlog_policy(ctx):
    """Serve custom autoscaling policy (`AutoscalingConfig.policy`): (replicas wanted, policy state)."""
    backlog = backlog_of(ctx)
    if ctx.current_num_replicas == 0 and backlog <= 0 and ctx.total_num_requests <= 0:
        return ctx.target_num_replicas, {}
    desired = desired_replicas(float(ctx.total_num_requests), backlog,
                               float(ctx.config.get_target_ongoing_requests()), ctx.current_num_replicas)
    return desired, {"offline_backlog": backlog, "desired_unbounded": desired}
