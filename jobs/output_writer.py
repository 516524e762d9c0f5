"""Job output: a folder of part files, each committed atomically, plus a manifest.

Why files and not appends: a Parquet file is unreadable until its footer is written, and a JSONL
line written halfway is garbage. So completed rows go into a hidden temp file (`.part-*.tmp`; row
groups of `row_group_rows` are written as they fill, so memory stays one row group) which is
fsynced and renamed to `part-<run>-<n>.<ext>` when it holds `rows_per_file` rows or is
`commit_interval_s` old. A rename is atomic: readers see whole files or nothing, and the committed
files are the job's only record of what is done. A restart reads their ids, skips those rows and
deletes leftover temp files; rows that were in a temp file when the driver died are generated
again, once. The driver is the only writer (replicas send results back to it), and `.lock`
(flock) keeps a second driver from writing the same folder at the same time.

`_manifest.json` (counts, throughput, tau, config) is rewritten, atomically too, at every commit.
Hidden and `_` names are skipped by Parquet dataset readers, so `pq.read_table(folder)` just works.
"""
from __future__ import annotations

import fcntl
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.id_set import IdSet, id_digest
from jobs.progress import RowCounts

MANIFEST = "_manifest.json"
LOCK = ".lock"
BASE_SCHEMA = pa.schema([
    ("id", pa.string()), ("text", pa.string()), ("finish_reason", pa.string()),
    ("prompt_tokens", pa.int32()), ("completion_tokens", pa.int32()),
    ("accepted_tokens_per_step", pa.float32()), ("latency_s", pa.float64()), ("error", pa.string()),
])
EXT = {"parquet": ".parquet", "openai-batch": ".jsonl"}


class OutputError(RuntimeError):
    """The output folder cannot be used for this job; the message says why and what to do."""


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(out_dir: str | Path) -> dict | None:
    p = Path(out_dir) / MANIFEST
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        return None


