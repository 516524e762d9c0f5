"""ServeConfig: YAML loading, validation messages, derived Serve options, API-key sources."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.config import ServeConfig
from cluster.config_base import ConfigError
from cluster.cpu_threads import engine_env, serve_env
from cluster.serve_app import app_builder, engine_deployment_options


def test_defaults_are_servable():
    cfg = ServeConfig()
    assert cfg.model_name == "gemma-3-270m" and cfg.replica_count_options() == {"num_replicas": 1}
    assert cfg.engine_kwargs() == dict(model="gemma-3-270m", dtype="float32", device="cpu", draft="auto",
                                       tp_size=1, max_num_seqs=64, enable_prefix_caching=True,
                                       offline_slowdown=0.25)
    assert not cfg.auth_enabled and cfg.resolve_api_keys() == frozenset()


def test_yaml_roundtrip(tmp_path):
    p = tmp_path / "serve.yaml"
    p.write_text("""
model: gemma-3-270m
served_model_name: gemma
tp_size: 2
placement_strategy: STRICT_PACK
resources_per_rank: {cpu: 2}
autoscaling: {min_replicas: 1, max_replicas: 4, target_ongoing_requests: 8}
limits: {max_model_len: 2048, max_tokens: 512, max_queued_requests: 8}
chat_template: "{{ messages }}"
""")
    cfg = ServeConfig.from_yaml(p)
    assert cfg.model_name == "gemma" and cfg.tp_size == 2
    assert cfg.replica_count_options()["autoscaling_config"]["max_replicas"] == 4
    assert cfg.engine_kwargs()["max_model_len"] == 2048 and cfg.engine_kwargs()["chat_template"] == "{{ messages }}"
    assert ServeConfig.from_yaml(_write(tmp_path, cfg.to_yaml())) == cfg


def _write(tmp_path, text):
    p = tmp_path / "again.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("yaml_text,needle", [
    ("tp_size: 0", "tp_size: Input should be greater than or equal to 1"),
    ("limits: {max_tokens: -3}", "limits.max_tokens:"),
    ("limits: {max_tokens: 4096, max_model_len: 1024}", "must be < max_model_len"),
    ("num_replicas: 2\nautoscaling: {max_replicas: 3}", "either num_replicas or autoscaling"),
    ("autoscaling: {min_replicas: 5, max_replicas: 2}", "min_replicas (5) > max_replicas (2)"),
    ("placement_strategy: SPREAD", "placement_strategy:"),
    ("ingress: {stream_interval: 0}", "ingress.stream_interval:"),
    ("offline_slowdown: -0.5", "offline_slowdown: Input should be greater than or equal to 0"),
    ("offline_slowdown: .nan", "offline_slowdown: Input should be a finite number"),
    ("offline_slowdown: lots", "offline_slowdown: Input should be a valid number"),
    ("offline_slowdown: yes", "offline_slowdown: expected a number, got true"),
    ("port: true", "port: expected a number, got true"),
    ("limits: {max_num_seqs: false}", "limits.max_num_seqs: expected a number, got false"),
    ("kv_cache_gb: .inf", "kv_cache_gb: Input should be a finite number"),
    ("resources_per_rank: {cpu: .inf}", "resources_per_rank.cpu: Input should be a finite number"),
    ("autoscaling: {max_replicas: 2, target_ongoing_requests: .inf}", "autoscaling.target_ongoing_requests: Input"),
    ("ingress: {num_cpus: .nan}", "ingress.num_cpus: Input should be a finite number"),
    ("app_name: ''", "app_name: String should have at least 1 character"),
    ("app_name: ' eagle'", "app_name: String should match pattern"),
    ("model: ''", "model: String should have at least 1 character"),
    ("engine: os", "engine: 'os' is not an engine module"),
    ("engine: no_such_engine_module", "engine: 'no_such_engine_module' is not an engine module"),
    ("offline_slowdown: 0.5\noffline_slowdown: 2", "duplicate key 'offline_slowdown'"),
    ("limits: {max_tokens: 8, max_tokens: 9}", "duplicate key 'max_tokens'"),
    ("device: cuda", "needs resources_per_rank.gpu: 1"),
    ("modle: typo", "modle: unknown field"),
    ("- just\n- a list", "expected a mapping"),
    ("model: [unclosed", "invalid YAML"),
])
def test_validation_errors_name_the_field(tmp_path, yaml_text, needle):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml_text)
    with pytest.raises(ConfigError) as ei:
        ServeConfig.from_yaml(p)
    assert needle in str(ei.value) and str(p) in str(ei.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="cannot read"):
        ServeConfig.from_yaml("/nonexistent/serve.yaml")


def test_api_key_sources(tmp_path, monkeypatch):
    keyfile = tmp_path / "keys"
    keyfile.write_text("# comment\nk-file  \n\nk-file2 # trailing comment\n")
    monkeypatch.setenv("EAGLE_KEYS", "k-env1, k-env2")
    cfg = ServeConfig(api_keys=["k-inline"], api_keys_env="EAGLE_KEYS", api_keys_file=str(keyfile))
    assert cfg.resolve_api_keys() == {"k-inline", "k-env1", "k-env2", "k-file", "k-file2"}
    with pytest.raises(ConfigError, match="not set"):
        ServeConfig(api_keys_env="EAGLE_NO_SUCH_VAR").resolve_api_keys()
    with pytest.raises(ConfigError, match="does not exist"):
        ServeConfig(api_keys_file=str(tmp_path / "missing")).resolve_api_keys()
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ConfigError, match="refusing to serve open"):
        ServeConfig(api_keys_file=str(tmp_path / "empty")).resolve_api_keys()


def test_deployment_options():
    cfg = ServeConfig(tp_size=2, placement_strategy="STRICT_PACK", resources_per_rank={"cpu": 3},
                      limits={"max_num_seqs": 8, "max_queued_requests": 4, "max_router_queue": 10},
                      autoscaling={"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 6})
    opts = engine_deployment_options(cfg)
    assert opts["placement_group_bundles"] == [{"CPU": 3.0}, {"CPU": 3.0}]
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    assert opts["ray_actor_options"] == {"num_cpus": 3.0, "num_gpus": 0,
                                         "runtime_env": {"env_vars": {**serve_env(), **engine_env()}}}
    # Serve's caller queue counts requests as queued until routed: off; the ingress admits
    # max_replicas x (max_num_seqs + max_queued_requests) + max_router_queue instead
    assert opts["max_ongoing_requests"] == 12 and opts["max_queued_requests"] == -1
    assert cfg.capacity == 3 * 12 and cfg.admission_limit == 3 * 12 + 10
    assert opts["autoscaling_config"]["target_ongoing_requests"] == 6 and "num_replicas" not in opts
    assert opts["request_router_config"]["request_router_class"] == "cluster.router.LoadAwareRouter"
    assert opts["request_router_config"]["request_router_kwargs"] == {"prefix_aware": True}   # follows the caching
    off = engine_deployment_options(ServeConfig(enable_prefix_caching=False))
    assert off["request_router_config"]["request_router_kwargs"] == {"prefix_aware": False}
    single = engine_deployment_options(ServeConfig())
    assert "placement_group_bundles" not in single and single["num_replicas"] == 1
    assert ServeConfig(num_replicas=2, limits={"max_num_seqs": 2, "max_queued_requests": 2,
                                               "max_router_queue": 1}).admission_limit == 2 * 4 + 1


def test_app_builder_validates_args():
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary  # what config files use

    app = call_user_app_builder_with_args_if_necessary(app_builder, {"model": "gemma-3-270m", "num_replicas": 2})
    assert type(app).__name__ == "Application"
    with pytest.raises(ConfigError, match="serve app args"):
        app_builder({"num_replicas": 0})


def test_speculation_settings():
    cfg = ServeConfig(draft="default", speculation={"tree": "chain", "depth": 3, "adaptive": False},
                      limits={"max_num_batched_tokens": 256})
    kw = cfg.engine_kwargs()
    assert kw["spec"] == {"draft": "default", "tree": "chain", "depth": 3, "top_k": 8, "num_draft_tokens": 16,
                          "adaptive": False, "lookup": True, "head_dtype": "target"}
    assert kw["max_num_batched_tokens"] == 256
    with pytest.raises(ConfigError, match="speculation needs a draft head"):
        ServeConfig.from_dict({"draft": None, "speculation": {"lookup": False}})
    assert ServeConfig.from_dict({"draft": None, "speculation": {"lookup": True}}).engine_kwargs()["spec"]["draft"] is None
    with pytest.raises(ConfigError, match="speculation.tree"):
        ServeConfig.from_dict({"draft": "default", "speculation": {"tree": "bushy"}})
    with pytest.raises(ConfigError, match="speculation.head_dtype"):
        ServeConfig.from_dict({"draft": "default", "speculation": {"head_dtype": "int8"}})


def test_engine_config_from_serve_config():
    from cluster.engine_settings import engine_config

    ec = engine_config(ServeConfig(draft="default", speculation={"tree": "static", "adaptive": False,
                                                                 "head_dtype": "float32"}))
    assert ec.spec.tree == "static" and ec.spec.draft == "default" and not ec.spec.adaptive
    assert ec.spec.head_dtype == "float32"
    assert engine_config(ServeConfig(limits={"max_model_len": 512})).max_model_len == 512


def test_offline_slowdown_reaches_the_engine_config_and_a_custom_engine_without_it_is_still_served(caplog):
    from cluster import engine_settings

    assert engine_settings.engine_config(ServeConfig(draft=None)).offline_slowdown == 0.25
    assert engine_settings.engine_config(ServeConfig(draft=None, offline_slowdown=None)).offline_slowdown is None
    assert engine_settings.engine_config(ServeConfig(draft=None, offline_slowdown=2)).offline_slowdown == 2
    fake = dict(engine="tests.cluster.fake_engine", model="fake", draft=None)
    with caplog.at_level("WARNING"):
        assert not hasattr(engine_settings.engine_config(ServeConfig(**fake, offline_slowdown=None)), "offline_slowdown")
        engine_settings.engine_config(ServeConfig(**fake))          # the default: nothing to say
        assert "offline_slowdown" not in caplog.text
        engine_settings.engine_config(ServeConfig(**fake, offline_slowdown=0.5))
    assert "offline_slowdown ignored: engine tests.cluster.fake_engine has no offline cap" in caplog.text


def test_prefix_caching_reaches_the_engine_config(caplog, monkeypatch):
    """`enable_prefix_caching` (on by default) is the engine's EngineConfig field; an engine module
    without the field is still served, and turning caching off there is logged."""
    import dataclasses
    from types import SimpleNamespace

    from cluster import engine_settings
    from eagle_worker.config import EngineConfig
    from tests.cluster import fake_engine

    assert ServeConfig.from_dict({"enable_prefix_caching": False}).engine_kwargs()["enable_prefix_caching"] is False
    if "enable_prefix_caching" in {f.name for f in dataclasses.fields(EngineConfig)}:
        assert engine_settings.engine_config(ServeConfig(draft=None, enable_prefix_caching=False)).enable_prefix_caching is False
        assert engine_settings.engine_config(ServeConfig(draft=None)).enable_prefix_caching is True
    fake = dict(engine="tests.cluster.fake_engine", model="fake", draft=None)
    assert engine_settings.engine_config(ServeConfig(**fake, enable_prefix_caching=False)).enable_prefix_caching is False

    @dataclasses.dataclass
    class OldConfig:   # an engine module from before prefix caching
        model: str = "fake"
        dtype: str = "float32"
        device: str = "cpu"
        draft: str | None = None
        tp_size: int = 1
        max_num_seqs: int = 64
        max_model_len: int = 512

    monkeypatch.setattr(engine_settings, "load_engine_module", lambda path: SimpleNamespace(
        EngineConfig=OldConfig, SpecConfig=fake_engine.SpecConfig))
    assert engine_settings.engine_config(ServeConfig(**fake)).model == "fake"
    assert "ignored" not in caplog.text
    engine_settings.engine_config(ServeConfig(**fake, enable_prefix_caching=False))
    assert "enable_prefix_caching: false ignored" in caplog.text
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        ServeConfig.from_dict({"enable_prefix_caching": "sometimes"})


def test_max_tokens_follows_a_small_context():
    assert ServeConfig(limits={"max_model_len": 512}).limits.max_tokens == 256
    assert ServeConfig(limits={"max_model_len": 4096}).limits.max_tokens == 1024
    assert ServeConfig(limits={"max_model_len": 512, "max_tokens": 500}).limits.max_tokens == 500


def test_example_config_loads():
    from tests.cluster.conftest import REPO

    cfg = ServeConfig.from_yaml(REPO / "cluster" / "serve.example.yaml")
    assert cfg.limits.max_tokens == 512 and cfg.resources_per_rank.cpu == 2


def test_speculation_with_auto_draft_on_a_model_without_head(tiny_model_dir):
    from cluster.engine_settings import engine_config

    ec = engine_config(ServeConfig(model=str(tiny_model_dir("llama")), speculation={"depth": 2}))
    assert ec.draft is None and ec.spec.lookup and ec.spec.depth == 2   # no head: prompt lookup alone
    ec = engine_config(ServeConfig(model=str(tiny_model_dir("llama")), speculation={"lookup": False}))
    assert ec.draft is None and ec.spec is None  # nothing to speculate with: plain decoding


def test_auto_draft_resolution():
    """One rule (the engine's `choose_draft`) on every path: the serve config, the job config, the
    engine itself; `auto` is the built-in head on every tensor-parallel size."""
    from eagle_worker.config import EngineConfig
    from jobs.job_config import JobConfig

    assert ServeConfig().resolved_draft == "default"
    assert ServeConfig(tp_size=2).resolved_draft == "default"      # the head runs beside a TP target
    assert ServeConfig(model="/models/x").resolved_draft is None
    assert ServeConfig(model="org/name").resolved_draft is None
    assert ServeConfig(draft="none").resolved_draft is None
    for model, tp in (("gemma-3-270m", 1), ("gemma-3-270m", 2), ("org/name", 2)):
        serve = ServeConfig(model=model, tp_size=tp).resolved_draft
        job = JobConfig(input="x.parquet", model=model, tp_size=tp).resolved_draft()
        assert serve == job == EngineConfig(model=model).draft, (model, tp)


def test_a_default_draft_for_a_model_without_one_is_refused_when_read():
    with pytest.raises(ValueError, match="draft: model 'org/name' has no built-in draft head"):
        ServeConfig(model="org/name", draft="default")


def test_local_serve_refuses_a_head_that_is_not_here(tmp_path):
    """`eaglectl serve` whose replicas run on this machine checks the head before starting Ray."""
    from click.testing import CliRunner

    from eaglectl.main import main

    path = tmp_path / "serve.yaml"
    path.write_text(f"draft: {tmp_path / 'no-such-head'}\n")
    result = CliRunner().invoke(main, ["serve", "--config", str(path)], env={"RAY_ADDRESS": ""})
    assert result.exit_code == 2, result.output
    assert "draft: draft head" in result.output and "no-such-head" in result.output and "is not a folder" in result.output


def test_colocation_is_where_the_app_has_one_engine_replica():
    base = dict(model="fake", engine="tests.cluster.fake_engine")
    assert ServeConfig(**base).colocated and ServeConfig(**base, num_replicas=1).colocated
    assert not ServeConfig(**base, num_replicas=2).colocated
    assert not ServeConfig(**base, autoscaling={"min_replicas": 1, "max_replicas": 1}).colocated
    assert not ServeConfig(**base, ingress={"num_replicas": 2}).colocated
    assert not ServeConfig(**base, ingress={"num_cpus": 0.5}).colocated
    assert not ServeConfig(**base, ingress={"colocate": False}).colocated
    one = ServeConfig(**base, limits={"max_num_seqs": 4, "max_queued_requests": 4})
    assert one.llm_server_max_ongoing == one.ingress.max_ongoing_requests == 1024   # it takes HTTP requests
    assert ServeConfig(**base, num_replicas=2, limits={"max_num_seqs": 4, "max_queued_requests": 4}
                       ).llm_server_max_ongoing == 8


@pytest.mark.parametrize("other", [{"num_replicas": 2}, {"autoscaling": {"max_replicas": 3}},
                                   {"ingress": {"colocate": True, "num_replicas": 2}},
                                   {"ingress": {"colocate": True, "num_cpus": 1}}])
def test_colocation_asked_where_it_cannot_be_is_refused_by_name(other):
    ingress = {"colocate": True, **other.pop("ingress", {})}
    with pytest.raises(ValidationError, match="ingress.colocate: the ingress shares a process"):
        ServeConfig(model="fake", engine="tests.cluster.fake_engine", ingress=ingress, **other)


@pytest.mark.parametrize("args,needle", [(["--port", "70000"], "port: Input should be less than or equal to 65535"),
                                         (["--host", ""], "host: String should have at least 1 character")])
def test_eaglectl_serve_validates_its_overrides_before_starting_anything(args, needle):
    from click.testing import CliRunner

    from eaglectl.serve import serve

    res = CliRunner().invoke(serve, args)
    assert res.exit_code == 2 and needle in res.output, res.output


def test_eaglectl_serve_at_an_address_where_nothing_listens_fails_at_once(monkeypatch):
    """ray.init would retry for minutes; the refused connect is the answer, one line, exit 2."""
    import ray
    from click.testing import CliRunner

    from eaglectl.serve import serve
    from tests.ray_cluster import free_ports

    monkeypatch.setattr(ray, "is_initialized", lambda: False)    # as in a fresh `eaglectl serve` process
    monkeypatch.setattr(ray, "init", lambda **kw: pytest.fail(f"ray.init reached: {kw}"))
    port = free_ports(1)[0]
    res = CliRunner().invoke(serve, ["--address", f"127.0.0.1:{port}"])
    assert res.exit_code == 2, res.output
    assert f"cannot reach the Ray cluster at '127.0.0.1:{port}': Connection refused" in res.output
