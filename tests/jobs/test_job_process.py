"""The CLI as users run it, in its own process with its own embedded Ray: kill -9 and resume, and
driver memory on a large input."""
from __future__ import annotations

import signal
import time

import pyarrow.parquet as pq
import pytest

from .conftest import cli, cli_popen, read_manifest, write_parquet

pytestmark = pytest.mark.slow  # the CLI in subprocesses, each with its own embedded Ray


def _committed(out):
    return sorted(out.glob("part-*.parquet")) if out.exists() else []


def test_sigkill_mid_job_then_rerun_has_every_id_once(tmp_path, tiny_model):
    n = 1000
    inp = write_parquet(tmp_path / "in.parquet", prompt=[f"the quick brown fox {i}" for i in range(n)])
    out = tmp_path / "in.out"
    args = ["submit-job", inp, "--model", tiny_model, "--draft", "none", "--max-tokens", "2",
            "--rows-per-file", "100", "--max-num-seqs", "32"]
    proc = cli_popen(*args)
    t0 = time.monotonic()
    while len(_committed(out)) < 3:                     # part-way: some files committed, more coming
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() - t0 < 180, "no progress"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    proc.stdout.close()
    before = pq.read_table(out, columns=["id"]).column("id").to_pylist()
    assert 0 < len(before) < n and len(set(before)) == len(before)

    res = cli(*args, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"job completed: {n}/{n} rows" in res.stdout
    ids = pq.read_table(out, columns=["id"]).column("id").to_pylist()
    assert len(ids) == n and set(ids) == {f"in.parquet:{i}" for i in range(n)}     # every id exactly once
    assert not list(out.glob(".*.tmp"))
    m = read_manifest(out)
    assert m["complete"] and m["runs"][0]["status"] == "running"                    # the killed run never finished
    assert m["runs"][-1]["skipped_already_done"] == len(before)


def test_driver_memory_does_not_grow_with_rows(tmp_path, tiny_model):
    n = 20_000
    inp = write_parquet(tmp_path / "big.parquet", prompt=[f"the lazy dog {i}" for i in range(n)],
                        id=[f"row-{i:06d}" for i in range(n)])
    res = cli("submit-job", inp, "--model", tiny_model, "--draft", "none", "--max-tokens", "1",
              "--replicas", "2", "--cpus-per-replica", "1", "--max-num-seqs", "128", "--rows-per-file", "2000",
              timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    m = read_manifest(tmp_path / "big.out")
    assert m["complete"] and m["rows"] == n
    run = m["runs"][-1]
    deciles = run["driver_rss_mb_by_decile"]     # RSS after 10%, 20%, ... 100% of the rows
    assert len(deciles) == 10, run
    # The second 10,000 rows must not raise the driver's memory over what the first 10,000 needed
    # (a window of rows in flight, one row group, 16 bytes per id), and the peak stays near the
    # level reached after the first 2,000 rows.
    assert max(deciles[5:]) - max(deciles[:5]) < 10, run
    assert run["driver_peak_rss_mb"] - deciles[0] < 25, run
