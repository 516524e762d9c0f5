"""One fleet for online and offline, without a cluster: thread counts, the fail-fast placement check,
the online/offline counters of a replica, and the backlog-aware autoscaling policy."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.autoscale import BACKLOG_METRIC, offline_backlog_policy
from cluster.config import ServeConfig
from cluster.cpu_threads import ENGINE_MALLOC_ENV, SERVE_STREAMING_ENV, auto_threads, cgroup_cpu_limit, rank_threads, serve_env
from cluster.placement import InsufficientResourcesError, check_fits
from cluster.priority_stats import PriorityStats


# ---- threads ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("cores,cpu,node_cpus,ranks,want", [
    (2, 1, 2, 1, 2),        # the default config on a laptop: one replica, every core
    (8, 1, 8, 1, 8),
    (2, 1, 2, 2, 1),        # two replicas share two cores
    (16, 1, 16, 4, 4),      # four replicas packed on a 16-core node
    (16, 4, 16, 8, 4),      # eight replicas asked for, but only four fit on the node at cpu 4
    (2, 0.25, 8, 2, 1),     # fractional reservations on an oversubscribed test cluster
    (2, 2, 2, 1, 2),
    (4, 8, 8, 1, 4),        # a reservation above the cores: never more threads than cores
])
def test_auto_threads(cores, cpu, node_cpus, ranks, want):
    assert auto_threads(cores, cpu, node_cpus, ranks) == want


def test_threads_setting_wins_and_plain_actors_keep_their_reservation():
    cfg = ServeConfig(resources_per_rank={"cpu": 1, "threads": 3})
    assert rank_threads(cfg, under_serve=True) == 3 and rank_threads(cfg, under_serve=False) == 3
    assert rank_threads(ServeConfig(resources_per_rank={"cpu": 2}), under_serve=False) == 2   # a job's own replicas


def test_serve_processes_take_the_streaming_fast_path_unless_told_otherwise(monkeypatch):
    from cluster.serve_app import build_app, engine_deployment_options

    for k in SERVE_STREAMING_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    env = engine_deployment_options(ServeConfig())["ray_actor_options"]["runtime_env"]["env_vars"]
    streaming = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
    assert env == {**streaming, **ENGINE_MALLOC_ENV}   # the engine's process: malloc keeps large blocks too
    assert "OMP_WAIT_POLICY" not in env          # libgomp's default: spin a little between ops
    ingress = build_app(ServeConfig(ingress={"colocate": False}))._bound_deployment
    assert ingress.ray_actor_options["runtime_env"]["env_vars"] == streaming
    colocated = build_app(ServeConfig())._bound_deployment   # the ingress in the engine's process: both
    assert colocated.ray_actor_options["runtime_env"]["env_vars"] == {**streaming, **ENGINE_MALLOC_ENV}
    monkeypatch.setenv("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "1")   # the operator's choice is kept
    assert serve_env()["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "1"


def test_a_cgroup_cpu_quota_caps_the_cores(tmp_path):
    """A pod's CPU limit is a CFS quota: its affinity still shows every core of the node."""
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("250000 100000\n")
    assert cgroup_cpu_limit(str(v2)) == 3
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(str(v2)) is None
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("200000")
    (v1 / "cpu.cfs_period_us").write_text("100000")
    assert cgroup_cpu_limit(str(tmp_path / "v1")) == 2
    (v1 / "cpu.cfs_quota_us").write_text("-1")
    assert cgroup_cpu_limit(str(tmp_path / "v1")) is None
    assert cgroup_cpu_limit(str(tmp_path / "none")) is None


# ---- placement ---------------------------------------------------------------------------------------
ONE_NODE_2CPU = [{"CPU": 2.0}]


def test_replicas_reserving_every_cpu_start_because_the_ingress_reserves_none():
    check_fits(ServeConfig(resources_per_rank={"cpu": 2}), ONE_NODE_2CPU)
    check_fits(ServeConfig(), ONE_NODE_2CPU)


