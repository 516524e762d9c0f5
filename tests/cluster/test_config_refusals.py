"""Serve config files that were accepted, or crashed, before a config sweep: every one is now a
ConfigError naming the file and field, caught before Ray starts."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from cluster.config import ServeConfig
from cluster.config_base import ConfigError
from cluster.config_yaml import read_yaml


def _yaml(tmp_path, text: str, name: str = "serve.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("text, needle", [
    ("? [a]\n: 1\n", "a key must be a plain value, not a list or mapping"),     # was TypeError: unhashable
    ("model: " + "[" * 3000 + "]" * 3000 + "\n", "nested too deeply"),          # was RecursionError
    ("a: 1\na: 2\n", "duplicate key 'a'"),
])
def test_yaml_that_cannot_be_a_config_is_one_error_naming_the_file(tmp_path, text, needle):
    p = _yaml(tmp_path, text)
    with pytest.raises(ConfigError, match=needle) as e:
        read_yaml(p)
    assert str(p) in str(e.value)


def test_merge_keys_read_as_safe_load_reads_them(tmp_path):
    p = _yaml(tmp_path, "base: &b {max_tokens: 256, max_model_len: 1024}\nlimits: {<<: *b, max_model_len: 2048}\n")
    assert read_yaml(p)["limits"] == {"max_tokens": 256, "max_model_len": 2048}


@pytest.mark.parametrize("text, needle", [
    ("kubernetes: {}\nport: 9001\n", "port belongs under one of them"),          # served port 8000 before
    ("serve: {port: 9000}\nkubernets: {name: typo}\n", "kubernets belongs under one of them"),
])
def test_a_deploy_file_with_other_top_level_keys_is_refused_by_serve(tmp_path, text, needle):
    with pytest.raises(ConfigError, match=needle):
        ServeConfig.from_yaml(_yaml(tmp_path, text))


@pytest.mark.parametrize("fields, needle", [
    ({"draft": "none", "speculation": {"lookup": False}}, "speculation needs a draft head .* or speculation.lookup"),
    ({"draft": None, "speculation": {"lookup": False}}, "speculation needs a draft head"),
    ({"enable_prefix_caching": 0}, "enable_prefix_caching: expected true or false, got 0"),
    ({"enable_prefix_caching": "yes"}, "expected true or false, got 'yes'"),
    ({"speculation": {"lookup": "false"}}, "speculation.lookup: expected true or false"),
    ({"host": "http://x"}, "host: 'http://x' is not an IP address or a host name"),
    ({"host": "my host"}, "is not an IP address or a host name"),
])
def test_settings_that_could_only_fail_later_are_refused_now(fields, needle):
    with pytest.raises(ConfigError, match=needle):
        ServeConfig.from_dict(fields)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "localhost", "serve-0.eagle.svc.cluster.local"])
def test_hosts_that_bind_are_accepted(host):
    assert ServeConfig.from_dict({"host": host}).host == host


@pytest.mark.parametrize("make, needle", [
    (lambda d: d / "missing", "does not exist"),
    (lambda d: d, "is a folder, not a file"),
    (lambda d: (d / "bin").write_bytes(b"\xff\xfe\x00key") and d / "bin", "cannot be read as text"),
    (lambda d: (d / "empty").write_text("# no keys\n") and d / "empty", "none were found"),
])
def test_serve_checks_the_api_keys_file_before_ray_starts(tmp_path, monkeypatch, make, needle):
    import cluster.serve_app
    from eaglectl.serve import serve

    keys = make(tmp_path)
    monkeypatch.setattr(cluster.serve_app, "run_serve", lambda *a, **k: pytest.fail("Ray would start"))
    cfg = _yaml(tmp_path, f"draft: null\napi_keys_file: {keys}\n", "cfg.yaml")
    res = CliRunner().invoke(serve, ["--config", str(cfg)], env={"RAY_ADDRESS": ""})
    assert res.exit_code == 2 and f"api_keys_file: {keys}" in res.output or needle in res.output, res.output
    assert needle in res.output and "Traceback" not in res.output, res.output


def test_each_refused_field_names_its_line(tmp_path):
    """In a serve file, a deploy file, and a plain serve file given to the deploy renderer: the line
    of the refused value, or of the section holding a missing or unknown one."""
    from deploy.deploy_config import DeployConfig

    serve = _yaml(tmp_path, "model: tiny\nlimits:\n  max_model_len: 64\n  max_tokens: 0\ningress:\n  nmu_cpus: 1\n")
    with pytest.raises(ConfigError) as e:
        ServeConfig.from_yaml(serve)
    assert "line 4: limits.max_tokens: Input should be greater than or equal to 1" in str(e.value)
    assert "line 6: ingress.nmu_cpus: unknown field" in str(e.value)
    with pytest.raises(ConfigError) as e:
        DeployConfig.from_yaml(serve)          # its lines under `serve`
    assert "line 4: serve.limits.max_tokens:" in str(e.value) and "line 6: serve.ingress.nmu_cpus:" in str(e.value)
    deploy = _yaml(tmp_path, "serve:\n  model: tiny\nkubernetes:\n  name: eagle\n  workers:\n    tolerations:\n"
                             "      - key: a\n      - key: b\n        effect: Sometimes\n", name="deploy.yaml")
    with pytest.raises(ConfigError) as e:
        DeployConfig.from_yaml(deploy)
    assert "line 9: kubernetes.workers.tolerations.1.effect: Input should be" in str(e.value)
    merged = _yaml(tmp_path, "base: &d\n  max_tokens: 16\nlimits:\n  <<: *d\n  max_tokens: -5\n", name="merged.yaml")
    with pytest.raises(ConfigError) as e:   # the mapping's own key, not the anchor's it overrides
        ServeConfig.from_yaml(merged)
    assert "line 5: limits.max_tokens:" in str(e.value)


def test_an_alias_bomb_is_read_once_per_node(tmp_path):
    """Nine levels of nine aliases (387M leaves if walked as a tree) cost what the file's nodes cost."""
    text = "a0: &a0 [x]\n" + "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 10))
    doc = read_yaml(_yaml(tmp_path, text))
    assert doc.lines[("a9",)] == 10 and len(doc.lines) <= 10 + 10 * 9   # each key, each node's items once


