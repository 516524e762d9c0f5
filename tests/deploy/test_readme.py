"""deploy/README.md stays true: the metrics it tells users to watch exist, the files it names exist,
and its YAML snippets parse."""
from __future__ import annotations

import re

import pytest
import yaml

from tests.deploy.examples import DEPLOY, ROOT, SETUPS

README = (DEPLOY / "README.md").read_text()


def test_documents_both_setups():
    for setup in SETUPS:
        assert f"examples/{setup}/" in README


def test_metric_names_exist():
    pytest.importorskip("prometheus_client")
    from cluster.metrics import ServeMetrics

    exposed = set(re.findall(r"^# TYPE (\w+) ", ServeMetrics("m").render().decode(), re.M))
    documented = set(re.findall(r"\b(eagle_[a-z0-9_]+)", README))
    assert documented, "the README names no metric"
    known = exposed | {f"{n}_bucket" for n in exposed} | {f"{n}_sum" for n in exposed} | {f"{n}_count" for n in exposed}
    assert documented <= known, documented - known


def test_paths_exist():
    for path in set(re.findall(r"deploy/examples/[\w./-]+\.yaml", README)):
        assert (ROOT / path).is_file(), path


def test_yaml_snippets_parse():
    snippets = re.findall(r"```yaml\n(.*?)```", README, re.S)
    assert snippets
    for text in snippets:
        assert list(yaml.safe_load_all(text))