def is_locked(out_dir: str | Path) -> bool:
    """Whether a driver is writing to `out_dir` right now (its flock is held)."""
    try:
        fd = os.open(Path(out_dir) / LOCK, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _is_ours(name: str) -> bool:
    return name in (MANIFEST, LOCK) or name.startswith(("part-", ".part-", f".{MANIFEST}"))


class OutputDir:
    """The output folder of one job: lock, cleanup, resume state, manifest."""

    def __init__(self, path: str | Path, fmt: str):
        self.path = Path(path)
        self.fmt = fmt
        self._lock_fd: int | None = None

    def open(self, fingerprint: dict, overwrite: bool = False) -> tuple[IdSet, RowCounts]:
        """Lock the folder and return (ids already committed, their counts)."""
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise OutputError(f"{self.path}: another job is writing to this output folder right now") from None
        try:
            return self._prepare(fingerprint, overwrite)
        except BaseException:
            self.close()
            raise

    def _prepare(self, fingerprint: dict, overwrite: bool) -> tuple[IdSet, RowCounts]:
        foreign = sorted(n for n in os.listdir(self.path) if not _is_ours(n))
        if foreign:
            raise OutputError(f"{self.path}: the output folder holds files this tool did not write "
                              f"({', '.join(foreign[:5])}); choose another --output")
        for n in os.listdir(self.path):  # temp files of a driver that died: those rows are redone
            if n.startswith(".") and n.endswith(".tmp"):
                os.unlink(self.path / n)
        manifest = read_manifest(self.path)
        if overwrite:
            for p in self.parts():
                p.unlink()
            (self.path / MANIFEST).unlink(missing_ok=True)
            manifest = None
        elif manifest is not None and self.parts():
            old = manifest.get("fingerprint", {})
            diff = {k: (old.get(k), v) for k, v in fingerprint.items() if old.get(k) != v}
            if diff:
                what = ", ".join(f"{k}={a!r} (now {b!r})" for k, (a, b) in diff.items())
                raise OutputError(f"{self.path} holds output of a job with different settings: {what}. "
                                  "Re-run with the same settings to resume, or pass --overwrite")
        elif manifest is None and self.parts():
            raise OutputError(f"{self.path}: part files without a {MANIFEST}; choose another --output")
        self.manifest = manifest or {}
        return self.scan()

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def parts(self) -> list[Path]:
        ext = EXT[self.fmt]
        other = [n for n in os.listdir(self.path) if n.startswith("part-") and not n.endswith(ext)]
        if other:
            raise OutputError(f"{self.path} holds output in another format ({other[0]}); "
                              "use the same --format or pass --overwrite")
        return sorted(self.path / n for n in os.listdir(self.path) if n.startswith("part-"))

    def scan(self) -> tuple[IdSet, RowCounts]:
        """Ids and counts of every committed row (the source of truth for resume)."""
        ids, counts = IdSet(), RowCounts()
        for p in self.parts():
            for rec in _read_part(p, self.fmt):
                if not ids.add(rec["id"]):
                    raise OutputError(f"{p}: id {rec['id']!r} was already committed in another part file; "
                                      "the output folder was modified by hand")
                counts.add(rec)
        return ids, counts

    def write_manifest(self, data: dict) -> None:
        self.manifest = data
        write_json_atomic(self.path / MANIFEST, data)


def _read_part(p: Path, fmt: str):
    """Yield {id, error, prompt_tokens, completion_tokens} of each row of a committed part."""
    if fmt == "parquet":
        t = pq.read_table(p, columns=["id", "error", "prompt_tokens", "completion_tokens"])
        yield from t.to_pylist()
        return
    with open(p, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            resp = rec.get("response") or {}
            usage = (resp.get("body") or {}).get("usage") or {}
            err = rec.get("error") or (None if resp.get("status_code") == 200 else "error")
            yield {"id": rec["custom_id"], "error": err, "prompt_tokens": usage.get("prompt_tokens"),
                   "completion_tokens": usage.get("completion_tokens")}


@dataclass
class PartWriter:
    """Buffers finished rows into a temp file and commits it atomically (see the module docstring)."""

    out: OutputDir
    schema: pa.Schema
    run_id: str
    rows_per_file: int = 10_000
    row_group_rows: int = 1_000
    commit_interval_s: float = 30.0
    on_commit: Callable[[], None] | None = None
    committed: RowCounts = field(default_factory=RowCounts)
    files_committed: int = 0

    def __post_init__(self) -> None:
        self._pending: list[dict] = []      # rows not yet in the temp file (parquet: one row group)
        self._file_counts = RowCounts()        # rows in the open temp file
        self._tmp: Path | None = None
        self._pq: pq.ParquetWriter | None = None
        self._fh = None
        self._opened_at = 0.0
        self._seq = 0

    def add(self, rec: dict) -> None:
        if self._tmp is None:
            self._open()
        self._file_counts.add(rec)
        if self.out.fmt == "parquet":
            self._pending.append(rec)
            if len(self._pending) >= self.row_group_rows:
                self._flush_row_group()
        else:
            self._fh.write(json.dumps(openai_line(rec), ensure_ascii=False) + "\n")
        if self._file_counts.rows >= self.rows_per_file:
            self.commit()

    def due(self) -> bool:
        return self._tmp is not None and time.monotonic() - self._opened_at >= self.commit_interval_s

    def commit(self) -> RowCounts | None:
        """Make every row added so far durable and visible; returns what was committed."""
        if self._tmp is None:
            return None
        if self.out.fmt == "parquet":
            self._flush_row_group()
            self._pq.close()
            with open(self._tmp, "rb") as f:
                os.fsync(f.fileno())
        else:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
        final = self.out.path / self._tmp.name[1:].removesuffix(".tmp")
        os.replace(self._tmp, final)
        fsync_dir(self.out.path)
        counts, self._file_counts = self._file_counts, RowCounts()
        self.committed.merge(counts)
        self.files_committed += 1
        self._tmp = self._pq = self._fh = None
        if self.on_commit is not None:
            self.on_commit()
        return counts

    def discard(self) -> None:
        """Drop the uncommitted temp file (its rows will be generated again on resume)."""
        if self._pq is not None:
            self._pq.close()
        if self._fh is not None:
            self._fh.close()
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
        self._tmp = self._pq = self._fh = None
        self._pending.clear()

    def _open(self) -> None:
        name = f".part-{self.run_id}-{self._seq:05d}{EXT[self.out.fmt]}.tmp"
        self._seq += 1
        self._tmp = self.out.path / name
        self._opened_at = time.monotonic()
        if self.out.fmt == "parquet":
            self._pq = pq.ParquetWriter(self._tmp, self.schema, compression="zstd")
        else:
            self._fh = open(self._tmp, "w", encoding="utf-8")

    def _flush_row_group(self) -> None:
        if self._pending:
            self._pq.write_table(pa.Table.from_pylist(self._pending, schema=self.schema))
            self._pending = []


def output_schema(kept: pa.Schema | None) -> pa.Schema:
    if kept is None:
        return BASE_SCHEMA
    return pa.schema(list(BASE_SCHEMA) + list(kept))


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]


def openai_line(rec: dict) -> dict:
    """One line of an OpenAI Batch output file for a finished (or failed) row."""
    digest = id_digest(rec["id"]).hex()[:24]
    if rec.get("error") is not None:
        body = {"error": {"message": rec["error"], "type": "invalid_request_error",
                          "param": rec.get("error_param"), "code": None}}
        return {"id": f"batch_req_{digest}", "custom_id": rec["id"],
                "response": {"status_code": 400, "request_id": digest, "body": body}, "error": None}
    finish = {"stop": "stop", "length": "length"}.get(rec.get("finish_reason"), rec.get("finish_reason"))
    usage = {"prompt_tokens": rec["prompt_tokens"], "completion_tokens": rec["completion_tokens"],
             "total_tokens": rec["prompt_tokens"] + rec["completion_tokens"]}
    if rec.get("chat"):
        choice = {"index": 0, "message": {"role": "assistant", "content": rec["text"]},
                  "logprobs": None, "finish_reason": finish}
        obj, prefix = "chat.completion", "chatcmpl"
    else:
        choice = {"index": 0, "text": rec["text"], "logprobs": None, "finish_reason": finish}
        obj, prefix = "text_completion", "cmpl"
    body = {"id": f"{prefix}-{digest}", "object": obj, "created": int(time.time()),
            "model": rec.get("model"), "choices": [choice], "usage": usage,
            "eagle": {"accepted_tokens_per_step": rec.get("accepted_tokens_per_step"),
                      "latency_s": rec.get("latency_s")}}
    return {"id": f"batch_req_{digest}", "custom_id": rec["id"],
            "response": {"status_code": 200, "request_id": digest, "body": body}, "error": None}
