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

On object storage (`s3://`, `gs://`) there is no rename: a part is written under its final name and
counts once its commit record exists (jobs/storage.py). `_manifest.json` (counts, throughput, tau,
config, the input's identity) is rewritten, atomically too, at every commit.
Hidden and `_` names are skipped by Parquet dataset readers, so `pq.read_table(folder)` just works.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pyarrow.parquet as pq

from jobs.id_set import IdSet
from jobs.openai_batch import openai_line
from jobs.progress import RowCounts
from jobs.storage import COMMITS, LEASE, LOCK, Folder, StorageError

__all__ = ["BASE_SCHEMA", "KEPT", "OutputDir", "OutputError", "PartWriter", "openai_line", "output_schema", "new_run_id",
           "read_manifest", "is_locked"]

MANIFEST = "_manifest.json"
BASE_SCHEMA = pa.schema([
    ("id", pa.string()), ("text", pa.string()), ("finish_reason", pa.string()),
    ("prompt_tokens", pa.int32()), ("completion_tokens", pa.int32()),
    ("accepted_tokens_per_step", pa.float32()), ("latency_s", pa.float64()), ("ttft_s", pa.float64()),
    ("error", pa.string()),
])
EXT = {"parquet": ".parquet", "openai-batch": ".jsonl"}
KEPT = "kept_columns"   # a row's key holding its carried input columns (--keep-columns), apart from its result
# what reading a truncated or overwritten part raises (not Parquet, not JSON, not our records)
DAMAGED = (pa.ArrowException, ValueError, KeyError, AttributeError, TypeError)


class OutputError(RuntimeError):
    """The output folder cannot be used for this job; the message says why and what to do."""


def read_manifest(out_dir: str | Path) -> dict | None:
    """The folder's manifest (None where there is none); OutputError where it is damaged."""
    folder = Folder(str(out_dir))
    raw = folder.read_bytes(MANIFEST)
    if raw is None:
        return None
    try:
        manifest = json.loads(raw)
    except ValueError as e:     # JSONDecodeError, UnicodeDecodeError: truncated or overwritten
        raise OutputError(f"{folder.uri(MANIFEST)} is damaged ({e}); pass --overwrite to start over") from None
    if not isinstance(manifest, dict):
        raise OutputError(f"{folder.uri(MANIFEST)} is not a job manifest (a JSON {type(manifest).__name__}); "
                          "pass --overwrite to start over")
    wrong = _misshapen(manifest)
    if wrong:       # valid JSON edited by hand: refused here, not a traceback wherever the field is read
        raise OutputError(f"{folder.uri(MANIFEST)} is damaged ({wrong}); pass --overwrite to start over")
    return manifest


def _misshapen(manifest: dict) -> str | None:
    """The first field a driver or `job status` reads whose JSON type is not what a driver writes."""
    def kind(v) -> str:
        return "null" if v is None else {dict: "object", list: "array", str: "string"}.get(type(v), type(v).__name__)

    for key in ("fingerprint", "input_identity", "prefix_cache", "prefix_cache_by_part", "config"):
        if key in manifest and not isinstance(manifest[key], dict):
            return f"`{key}` is a JSON {kind(manifest[key])}, not an object"
    runs = manifest.get("runs", [])
    if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
        return "`runs` is not a list of objects"
    files = manifest.get("input_identity", {}).get("files", [])
    if not isinstance(files, list) or not all(isinstance(f, list) for f in files):
        return "`input_identity.files` is not a list of [path, size, digest]"
    counts = manifest.get("prefix_cache_by_part", {}).values()
    if not all(isinstance(c, list) and len(c) == 2 and all(isinstance(n, (int, float)) for n in c) for c in counts):
        return "`prefix_cache_by_part` does not map parts to [prompt tokens, cached tokens]"
    return None


def is_locked(out_dir: str | Path) -> bool:
    """Whether a driver is writing to `out_dir` right now (its flock or lease is held)."""
    return Folder(str(out_dir)).is_locked()


def _is_ours(name: str) -> bool:
    return name in (MANIFEST, LOCK, LEASE, COMMITS) or name.startswith(("part-", ".part-", f".{MANIFEST}"))


def identity_diff(old: dict | None, new: dict | None, paths_only: bool = False) -> str | None:
    """Why the input `new` is not the input `old` was (None: the same input)."""
    if not old or not new:
        return None
    if old.get("id_type") != new.get("id_type"):
        return f"the ids were {old.get('id_type')}, now {new.get('id_type')}"
    before = {f[0]: f for f in old.get("files", [])}
    now = {f[0]: f for f in new.get("files", [])}
    gone, added = sorted(set(before) - set(now)), sorted(set(now) - set(before))
    if gone or added:
        what = [f"{len(gone)} file(s) no longer in it (e.g. {gone[0]})"] if gone else []
        what += [f"{len(added)} new file(s) (e.g. {added[0]})"] if added else []
        return "its files differ: " + ", ".join(what)
    if paths_only:
        return None
    for path, f in now.items():
        if before[path][1] != f[1]:
            return f"{path} was {before[path][1]} bytes, now {f[1]}"
        if before[path][2] != f[2]:
            return f"{path} has different content (same size)"
    return None


class OutputDir:
    """The output folder of one job: lock, cleanup, resume state, manifest."""

    def __init__(self, path: str | Path, fmt: str):
        self.folder = Folder(str(path))
        self.path = Path(self.folder.root) if not self.folder.remote else self.folder.location
        self.fmt = fmt
        self.manifest: dict = {}
        self.retried_error_rows = 0
        self.dropped_uncommitted: list[str] = []

    def open(self, fingerprint: dict, overwrite: bool = False, identity: dict | None = None,
             retry_errors: bool = False) -> tuple[IdSet, RowCounts]:
        """Lock the folder and return (ids already committed, their counts). With `retry_errors`,
        committed error rows are taken out first (their parts rewritten in place), so they run again.
        A refused folder is left as it was found (no `.lock`, no empty folder created)."""
        if self.folder.location in {f[0] for f in (identity or {}).get("files", [])}:
            raise OutputError(f"{self.path}: --output is the input file itself; the output is a folder: choose "
                              "another --output (or leave it out: beside the input)")
        created = False
        try:
            created = self.folder.mkdir()
            self.folder.lock()
        except (StorageError, OSError) as e:
            if created:
                self.folder.rmdir()
            raise OutputError(str(e)) from None
        try:
            return self._prepare(fingerprint, overwrite, identity, retry_errors)
        except BaseException as e:
            self.folder.unlock(leave_nothing=True)
            if created:
                self.folder.rmdir()
            if isinstance(e, StorageError):
                raise OutputError(str(e)) from None
            raise

    def _prepare(self, fingerprint: dict, overwrite: bool, identity: dict | None,
                 retry_errors: bool) -> tuple[IdSet, RowCounts]:
        foreign = [n for n in self.folder.names() if not _is_ours(n)]
        if foreign:
            raise OutputError(f"{self.path}: the output folder holds files this tool did not write "
                              f"({', '.join(foreign[:5])}); choose another --output")
        # a dead driver's: those rows are redone (--overwrite: also commit records without their part)
        self.dropped_uncommitted = self.folder.drop_uncommitted(orphan_records=overwrite)
        manifest = None
        if overwrite:           # whatever is there, in any format, damaged or not
            for name in self.folder.committed_parts():
                self.folder.delete_part(name)
            self.folder.delete(MANIFEST)
        else:
            manifest = read_manifest(self.folder.location)
            if self.parts():
                if manifest is None:
                    raise OutputError(f"{self.path}: part files without a {MANIFEST}; choose another --output")
                self._check_resumable(manifest, fingerprint, identity, retry_errors)
        self.manifest = manifest or {}
        if retry_errors:
            self.retried_error_rows = self._drop_error_rows()
        return self.scan()

    def _check_resumable(self, manifest: dict, fingerprint: dict, identity: dict | None, retry_errors: bool) -> None:
        """The committed parts are this job's: the same settings, the same input, and every part
        written by a run the manifest records (each run writes its entry before its first part; a
        part copied in from elsewhere would count as done rows)."""
        old = manifest.get("fingerprint", {})
        diff = {k: (old.get(k), v) for k, v in fingerprint.items() if old.get(k) != v}
        if diff:
            what = ", ".join(f"{k}={a!r} (now {b!r})" for k, (a, b) in diff.items())
            raise OutputError(f"{self.path} holds output of a job with different settings: {what}. "
                              "Re-run with the same settings to resume, or pass --overwrite")
        why = identity_diff(manifest.get("input_identity"), identity, paths_only=retry_errors)
        if why:
            raise OutputError(f"{self.path} holds output of a different input ({why}); resuming would mix "
                              "two inputs in one output. Choose another --output, or pass --overwrite"
                              + ("" if retry_errors else " (or --retry-errors after fixing rows in place)"))
        runs = {r.get("run_id") for r in manifest.get("runs", []) if isinstance(r, dict)}
        stray = [n for n in self.parts() if part_run_id(n) not in runs]
        if stray:
            raise OutputError(f"{self.path}: part files of runs this job's {MANIFEST} does not record "
                              f"({', '.join(stray[:3])}): copied in from another output? Move them out, or pass "
                              "--overwrite to start over")

    def close(self) -> None:
        self.folder.unlock()

    def parts(self) -> list[str]:
        """Names of the committed part files."""
        ext = EXT[self.fmt]
        names = self.folder.committed_parts()
        other = [n for n in names if not n.endswith(ext)]
        if other:
            raise OutputError(f"{self.path} holds output in another format ({other[0]}); "
                              "use the same --format or pass --overwrite")
        return names

    def scan(self) -> tuple[IdSet, RowCounts]:
        """Ids and counts of every committed row (the source of truth for resume)."""
        ids, counts = IdSet(), RowCounts()
        for name in self.parts():
            self.folder.renew()       # a bucket of many parts takes longer to read than the lease lasts
            for rec in self._read_part(name):
                if not ids.add(rec["id"]):
                    raise OutputError(f"{self.folder.uri(name)}: id {rec['id']!r} was already committed in another "
                                      "part file; the output folder was modified by hand")
                counts.add(rec)
        return ids, counts

    def _foreign_columns(self, schema: pa.Schema) -> str | None:
        """Why a part's columns are not a part this job could have written (a missing column is
        silently not read; ids of another type would count as rows no input row matches)."""
        missing = [c for c in ("id", "error", "prompt_tokens", "completion_tokens") if c not in schema.names]
        if missing:
            return f"no column {', '.join(f'`{c}`' for c in missing)}"
        want = (self.manifest or {}).get("input_identity", {}).get("id_type")
        have = schema.field("id").type
        if want and pa.types.is_integer(have) != want.startswith(("int", "uint")):
            return f"its ids are {have}, the job's are {want}"
        return None

    def _damaged(self, name: str, e: Exception) -> OutputError:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        record = f" and its commit record {self.folder.uri(f'{COMMITS}/{name}')}" if self.folder.remote else ""
        return OutputError(f"{self.folder.uri(name)}: a committed part file is damaged ({first}); delete it{record} "
                           "to generate its rows again, or pass --overwrite to start over")

    def write_manifest(self, data: dict) -> None:
        self.manifest = data
        self.folder.renew()           # first: a driver whose lease another took over writes nothing more
        self.folder.write_bytes_atomic(MANIFEST, json.dumps(data, indent=2, default=str).encode())

    def _read_part(self, name: str):
        """Yield {id, error, prompt_tokens, completion_tokens} of each row of a committed part (read
        whole first: a damaged part is an OutputError before any of its rows counts)."""
        try:
            if self.fmt == "parquet":
                f = pq.ParquetFile(self.folder.path(name), filesystem=self.folder.fs)
                wrong = self._foreign_columns(f.schema_arrow)
                if wrong:
                    raise self._damaged(name, ValueError(wrong))
                yield from f.read(columns=["id", "error", "prompt_tokens", "completion_tokens"]).to_pylist()
                return
            rows = []
            for line in self._jsonl_lines(name):
                rec = json.loads(line)
                resp = rec.get("response") or {}
                body = resp.get("body") or {}
                usage = body.get("usage") or {}
                err = rec.get("error") or (None if resp.get("status_code") == 200 else "error")
                rows.append({"id": rec["custom_id"], "error": err, "prompt_tokens": usage.get("prompt_tokens"),
                             "completion_tokens": usage.get("completion_tokens")})
        except DAMAGED as e:
            raise self._damaged(name, e) from None
        yield from rows

    def _jsonl_lines(self, name: str) -> list[str]:
        """The lines of a JSONL part, split on "\\n" only: its JSON is not ASCII-escaped, and str.splitlines
        would also split at a U+2028, U+2029 or U+0085 inside a text or custom_id."""
        return [ln for ln in (self.folder.read_bytes(name) or b"").decode("utf-8").split("\n") if ln]

    def _drop_error_rows(self) -> int:
        """Rewrite each committed part that holds error rows without them, in place (an atomic replace:
        whenever the driver dies, a row is in the output once or not at all, and then it is redone)."""
        dropped = 0
        for name in self.parts():
            self.folder.renew()
            try:
                dropped += self._drop_error_rows_of(name)
            except DAMAGED as e:
                raise self._damaged(name, e) from None
        return dropped

    def _drop_error_rows_of(self, name: str) -> int:
        """One part without its error rows (see _drop_error_rows); how many it dropped."""
        if self.fmt == "parquet":
            t = pq.read_table(self.folder.path(name), filesystem=self.folder.fs)
            bad = t.column("error").is_valid()
            n_bad = pa.compute.sum(bad).as_py() or 0
            keep, n_keep = t.filter(pa.compute.invert(bad)), t.num_rows - n_bad
        else:
            lines = self._jsonl_lines(name)
            keep = [ln for ln in lines if (json.loads(ln).get("response") or {}).get("status_code") == 200]
            n_bad, n_keep = len(lines) - len(keep), len(keep)
        if not n_bad:
            return 0
        if n_keep == 0:
            self.folder.delete_part(name)
            return n_bad
        sink = self.folder.open_part(name)
        if self.fmt == "parquet":
            pq.write_table(keep, sink.stream, compression="zstd")
        else:
            sink.stream.write("".join(ln + "\n" for ln in keep).encode("utf-8"))
        sink.replace_in_place()
        return n_bad


@dataclass
class PartWriter:
    """Buffers finished rows into a part being written and commits it atomically (module docstring)."""

    out: OutputDir
    schema: pa.Schema
    run_id: str
    rows_per_file: int = 10_000
    row_group_rows: int = 1_000
    commit_interval_s: float = 30.0
    on_commit: Callable[[], None] | None = None
    committed: RowCounts = field(default_factory=RowCounts)
    files_committed: int = 0
    # part name -> [prompt tokens looked up in the prefix cache, of which cached]: the manifest keeps
    # them by part, so rows of a part deleted by hand (and redone) are not counted twice
    prefix_cache_by_part: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._pending: list[dict] = []      # rows not yet in the part (parquet: one row group)
        self._file_counts = RowCounts()        # rows in the open part
        self._sink = None
        self._pq: pq.ParquetWriter | None = None
        self._opened_at = 0.0
        self._seq = 0

    def add(self, rec: dict) -> None:
        if self._sink is None:
            self._open()
        self._file_counts.add(rec)
        if self.out.fmt == "parquet":     # the table takes the schema's columns: the kept ones from KEPT
            self._pending.append({**rec, **rec[KEPT]} if rec.get(KEPT) else rec)
            if len(self._pending) >= self.row_group_rows:
                self._flush_row_group()
        else:
            self._sink.stream.write((json.dumps(openai_line(rec), ensure_ascii=False) + "\n").encode("utf-8"))
        if self._file_counts.rows >= self.rows_per_file:
            self.commit()

    def due(self) -> bool:
        return self._sink is not None and time.monotonic() - self._opened_at >= self.commit_interval_s

    def commit(self) -> RowCounts | None:
        """Make every row added so far durable and visible; returns what was committed."""
        if self._sink is None:
            return None
        # one attempt: a part whose write or upload failed is never committed by a second call (the
        # runner's last commit): its object may be missing or cut short. Its rows are redone on resume.
        sink, counts, self._sink, self._file_counts = self._sink, self._file_counts, None, RowCounts()
        try:
            if self.out.fmt == "parquet":
                self._flush_row_group()
                self._pq.close()
        finally:
            self._pq = None
        sink.commit({"rows": counts.rows, "error_rows": counts.error_rows, "run_id": self.run_id})
        self.prefix_cache_by_part[sink.name] = [counts.cache_queried_tokens, counts.cached_tokens]
        self.committed.merge(counts)
        self.files_committed += 1
        if self.on_commit is not None:
            self.on_commit()
        return counts

    def discard(self) -> None:
        """Drop the uncommitted part (its rows will be generated again on resume)."""
        if self._pq is not None:
            self._pq.close()
        if self._sink is not None:
            self._sink.abort()
        self._sink = self._pq = None
        self._pending.clear()

    def _open(self) -> None:
        name = f"part-{self.run_id}-{self._seq:05d}{EXT[self.out.fmt]}"
        self._seq += 1
        self._sink = self.out.folder.open_part(name)
        self._opened_at = time.monotonic()
        if self.out.fmt == "parquet":
            self._pq = pq.ParquetWriter(self._sink.stream, self.schema, compression="zstd")

    def _flush_row_group(self) -> None:
        # taken before the write: a stop signal raised as the write returns must not leave the rows
        # pending, to be written into the part a second time by the commit that follows
        rows, self._pending = self._pending, []
        if rows:
            self._pq.write_table(pa.Table.from_pylist(rows, schema=self.schema))


def output_schema(kept: pa.Schema | None, id_type: pa.DataType = pa.string()) -> pa.Schema:
    """The output columns: `id` with the input's id type, then the base columns, then carried ones."""
    base = pa.schema([pa.field("id", id_type)] + [f for f in BASE_SCHEMA if f.name != "id"])
    return base if kept is None else pa.schema(list(base) + list(kept))


def part_run_id(name: str) -> str:
    """The run that wrote part `name` (`part-<run id>-<n>.<ext>`)."""
    return name[len("part-"):].rsplit("-", 1)[0]


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
