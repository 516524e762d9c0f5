"""Tensor-parallel groups: ranks placed in one placement group form a gloo group that all-reduces."""
from __future__ import annotations

import pytest

from cluster.config import ServeConfig
from cluster.tp_group import TPGroup

FAKE = "tests.cluster.fake_engine"


def test_missing_engine_hook_is_a_clear_error():
    with pytest.raises(NotImplementedError, match="run_tp_worker"):
        TPGroup.create(ServeConfig(engine=FAKE, tp_size=2))


@pytest.mark.parametrize("world,strategy", [(2, "STRICT_PACK"), (3, "PACK")])
def test_group_forms_in_a_placement_group(ray_cluster, world, strategy):
    ray = ray_cluster
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cfg = ServeConfig(engine=FAKE, tp_size=world, placement_strategy=strategy, resources_per_rank={"cpu": 0.25})

    @ray.remote
    class Rank0:  # stands in for the Serve replica, which Serve places in bundle 0
        def __init__(self, config):
            self.group = TPGroup.create(config, require_engine_hook=False)

        def selftest(self):
            return self.group.selftest()

        def health(self):
            self.group.check_health()
            return True

        def shutdown(self):
            self.group.shutdown()

    pg = placement_group([cfg.resources_per_rank.bundle()] * world, strategy=strategy)
    ray.get(pg.ready(), timeout=60)
    try:
        rank0 = Rank0.options(num_cpus=0.25, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=0)).remote(cfg)
        expected = world * (world + 1) / 2
        assert ray.get(rank0.selftest.remote(), timeout=120) == [expected] * world
        assert ray.get(rank0.health.remote(), timeout=60)
        ray.get(rank0.shutdown.remote(), timeout=60)
        ray.kill(rank0)
    finally:
        remove_placement_group(pg)


def test_tensor_parallel_replica_serves_the_same_text(deploy, tiny_model_dir):
    """A tp_size=2 replica (rank 0 = the Serve replica, rank 1 = a TPRankWorker in the replica's
    placement group, gloo) gives the greedy text of a tp_size=1 replica."""
    def cfg(name, tp):
        return ServeConfig(model=str(tiny_model_dir("gemma3")), served_model_name="tiny", app_name=name, tp_size=tp,
                           placement_strategy="STRICT_PACK", num_replicas=1, resources_per_rank={"cpu": 0.5},
                           kv_cache_gb=0.01, limits={"max_model_len": 128, "max_tokens": 16})
    single, sharded = deploy(cfg("tp1", 1), "/tp1"), deploy(cfg("tp2", 2), "/tp2")
    for prompt in ["The quick brown fox", "def add(a, b):"]:
        kw = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        want = single.client.completions.create(**kw).choices[0].text
        assert sharded.client.completions.create(**kw).choices[0].text == want
        assert "".join(c.choices[0].text for c in sharded.client.completions.create(stream=True, **kw)) == want
