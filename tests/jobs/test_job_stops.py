"""How a job ends when it is stopped or its output does not add up: cancelled (not failed) for a
SIGTERM that lands while the driver's Ray starts, and never exit 0 on an output its manifest calls
incomplete. No Ray: `ray.init` and `run_job` are stood in for."""
from __future__ import annotations

import signal

import pytest

from jobs.job_config import JobConfig

from .conftest import read_manifest, write_parquet


def test_sigterm_while_ray_starts_cancels_the_job(tmp_path, tiny_model, monkeypatch):
    """ray.init installs a SIGTERM handler of its own (sys.exit(15)) before the job's is back: the
    job ended `failed` with `SystemExit: 15`, exit 15, where a SIGTERM at any other time cancels it."""
    import ray

    from jobs.runner import run_job

    def init_interrupted(*args, **kwargs):
        raise SystemExit(signal.SIGTERM)              # Ray's handler, as `job cancel` signals

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init_interrupted)
    inp = write_parquet(tmp_path / "in.parquet", prompt=["a", "b"])
    with pytest.raises(KeyboardInterrupt):
        run_job(JobConfig(input=str(inp), model=tiny_model, draft="none", max_tokens=2))
    m = read_manifest(tmp_path / "in.out")
    assert m["status"] == "cancelled" and m["error"] is None and m["runs"][-1]["stopped_by"] == "SIGTERM"


def test_an_output_the_manifest_calls_incomplete_is_never_exit_0(tmp_path, monkeypatch, capsys):
    import jobs.runner
    from jobs.driver import EXIT_WITH_ERRORS, drive

    manifest = {"status": "completed", "complete": False, "rows": 103, "input_rows": 100, "error_rows": 0,
                "unreadable_rows": 0, "duplicate_ids_skipped": 0, "output": "o", "runs": [{}]}
    monkeypatch.setattr(jobs.runner, "run_job", lambda cfg, ray_address=None: manifest)
    inp = write_parquet(tmp_path / "in.parquet", prompt=["a"])
    assert drive(JobConfig(input=str(inp), model="m", draft="none"), "local") == EXIT_WITH_ERRORS
    assert "the output holds 103 rows for 100 input rows" in capsys.readouterr().out
    monkeypatch.setitem(manifest, "complete", True)
    assert drive(JobConfig(input=str(inp), model="m", draft="none"), "local") == 0
