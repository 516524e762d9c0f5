"""What the `train-head` command tests share: a small data set, and the command run in-process with
the options every one of them takes (no progress bars, a fixed prompt frame)."""
from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from eaglectl.train import train_head

ROWS = [{"prompt": f"question {i} about things", "response": f"answer number {i} is here and long"} for i in range(40)]


def write_rows(path: Path, rows=ROWS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def train(*args):
    """`eaglectl train-head ARGS`, its click Result."""
    return CliRunner().invoke(train_head, ["--no-progress", "--prompt-format", "Q: {prompt}\\nA:", *map(str, args)])
