"""The default speculation is one rule (`default_spec`), and every front door gets it: the hybrid
with the model's built-in head, prompt lookup alone where the model has none, nothing for `none`."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from cluster.config import ServeConfig
from eagle_worker.config import EngineConfig
from eagle_worker.speculative.config import SpecConfig, default_spec

HYBRID = SpecConfig(draft="default", lookup=True, adaptive=True)


def test_the_rule():
    assert default_spec("auto", "gemma-3-270m") == HYBRID
    assert default_spec("default", "gemma-3-270m") == HYBRID
    assert default_spec("auto", "/models/no-head") == SpecConfig(draft=None, lookup=True, adaptive=True)
    assert default_spec("/heads/mine", "gemma-3-270m") == SpecConfig(draft="/heads/mine", lookup=True)
    assert all(default_spec(off, "gemma-3-270m") is None for off in (None, "", "none"))


def test_llm_door(tiny_model_dir):
    """`LLM(...)` builds `EngineConfig(...)`: the same rule, and the engine runs what it says."""
    from eagle_worker import LLM

    assert EngineConfig().spec == HYBRID and EngineConfig().draft == "default"
    assert EngineConfig(draft=None).spec is None and EngineConfig(draft="none").spec is None
    assert EngineConfig(spec=None).spec is None and EngineConfig(spec=None).draft is None   # `spec: null`: off
    with pytest.raises(ValueError, match="EngineConfig.spec"):
        EngineConfig(spec="hybrid")
    llm = LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=64, block_size=4)   # no built-in head
    assert llm.engine.config.spec == default_spec("auto", str(tiny_model_dir("llama")))
    worker = llm.engine.worker
    assert worker.head is None and worker.spec.lookup and worker.spec.adaptive


def test_generate_door(monkeypatch):
    import eagle_worker
    from eaglectl.generate import generate

    seen = []

    class Stop(Exception):
        pass

    def fake_llm(**kw):
        seen.append(kw["spec"])
        raise Stop

    monkeypatch.setattr(eagle_worker, "LLM", fake_llm)
    CliRunner().invoke(generate, ["--prompt", "hi"])
    CliRunner().invoke(generate, ["--prompt", "hi", "--draft", "none"])
    CliRunner().invoke(generate, ["--prompt", "hi", "--num-draft-tokens", "8"])
    assert seen == [HYBRID, None, SpecConfig(draft="default", num_draft_tokens=8)]


def test_serve_door():
    from cluster.engine_settings import engine_config

    assert engine_config(ServeConfig()).spec == HYBRID
    assert engine_config(ServeConfig(draft=None)).spec is None
    assert engine_config(ServeConfig(speculation={"num_draft_tokens": 8})).spec == SpecConfig(
        draft="default", num_draft_tokens=8)
    assert engine_config(ServeConfig(speculation={"lookup": False})).spec == SpecConfig(draft="default", lookup=False)


@pytest.mark.parametrize("draft, want", [("auto", HYBRID), ("none", None)])
def test_submit_job_door(draft, want):
    from cluster.engine_settings import engine_config
    from jobs.job_config import JobConfig
    from jobs.replica_pool import serve_config

    cfg = JobConfig(input="prompts.parquet", draft=draft)
    assert engine_config(serve_config(cfg, 1.0)).spec == want
