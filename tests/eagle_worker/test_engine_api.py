"""The engine contract (eagle_worker/engine_api.py): eagle_worker and the cluster tests' fake engine
both provide it, so a method renamed or a parameter added on one side fails here, not in a replica."""
from __future__ import annotations

import inspect

import pytest

from eagle_worker.engine_api import (
    ENGINE_ATTRS,
    ENGINE_METHODS,
    MODULE_NAMES,
    STATS_KEYS,
    Engine,
    load_engine_module,
    signature_mismatches,
)

MODULES = ["eagle_worker", "tests.cluster.fake_engine"]


def test_contract_lists_what_the_fleet_calls():
    assert set(ENGINE_METHODS) == {"add_request", "abort", "step", "has_unfinished_requests", "stats",
                                   "apply_chat_template", "shutdown", "keep_alive"}
    assert ENGINE_ATTRS == ("max_model_len",)
    assert set(MODULE_NAMES) == {"LLMEngine", "EngineConfig", "SamplingParams", "SpecConfig", "choose_draft",
                                 "resolve_draft", "init_tensor_parallel", "run_tp_worker", "load_prompt_tokenizer"}


@pytest.mark.parametrize("path", MODULES)
def test_engine_modules_conform(path):
    mod = load_engine_module(path)
    assert signature_mismatches(mod.LLMEngine, Engine) == []
    assert list(inspect.signature(mod.init_tensor_parallel).parameters) == ["rank", "world_size"]
    if mod.run_tp_worker is not None:
        assert len(inspect.signature(mod.run_tp_worker).parameters) == 1
    ec = mod.EngineConfig(model="any", draft=None)
    assert ec.draft is None and ec.spec is None
    assert mod.SamplingParams(max_tokens=4, temperature=0.0).max_tokens == 4
    with pytest.raises(ValueError):
        mod.SamplingParams(max_tokens=0)


def test_eagle_worker_exports_its_tp_loop():
    from eagle_worker.parallel import init_tensor_parallel
    from eagle_worker.tp_worker import run_tp_worker

    mod = load_engine_module("eagle_worker")
    assert (mod.run_tp_worker, mod.init_tensor_parallel) == (run_tp_worker, init_tensor_parallel)


def _instances(tiny_model_dir):
    from eagle_worker import EngineConfig, LLMEngine
    from tests.cluster import fake_engine

    yield fake_engine.LLMEngine(fake_engine.EngineConfig())
    yield LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), draft="none", block_size=4, num_kv_blocks=32))


def test_engine_instances_conform(tiny_model_dir):
    for engine in _instances(tiny_model_dir):
        assert isinstance(engine, Engine)
        assert signature_mismatches(engine, Engine) == []
        assert isinstance(engine.max_model_len, int) and engine.max_model_len > 0
        assert set(STATS_KEYS) <= set(engine.stats())
        assert not engine.has_unfinished_requests()
        engine.shutdown()


class _Drifted:
    max_model_len = 8

    def add_request(self, request_id, prompt, params, priority, deadline):  # priority lost its default
        pass

    def abort(self, rid):
        pass

    def step(self):
        return []

    def has_unfinished_requests(self):
        return False

    def stats(self):
        return {}

    def apply_chat_template(self, messages):
        return ""


def test_drift_is_reported():
    problems = signature_mismatches(_Drifted, Engine)
    assert not isinstance(_Drifted(), Engine)  # no shutdown
    assert "shutdown: missing" in problems
    assert any(p.startswith("abort: parameter 1") for p in problems)
    assert any("'priority' needs a default" in p for p in problems)
    assert any(p.startswith("add_request: extra parameter deadline") for p in problems)


def test_a_module_off_the_contract_is_refused():
    with pytest.raises(TypeError, match="lacks .*SpecConfig"):
        load_engine_module("tests.eagle_worker.test_engine_api")
