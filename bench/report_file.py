"""The benchmarks' JSON reports: checked before a run, written whole after it.

A benchmark takes minutes; a `--json` path that cannot be written (its folder is a file, it is a
folder itself) must be refused before it starts, not found once the results exist. The write is
atomic (a temp file in the same folder, then `os.replace`): a reader, or a run cut short, sees the
old report or the new one, never half of one.
"""
from __future__ import annotations

import json
import os
import secrets
from pathlib import Path


def check_writable(path: str | Path) -> None:
    """ValueError unless `path` can be (re)written as a file: not a folder, its folder creatable and
    writable (probed, then undone: the check leaves nothing behind)."""
    from eagle_worker.training.preflight import check_folder

    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{path} is a folder; give a file path for the JSON report")
    check_folder("folder", p.parent)


def write_json(path: str | Path, report) -> None:
    """`report` as indented JSON at `path` (folders made as needed), atomically; values JSON has no
    type for (a Path, a numpy number) as their str, so no result is lost to a type."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:       # "x": the umask's permissions, as write_text gave
            f.write(json.dumps(report, indent=2, default=str) + "\n")
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def run_meta() -> dict:
    """What a report needs to be reproduced and placed: the command, the commit, the CPU and the
    versions (a result means little without the machine and the code that made it)."""
    import platform
    import subprocess
    import sys

    def version(name: str) -> str | None:
        try:
            from importlib.metadata import version as v

            return v(name)
        except Exception:  # noqa: BLE001 - not installed
            return None

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"command": sys.argv, "commit": commit, "cpu": cpu or platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "versions": {n: version(n) for n in ("torch", "transformers", "ray")}}
