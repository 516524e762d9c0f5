"""The RayJob's entrypoint is a real `eaglectl` command line that the CLI accepts.

Parsed with click exactly as `eaglectl` would (make_context parses and validates every option and
argument without running the command), plus a `--help` dry run. If `submit-job` is not registered
in `eaglectl.main:main`, these tests fail on purpose: the RayJob would fail on the cluster the same way.
"""
from __future__ import annotations

import shlex

import click
import pytest
import yaml
from click.testing import CliRunner

from eaglectl.main import main
from tests.deploy.examples import ROOT, SETUPS, committed_manifest_files, fresh


def _entrypoints():
    out = []
    for p in committed_manifest_files():
        out += [(str(p.relative_to(ROOT)), d["spec"]["entrypoint"])
                for d in yaml.safe_load_all(p.read_text()) if d and d["kind"] == "RayJob"]
    for s in SETUPS:
        if "rayjob.yaml" in fresh(s):
            out.append((f"fresh {s}/rayjob.yaml", yaml.safe_load(fresh(s)["rayjob.yaml"])["spec"]["entrypoint"]))
    return out


ENTRYPOINTS = _entrypoints()


def _submit_job() -> click.Command:
    cmd = main.get_command(click.Context(main), "submit-job")
    assert cmd is not None, ("`eaglectl submit-job` is not registered in eaglectl/main.py: every RayJob rendered by "
                             "`eaglectl deploy render` would fail on the cluster")
    return cmd


def test_every_setup_has_a_job():
    assert len(ENTRYPOINTS) >= 2 * len(SETUPS) >= 4


def test_eaglectl_is_the_console_script():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["eaglectl"] == "eaglectl.main:main"


def test_submit_job_help():
    r = CliRunner().invoke(main, ["submit-job", "--help"])
    assert r.exit_code == 0, r.output
    for flag in ("--output", "--model", "--replicas", "--tp-size", "--wait"):
        assert flag in r.output


@pytest.mark.parametrize("where,entrypoint", ENTRYPOINTS, ids=[w for w, _ in ENTRYPOINTS])
def test_entrypoint_parses_with_the_real_cli(where, entrypoint):
    argv = shlex.split(entrypoint)
    assert argv[:2] == ["eaglectl", "submit-job"], where
    cmd = _submit_job()
    ctx = cmd.make_context("submit-job", argv[2:])  # raises click.UsageError on anything it rejects
    assert ctx.params, where


@pytest.mark.parametrize("where,entrypoint", ENTRYPOINTS, ids=[w for w, _ in ENTRYPOINTS])
def test_entrypoint_settings_pass_the_job_config(where, entrypoint):
    """The submit-job command itself (registered or not) accepts the line and its values."""
    from eaglectl.jobs import submit_job
    from jobs.job_config import JobConfig

    params = submit_job.make_context("submit-job", shlex.split(entrypoint)[2:]).params
    assert params["wait"] is True
    if params.get("serve_app"):   # through the RayService's app: its cluster's dashboard (tests/deploy/test_fleet.py)
        assert params["address"].endswith("-head-svc:8265"), params["address"]
    else:                         # its own cluster: the head's own dashboard
        assert params["address"] == "http://127.0.0.1:8265"
    params["format"] = params.pop("fmt")
    params["stop"] = list(params["stop"]) or None
    for key in ("address", "job_id", "wait"):
        params.pop(key)
    cfg = JobConfig.from_options(**params)
    for given, resolved in ((params["input"], cfg.input), (params["output"], cfg.output)):
        if "://" in given:
            assert resolved.rstrip("/") == given.rstrip("/"), (given, resolved)   # a bucket URL travels as is
        else:
            assert resolved.startswith("/"), resolved


def test_a_bad_entrypoint_is_refused():
    with pytest.raises(click.UsageError):
        _submit_job().make_context("submit-job", ["/data/in.parquet", "--no-such-flag", "1"])