@pytest.mark.parametrize("cfg,nodes,message", [
    (dict(resources_per_rank={"cpu": 2}, ingress={"num_cpus": 0.1}), ONE_NODE_2CPU, "missing CPU 0.1 overall"),
    (dict(num_replicas=3), ONE_NODE_2CPU, "missing CPU 1 overall"),
    (dict(resources_per_rank={"cpu": 3}), [{"CPU": 2.0}, {"CPU": 2.0}], "no node has room for replica 0"),
    (dict(device="cuda", resources_per_rank={"cpu": 1, "gpu": 1}), [{"CPU": 8.0}], "missing GPU 1"),
    (dict(tp_size=2, placement_strategy="STRICT_PACK", resources_per_rank={"cpu": 2}), [{"CPU": 2.0}, {"CPU": 2.0}],
     "STRICT_PACK"),
    (dict(autoscaling={"min_replicas": 2, "max_replicas": 4}), [{"CPU": 1.0}], "starts 2 replica"),
])
def test_what_can_never_be_scheduled_fails_with_what_is_missing(cfg, nodes, message):
    with pytest.raises(InsufficientResourcesError, match=message) as e:
        check_fits(ServeConfig(**cfg), nodes)
    assert "resources_per_rank.threads" in str(e.value)


def test_autoscaling_maximum_need_not_fit_now_and_the_check_can_be_skipped(monkeypatch):
    check_fits(ServeConfig(autoscaling={"min_replicas": 1, "max_replicas": 8}), ONE_NODE_2CPU)
    monkeypatch.setenv("EAGLE_SERVE_SKIP_RESOURCE_CHECK", "1")
    check_fits(ServeConfig(num_replicas=9), ONE_NODE_2CPU)


# ---- online/offline counters of a replica ------------------------------------------------------------
def _out(rid, finished=False, preemptions=0):
    return SimpleNamespace(request_id=rid, finished=finished, metrics={"num_preemptions": preemptions})


def test_priority_stats_count_preempted_and_deferred_offline_rows():
    st = PriorityStats()
    st.added("row-1", 1)
    st.added("row-2", 1)
    st.output(_out("row-1"))                 # row-1 runs, row-2 waits
    st.added("chat", 0)
    st.output(_out("chat"))                  # the younger online request got its first token first
    st.output(_out("chat", finished=True))
    st.output(_out("row-2", finished=True))
    st.output(_out("row-1", finished=True, preemptions=2))
    assert st.snapshot() == {"online_finished": 1, "offline_finished": 2, "online_preemptions": 0,
                             "offline_preemptions": 2, "offline_rows_preempted": 1, "offline_deferred_in_engine": 1}
    st.added("late-row", 1)                  # added after the online one: not deferred for it
    st.output(_out("late-row", finished=True))
    assert st.snapshot()["offline_deferred_in_engine"] == 1


# ---- the autoscaling policy --------------------------------------------------------------------------
def _ctx(ongoing, backlog=None, current=1, target=2.0):
    metrics = {} if backlog is None else {BACKLOG_METRIC: {"r1": backlog, "r2": backlog}}
    return SimpleNamespace(aggregated_metrics=metrics, total_num_requests=ongoing, current_num_replicas=current,
                           target_num_replicas=current, config=SimpleNamespace(get_target_ongoing_requests=lambda: target))


def test_policy_is_serves_rule_plus_the_backlog():
    assert offline_backlog_policy(_ctx(4))[0] == 2             # Serve's rule: ongoing / target
    assert offline_backlog_policy(_ctx(4, backlog=0))[0] == 2
    assert offline_backlog_policy(_ctx(2, backlog=100))[0] == 51   # Serve bounds it by max_replicas
    assert offline_backlog_policy(_ctx(0, backlog=0, current=3))[0] == 0   # job done: shrink (to min_replicas)


def test_prometheus_shows_offline_work_making_way():
    from cluster.metrics import ServeMetrics

    st = {"online_finished": 3, "offline_finished": 9, "offline_preemptions": 4, "offline_rows_preempted": 2,
          "offline_deferred_in_engine": 5, "torch_threads": 2, "num_preemptions_by_priority": {"1": 4}}
    text = ServeMetrics("m").render({"r1": st}).decode()
    for line in ('eagle_replica_offline_preemptions_total{model="m",replica="r1"} 4.0',
                 'eagle_replica_offline_rows_preempted_total{model="m",replica="r1"} 2.0',
                 'eagle_replica_offline_deferred_total{model="m",replica="r1"} 5.0',
                 'eagle_replica_engine_preemptions_total{model="m",priority="1",replica="r1"} 4.0',
                 'eagle_replica_torch_threads{model="m",replica="r1"} 2.0',
                 'eagle_router_offline_deferred_total{model="m"}'):
        assert line in text, line
