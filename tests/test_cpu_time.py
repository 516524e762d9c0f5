"""tests/cpu_time.py, the plugin that says where the suite's time goes, measures what it says."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.cpu_time import busy_cpu_seconds

REPO = Path(__file__).resolve().parents[1]


def test_one_line_per_test_with_its_wall_and_the_machines_busy_cpu(tmp_path):
    (tmp_path / "test_inner.py").write_text(
        "import time\n"
        "def test_spins():\n    end = time.perf_counter() + 0.5\n    while time.perf_counter() < end: pass\n"
        "def test_sleeps():\n    time.sleep(0.5)\n")
    out = tmp_path / "times.jsonl"
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.cpu_time", "-p", "no:cacheprovider",
                          str(tmp_path / "test_inner.py")], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO), "EAGLE_CPU_TIME_OUT": str(out)})
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {r["test"].split("::")[-1]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"test_spins", "test_sleeps"}
    for r in rows.values():
        assert 0.5 <= r["wall_s"] < 30, r
    if busy_cpu_seconds() is not None:          # Linux: the spinning test kept a core busy, the sleeping one did not
        assert rows["test_spins"]["cpu_s"] >= 0.4, rows
        assert rows["test_sleeps"]["cpu_s"] < rows["test_spins"]["cpu_s"], rows
