"""The Ray Serve request-router API that `cluster/router.py` builds on is still there, with the same shape.

`LoadAwareRouter` subclasses `FIFOMixin` + `RequestRouter` (an alpha API) and overrides, or calls,
some of their private methods (`_fulfill_next_pending_request` reorders FIFOMixin's private queue
with the same bookkeeping calls). Those move between Ray releases -- the names it relies on
appeared in 2.60 -- hence the pin in pyproject.toml. When Ray is upgraded, this test says exactly
what moved instead of a replica failing at its first saturated moment.
"""
from __future__ import annotations

import dataclasses
import inspect

import pytest
from ray.serve import request_router

from cluster.router import LoadAwareRouter

PUBLIC = ["FIFOMixin", "PendingRequest", "ReplicaID", "RequestRouter", "RunningReplica"]
# (base class name, method) for every method LoadAwareRouter overrides
OVERRIDDEN = [
    ("RequestRouter", "initialize_state"),
    ("RequestRouter", "choose_replicas"),
    ("RequestRouter", "on_request_routed"),
    ("RequestRouter", "on_request_completed"),
    ("RequestRouter", "on_replica_actor_died"),
    ("FIFOMixin", "_fulfill_next_pending_request"),
]
# private RequestRouter helpers our `_fulfill_next_pending_request` calls, with their parameters
CALLED = {
    "_cancel_routing_task_for_pending_request": ["pending_request"],
    "_record_queue_wait_time": ["pending_request"],
    "_remove_pending_request_from_indices": ["pending_request"],
    "_get_pending_request_matching_internal_request_id": ["request_metadata"],
}


@pytest.mark.parametrize("name", PUBLIC)
def test_public_names_exist(name):
    assert hasattr(request_router, name), f"ray.serve.request_router.{name} is gone"


def _params(fn) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("base, method", OVERRIDDEN, ids=[m for _, m in OVERRIDDEN])
def test_overridden_methods_exist_on_the_base_with_compatible_signatures(base, method):
    base_fn = getattr(getattr(request_router, base), method, None)
    assert base_fn is not None, f"{base}.{method} is gone: LoadAwareRouter.{method} overrides nothing"
    ours = getattr(LoadAwareRouter, method)
    assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(base_fn), method
    theirs = _params(base_fn)
    mine = _params(ours)
    if method == "initialize_state":  # Serve passes request_router_kwargs as keywords
        assert [p.kind for p in theirs] == [inspect.Parameter.VAR_KEYWORD]
        assert all(p.kind == inspect.Parameter.KEYWORD_ONLY or p.default is not inspect.Parameter.empty
                   or p.kind == inspect.Parameter.VAR_KEYWORD for p in mine)
        return
    assert [p.name for p in mine] == [p.name for p in theirs], f"{base}.{method}{inspect.signature(base_fn)}"
    for m, t in zip(mine, theirs):  # optional there -> optional here
        assert t.default is inspect.Parameter.empty or m.default is not inspect.Parameter.empty, (method, m.name)


@pytest.mark.parametrize("method", sorted(CALLED))
def test_private_helpers_we_call_exist(method):
    fn = getattr(request_router.RequestRouter, method, None)
    assert fn is not None, f"RequestRouter.{method} is gone (cluster/router.py calls it)"
    assert [p.name for p in _params(fn)] == CALLED[method]


def test_state_and_fields_we_read_exist():
    rr = request_router.RequestRouter
    # FIFOMixin's queue lives on the router (created in RequestRouter.__init__)
    assert "self._pending_requests_to_fulfill" in inspect.getsource(rr.__init__)
    assert isinstance(inspect.getattr_static(rr, "replica_queue_len_cache"), property)
    for prop in ("routing_stats", "replica_id", "max_ongoing_requests"):
        assert isinstance(inspect.getattr_static(request_router.RunningReplica, prop, None), property), prop
    fields = {f.name for f in dataclasses.fields(request_router.PendingRequest)}
    assert {"future", "args", "kwargs"} <= fields   # args: (request id, prompt, ...) of a submit call
    assert isinstance(inspect.getattr_static(rr, "curr_replicas"), property)   # prefix memories follow it