# ---- engine: a module name, imported without a traceback or side effects -------------------------------
@pytest.mark.parametrize("text, needle", [
    ('engine: ".x"', r"'\.x' is not a dotted Python module name"),                  # was TypeError
    ('engine: "a b"', "is not a dotted Python module name"),
    ('engine: "x..y"', "is not a dotted Python module name"),
    ("engine: eagle_worker.class", "is not a dotted Python module name"),
    ("engine: 3", "engine: Input should be a valid string"),
    ("engine: this", "'this' is a Python standard-library module"),                  # printed the Zen of Python
    ("engine: os.path", "standard-library module"),
    ("engine: no_such_engine_module", "cannot import 'no_such_engine_module'"),
    ("engine: tests.cluster", "lacks choose_draft / resolve_draft"),
])
def test_an_engine_that_is_no_engine_module_is_a_config_error(tmp_path, capsys, text, needle):
    p = _yaml(tmp_path, text)
    with pytest.raises(ConfigError, match=needle) as e:
        ServeConfig.from_yaml(p)
    assert "engine:" in str(e.value) and str(p) in str(e.value)
    assert capsys.readouterr().out == ""          # nothing imported that prints


@pytest.mark.parametrize("body, needle", [
    ("raise RuntimeError('boom')", "importing 'broken_engine_mod' failed: RuntimeError: boom"),
    ("import sys\nsys.exit(3)", "importing 'broken_engine_mod' failed: SystemExit: 3"),
    ("1/0", "ZeroDivisionError"),
])
def test_an_engine_whose_import_fails_is_a_config_error(tmp_path, monkeypatch, body, needle):
    (tmp_path / "broken_engine_mod.py").write_text(body + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=rf"engine: 'broken_engine_mod' is not an engine module .*{needle}"):
        ServeConfig.from_yaml(_yaml(tmp_path, "engine: broken_engine_mod\n"))


def test_valid_engine_modules_still_load():
    assert ServeConfig.from_dict({"engine": "tests.cluster.fake_engine", "model": "fake", "draft": None}).engine == \
        "tests.cluster.fake_engine"
    assert ServeConfig.from_dict({"engine": "eagle_worker"}).engine == "eagle_worker"
