"""Where the suite's time goes: `python -m pytest -p tests.cpu_time` appends one JSON line per test
(setup, call and teardown together) to $EAGLE_CPU_TIME_OUT (default `cpu_time.jsonl`): its wall
seconds and the machine's busy CPU seconds meanwhile, read from /proc/stat. Machine-wide on purpose:
Ray's GCS, raylets, workers and Serve replicas are not this process's children, so neither
`time` nor `resource.getrusage` counts them. Linux only (elsewhere `cpu` is null).
"""
from __future__ import annotations

import json
import os
import time

import pytest

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def busy_cpu_seconds() -> float | None:
    """CPU seconds every core has spent busy since boot (user, nice, system, irq, softirq)."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq) / _TICKS


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    wall, cpu = time.perf_counter(), busy_cpu_seconds()
    yield
    end = busy_cpu_seconds()
    row = {"test": item.nodeid, "wall_s": round(time.perf_counter() - wall, 2),
           "cpu_s": None if cpu is None or end is None else round(end - cpu, 2)}
    with open(os.environ.get("EAGLE_CPU_TIME_OUT", "cpu_time.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
