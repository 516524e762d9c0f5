"""Atomic part files, resume state from committed ids, folder safety, OpenAI output lines, IdSet. No Ray."""
from __future__ import annotations

import json
import os
import re

import pyarrow.parquet as pq
import pytest

import jobs.id_set as id_set_mod
from jobs.id_set import IdSet
from jobs.openai_batch import SERVER_ERROR
from jobs.output_writer import BASE_SCHEMA, OutputDir, OutputError, PartWriter, openai_line

FP = {"model": "m", "max_tokens": 4}
MANIFEST = {"fingerprint": FP, "runs": [{"run_id": "run1"}]}     # a run's entry is written before its first part


def rec(i, error=None):
    return {"id": f"r{i}", "text": None if error else f"t{i}", "finish_reason": None if error else "length",
            "prompt_tokens": None if error else 3, "completion_tokens": None if error else 4,
            "accepted_tokens_per_step": 1.0, "latency_s": 0.1, "error": error, "chat": False, "model": "m"}


def visible(path):
    return sorted(n for n in os.listdir(path) if not n.startswith((".", "_")))


def test_rows_become_visible_only_at_commit(tmp_path):
    out = OutputDir(tmp_path / "o", "parquet")
    ids, counts = out.open(FP)
    assert len(ids) == 0 and counts.rows == 0
    out.write_manifest(MANIFEST)
    w = PartWriter(out, BASE_SCHEMA, "run1", rows_per_file=5, row_group_rows=2)
    for i in range(4):
        w.add(rec(i))
    assert visible(out.path) == []                           # written to a hidden temp file only
    assert any(n.startswith(".part-") for n in os.listdir(out.path))
    w.add(rec(4, error="bad"))                                # 5th row: the file is committed
    assert visible(out.path) == ["part-run1-00000.parquet"]
    f = pq.ParquetFile(out.path / "part-run1-00000.parquet")
    assert f.metadata.num_row_groups == 3 and f.metadata.num_rows == 5
    w.add(rec(5))
    assert w.committed.rows == 5 and w.committed.error_rows == 1
    assert pq.read_table(out.path).num_rows == 5             # a dataset reader sees committed rows only
    w.commit()
    assert pq.read_table(out.path).num_rows == 6
    out.close()


def test_reopen_skips_committed_and_drops_temp_files(tmp_path):
    out = OutputDir(tmp_path / "o", "parquet")
    out.open(FP)
    out.write_manifest(MANIFEST)
    w = PartWriter(out, BASE_SCHEMA, "run1", rows_per_file=3)
    for i in range(5):          # 3 committed, 2 in a temp file when the "driver dies"
        w.add(rec(i))
    out.close()                 # no commit: simulates SIGKILL (the lock goes with the process)
    again = OutputDir(tmp_path / "o", "parquet")
    ids, counts = again.open(FP)
    assert {f"r{i}" in ids for i in range(3)} == {True} and "r3" not in ids and counts.rows == 3
    assert not any(n.endswith(".tmp") for n in os.listdir(again.path))
    again.close()


def test_folder_safety(tmp_path):
    out = OutputDir(tmp_path / "o", "parquet")
    out.open(FP)
    out.write_manifest(MANIFEST)
    w = PartWriter(out, BASE_SCHEMA, "run1")
    w.add(rec(0))
    w.commit()
    with pytest.raises(OutputError, match="another job is writing"):
        OutputDir(tmp_path / "o", "parquet").open(FP)
    out.close()
    with pytest.raises(OutputError, match=r"different settings: max_tokens=4 \(now 8\).*--overwrite"):
        OutputDir(tmp_path / "o", "parquet").open({**FP, "max_tokens": 8})
    assert ".lock" in os.listdir(tmp_path / "o")        # a job's own folder, refused, keeps its lock file
    with pytest.raises(OutputError, match="another format.*or pass --overwrite"):
        OutputDir(tmp_path / "o", "openai-batch").open(FP)
    o2 = OutputDir(tmp_path / "o", "openai-batch")          # --overwrite starts over whatever the format was
    ids, _ = o2.open({**FP, "max_tokens": 8}, overwrite=True)
    assert len(ids) == 0 and visible(o2.path) == []
    o2.close()
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="did not write"):
        OutputDir(tmp_path / "x", "parquet").open(FP)
    assert os.listdir(tmp_path / "x") == ["notes.txt"]       # someone else's folder is left as it was found


def test_an_existing_file_or_the_input_as_output_is_refused_by_name(tmp_path, monkeypatch):
    from jobs.job_config import JobConfig
    from jobs.runner import run_job

    from .conftest import write_parquet

    inp = write_parquet(tmp_path / "victim" / "good.parquet", prompt=[""])
    with pytest.raises(ValueError, match="is the input itself"):                  # the same path: at config time
        JobConfig(input=str(inp), output=str(inp), model="no-model-needed", draft="none")
    monkeypatch.chdir(inp.parent)                    # written another way (relative in, absolute out): when opened
    with pytest.raises(OutputError, match=f"^{re.escape(str(inp))}: --output is the input file itself"):
        run_job(JobConfig(input=inp.name, output=str(inp), model="no-model-needed", draft="none"))
    other = tmp_path / "victim" / "notes.txt"
    other.write_text("mine")
    for out in (other, other / "sub"):
        with pytest.raises(OutputError, match=f"^{re.escape(str(out))}: the output must be a folder, and this path is "
                                              "an existing file"):
            run_job(JobConfig(input=str(inp), output=str(out), model="no-model-needed", draft="none"))
    assert sorted(os.listdir(tmp_path / "victim")) == ["good.parquet", "notes.txt"]
    assert other.read_text() == "mine"


def test_openai_lines_and_jsonl_parts(tmp_path):
    ok = openai_line({**rec(1), "chat": True})
    assert ok["custom_id"] == "r1" and ok["error"] is None and ok["response"]["status_code"] == 200
    body = ok["response"]["body"]
    assert body["object"] == "chat.completion" and body["choices"][0]["message"] == {"role": "assistant", "content": "t1"}
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    bad = openai_line(rec(2, error="SamplingParams.temperature must be >= 0"))
    assert bad["response"]["status_code"] == 400 and "temperature" in bad["response"]["body"]["error"]["message"]
    assert bad["response"]["body"]["error"]["type"] == "invalid_request_error"
    # the server's fault, not the request's: a 500 a client may send again as it is; an unknown model: 404
    died = openai_line({**rec(3, error="the replica running this row died 2 times"), **SERVER_ERROR})["response"]
    assert died["status_code"] == 500 and died["body"]["error"]["type"] == "server_error"
    unknown = openai_line({**rec(4, error="model 'x' does not exist"), "error_code": "model_not_found"})["response"]
    assert unknown["status_code"] == 404 and unknown["body"]["error"]["code"] == "model_not_found"

    out = OutputDir(tmp_path / "o", "openai-batch")
    out.open(FP)
    out.write_manifest({"fingerprint": FP, "runs": [{"run_id": "r"}]})
    w = PartWriter(out, BASE_SCHEMA, "r")
    w.add(rec(1))
    w.add(rec(2, error="bad"))
    w.commit()
    out.close()
    lines = [json.loads(x) for x in (out.path / "part-r-00000.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ["r1", "r2"] and lines[0]["response"]["body"]["object"] == "text_completion"
    ids, counts = OutputDir(tmp_path / "o", "openai-batch").open(FP)
    assert "r1" in ids and "r2" in ids and counts.error_rows == 1 and counts.completion_tokens == 4


def test_id_set_merges_and_dedups(monkeypatch):
    monkeypatch.setattr(id_set_mod, "_MERGE_AT", 100)
    s = IdSet()
    ids = [f"row-{i}" for i in range(1000)] + ["", "é", "x" * 1000]
    assert s.update(ids) == 0 and s.update(ids[:10]) == 10 and len(s) == len(ids)
    assert all(i in s for i in ids) and not any(f"other-{i}" in s for i in range(1000))
    assert s.nbytes < 40 * len(ids)


def test_job_status_of_a_local_output_folder(tmp_path):
    from click.testing import CliRunner

    from eaglectl.jobs import job

    out = OutputDir(tmp_path / "o", "parquet")
    out.open(FP)
    out.write_manifest({"status": "running", "rows": 3, "input_rows": 10, "output": str(out.path), "runs": []})
    res = CliRunner().invoke(job, ["status", str(out.path)], env={"RAY_ADDRESS": ""})
    assert res.exit_code == 0 and "job running: 3/10 rows" in res.output      # the lock is held: running
    out.close()                                                                # the driver is gone
    res = CliRunner().invoke(job, ["status", str(out.path)], env={"RAY_ADDRESS": ""})
    assert "job interrupted (no driver is running; run the same command again to resume)" in res.output
    res = CliRunner().invoke(job, ["status", "some-job-id"], env={"RAY_ADDRESS": ""})
    assert res.exit_code == 2 and "needs --address or RAY_ADDRESS" in res.output


def test_job_status_reads_the_lock_of_a_read_only_output(tmp_path, monkeypatch):
    """A killed job's output on a read-only mount: opening `.lock` for writing was an OSError traceback."""
    import errno

    from jobs.output_writer import is_locked

    out = OutputDir(tmp_path / "o", "parquet")
    out.open(FP)                                         # a driver holds the lock
    real_open = os.open

    def read_only(path, flags, *a):
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, "Read-only file system", path)
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", read_only)
    assert is_locked(out.path) is True
    monkeypatch.setattr(os, "open", real_open)
    out.close()
    monkeypatch.setattr(os, "open", read_only)
    assert is_locked(out.path) is False


def test_a_manifest_write_that_fails_leaves_no_temp_file(tmp_path, monkeypatch):
    import errno

    out = OutputDir(tmp_path / "o", "parquet")
    out.open(FP)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        out.write_manifest(MANIFEST)
    assert [n for n in os.listdir(out.path) if n.endswith(".tmp")] == []
    out.close()


def _committed(tmp_path, fmt="parquet", rows=4, per_file=2) -> OutputDir:
    out = OutputDir(tmp_path / "o", fmt)
    out.open(FP)
    out.write_manifest(MANIFEST)
    w = PartWriter(out, BASE_SCHEMA, "run1", rows_per_file=per_file)
    for i in range(rows):
        w.add(rec(i))
    w.commit()
    out.close()
    return out


@pytest.mark.parametrize("content, said", [('{"status": "comp', "is damaged"), ("[]", "is not a job manifest")])
def test_a_damaged_manifest_is_refused_clearly_and_overwrite_starts_over(tmp_path, content, said):
    """A truncated manifest was a JSONDecodeError traceback, even with --overwrite; a JSON list an AttributeError."""
    out = _committed(tmp_path)
    (out.path / "_manifest.json").write_text(content)
    with pytest.raises(OutputError, match=f"_manifest.json {said}.*pass --overwrite"):
        OutputDir(out.path, "parquet").open(FP)
    again = OutputDir(out.path, "parquet")
    ids, _ = again.open(FP, overwrite=True)
    assert len(ids) == 0 and visible(again.path) == []
    again.close()


@pytest.mark.parametrize("edit, said", [
    ({"runs": 5}, "`runs` is not a list of objects"), ({"runs": ["x"]}, "`runs` is not a list of objects"),
    ({"fingerprint": []}, "`fingerprint` is a JSON array, not an object"),
    ({"input_identity": "x"}, "`input_identity` is a JSON string, not an object"),
    ({"input_identity": {"files": 3}}, "`input_identity.files` is not a list"),
    ({"prefix_cache_by_part": "x"}, "`prefix_cache_by_part` is a JSON string"),
    ({"prefix_cache_by_part": {"part-1": 5}}, "`prefix_cache_by_part` does not map parts"),
])
def test_a_manifest_edited_into_another_shape_is_refused_not_a_traceback(tmp_path, edit, said):
    """Valid JSON of the wrong shape was a TypeError/AttributeError wherever the field was read (the
    driver, `job status`): it is refused as damaged, like a truncated one."""
    from click.testing import CliRunner

    from eaglectl.jobs import job

    out = _committed(tmp_path)
    (out.path / "_manifest.json").write_text(json.dumps({**MANIFEST, "status": "running", **edit}))
    with pytest.raises(OutputError, match=rf"_manifest.json is damaged \({re.escape(said)}.*pass --overwrite"):
        OutputDir(out.path, "parquet").open(FP)
    res = CliRunner().invoke(job, ["status", str(out.path)], env={"RAY_ADDRESS": ""})
    assert res.exit_code == 2 and said in res.output and "Traceback" not in res.output, res.output


@pytest.mark.parametrize("columns, said", [(["text", "error"], "no column `id`"), (None, "its ids are int64")])
def test_a_part_with_other_columns_or_ids_is_refused_as_damaged(tmp_path, columns, said):
    """A part without an `id` column was a KeyError; one with integer ids in a job of string ids
    counted as done rows no input row matches ("43/40 rows")."""
    import pyarrow as pa

    out = _committed(tmp_path)
    manifest = json.loads((out.path / "_manifest.json").read_text())
    manifest["input_identity"] = {"id_type": "string", "files": []}
    (out.path / "_manifest.json").write_text(json.dumps(manifest))
    part = sorted(out.path.glob("part-*"))[0]
    table = pq.read_table(part)
    if columns:
        table = table.select(columns)
    else:
        table = table.set_column(table.schema.get_field_index("id"), "id", pa.array([1, 2], pa.int64()))
    pq.write_table(table, part)
    with pytest.raises(OutputError, match=rf"{re.escape(part.name)}: a committed part file is damaged \({said}"):
        OutputDir(out.path, "parquet").open(FP)


@pytest.mark.parametrize("fmt", ["parquet", "openai-batch"])
@pytest.mark.parametrize("retry_errors", [False, True])
def test_a_damaged_part_is_refused_naming_it(tmp_path, fmt, retry_errors):
    """A part cut in half was an ArrowInvalid / JSONDecodeError traceback (exit 1)."""
    out = _committed(tmp_path, fmt)
    part = sorted(out.path.glob("part-*"))[1]
    data = part.read_bytes()
    part.write_bytes(data[: data.index(b"\n") + 10 if fmt != "parquet" else len(data) // 2])   # mid-line / mid-file
    with pytest.raises(OutputError, match=f"{re.escape(part.name)}: a committed part file is damaged .*delete it"):
        OutputDir(out.path, fmt).open(FP, retry_errors=retry_errors)
    part.unlink()                                       # as the message says: its rows are generated again
    ids, counts = OutputDir(out.path, fmt).open(FP)
    assert ["r0" in ids, "r1" in ids, "r2" in ids] == [True, True, False] and counts.rows == 2


def test_a_part_of_a_run_the_manifest_does_not_record_is_refused(tmp_path):
    """A part copied in from another output counted as done rows: 'nothing to do', its texts wrong."""
    out = _committed(tmp_path)
    other = _committed(tmp_path / "elsewhere")
    stray = out.path / "part-20260101T000000-abcdef-00000.parquet"
    stray.write_bytes(sorted(other.path.glob("part-*"))[0].read_bytes())
    with pytest.raises(OutputError, match=f"runs this job's _manifest.json does not record \\({stray.name}\\)"):
        OutputDir(out.path, "parquet").open(FP)
    stray.unlink()
    ids, _ = OutputDir(out.path, "parquet").open(FP)
    assert len(ids) == 4


def test_a_stop_signal_as_a_row_group_is_written_does_not_write_it_twice(tmp_path, monkeypatch):
    """A second Ctrl-C raised as ParquetWriter.write_table returned left the rows pending, and the
    commit in the runner's `finally` wrote them into the part again: duplicate ids, a stuck output."""
    out = OutputDir(tmp_path / "o", "parquet")
    out.open(FP)
    out.write_manifest(MANIFEST)
    w = PartWriter(out, BASE_SCHEMA, "run1", rows_per_file=100, row_group_rows=2)
    real = pq.ParquetWriter.write_table

    def interrupted(self, table, *a, **k):
        real(self, table, *a, **k)
        raise KeyboardInterrupt                      # what the signal handler raises as the call returns

    monkeypatch.setattr(pq.ParquetWriter, "write_table", interrupted)
    w.add(rec(0))
    with pytest.raises(KeyboardInterrupt):
        w.add(rec(1))
    monkeypatch.setattr(pq.ParquetWriter, "write_table", real)
    w.commit()                                       # the runner's `finally`
    out.close()
    assert pq.read_table(out.path).column("id").to_pylist() == ["r0", "r1"]
    ids, _ = OutputDir(out.path, "parquet").open(FP)
    assert len(ids) == 2


@pytest.mark.parametrize("fmt", ["parquet", "openai-batch"])
def test_a_part_whose_commit_failed_is_not_committed_by_the_runners_last_commit(tmp_path, monkeypatch, fmt):
    """A part whose upload (or rename) failed raised out of the commit; the runner's `finally` commits
    again, which completed the failed part's commit (in a bucket: a record naming a part that is not
    there, which blocks the output). Now the failed part stays uncommitted: its rows are redone."""
    from jobs.storage import PartSink

    out = OutputDir(tmp_path / "o", fmt)
    out.open(FP)
    out.write_manifest(MANIFEST)
    w = PartWriter(out, BASE_SCHEMA, "run1", rows_per_file=100)
    w.add(rec(0))
    w.commit()
    real = PartSink.commit
    monkeypatch.setattr(PartSink, "commit", lambda self, record=None: (_ for _ in ()).throw(OSError("upload failed")))
    w.add(rec(1))
    with pytest.raises(OSError, match="upload failed"):
        w.commit()
    monkeypatch.setattr(PartSink, "commit", real)
    assert w.commit() is None and w.committed.rows == 1       # the runner's `finally`: nothing left to commit
    out.close()
    ids, counts = OutputDir(out.path, fmt).open(FP)
    assert len(ids) == 1 and "r0" in ids and counts.rows == 1


def test_jsonl_parts_with_unicode_line_breaks_in_texts_and_ids_resume(tmp_path):
    """Parts are JSON lines not ASCII-escaped, and were read back with str.splitlines, which also breaks at
    U+2028, U+2029 and U+0085: such a text or custom_id made every resume fail on a "damaged" part."""
    out = OutputDir(tmp_path / "o", "openai-batch")
    out.open(FP)
    out.write_manifest(MANIFEST)
    w = PartWriter(out, BASE_SCHEMA, "run1")
    w.add({**rec(0), "text": "hello\u2028world"})
    w.add({**rec(1), "id": "r1\u2029", "text": "a\x85b"})
    w.add(rec(2, error="bad \u2028 row"))
    w.commit()
    out.close()
    again = OutputDir(out.path, "openai-batch")
    ids, counts = again.open(FP, retry_errors=True)       # reads every part, and rewrites it without r2
    assert again.retried_error_rows == 1 and counts.rows == 2 and "r0" in ids and "r1\u2029" in ids
    again.close()
    ids, counts = OutputDir(out.path, "openai-batch").open(FP)
    assert counts.rows == 2 and counts.error_rows == 0 and "r1\u2029" in ids and "r2" not in ids


def test_kept_columns_are_written_apart_from_the_rows_result(tmp_path):
    """Carried input columns named like a result's internal keys (`model`, `chat`) keep their input values."""
    import pyarrow as pa

    from jobs.output_writer import KEPT, output_schema

    kept = pa.schema([("model", pa.string()), ("chat", pa.bool_()), ("forwards", pa.int64())])
    out = OutputDir(tmp_path / "o", "parquet")
    out.open(FP)
    out.write_manifest(MANIFEST)
    w = PartWriter(out, output_schema(kept), "run1")
    w.add({**rec(0), "model": "the-job-model", "forwards": 3, KEPT: {"model": "gpt-4", "chat": True, "forwards": 9}})
    w.commit()
    out.close()
    row = pq.read_table(out.path).to_pylist()[0]
    assert (row["text"], row["model"], row["chat"], row["forwards"]) == ("t0", "gpt-4", True, 9)
    assert w.committed.forwards == 3                          # the result's own count, not the column's


def _remote(path) -> OutputDir:
    """An OutputDir that takes the object-store branches (commit records, no rename, a lease) on local disk."""
    out = OutputDir(path, "parquet")
    out.folder.remote = True
    os.makedirs(out.path / "_commits", exist_ok=True)
    return out


def test_an_object_store_part_loses_its_commit_record_before_its_data(tmp_path, monkeypatch):
    """delete_part (--retry-errors, --overwrite) deleted the part, then its `_commits/` record: a driver dying
    in between left a record naming no part, which blocked the output for good, even with --overwrite."""
    from jobs.storage import COMMITS, Folder

    out = _remote(tmp_path / "o")
    out.open(FP)
    out.write_manifest(MANIFEST)
    w = PartWriter(out, BASE_SCHEMA, "run1", rows_per_file=2)
    for i in range(4):
        w.add(rec(i, error="bad" if i < 2 else None))
    out.close()
    assert sorted(os.listdir(out.path / COMMITS)) == ["part-run1-00000.parquet", "part-run1-00001.parquet"]
    real, calls = Folder.delete, []

    def dies_after_the_first(self, name):
        real(self, name)
        calls.append(name)
        if len(calls) == 1:
            raise KeyboardInterrupt              # kill -9 between the two deletes

    monkeypatch.setattr(Folder, "delete", dies_after_the_first)
    with pytest.raises(KeyboardInterrupt):
        _remote(out.path).open(FP, retry_errors=True)    # the part of two error rows goes
    assert calls[0] == f"{COMMITS}/part-run1-00000.parquet"    # the record went first
    monkeypatch.setattr(Folder, "delete", real)
    again = _remote(out.path)
    ids, counts = again.open(FP)                 # the part left over is uncommitted: dropped, its rows run again
    assert again.dropped_uncommitted == ["part-run1-00000.parquet"] and counts.rows == 2 and "r0" not in ids
    again.close()
    # a record without its part (an older driver's crash, a hand edit): refused, unless the output starts over
    (out.path / COMMITS / "part-run1-00009.parquet").write_text("{}")
    with pytest.raises(OutputError, match="commit record _commits/part-run1-00009.parquet names a part that does not"):
        _remote(out.path).open(FP)
    fresh = _remote(out.path)
    ids, _ = fresh.open(FP, overwrite=True)
    assert len(ids) == 0 and os.listdir(out.path / COMMITS) == [] and visible(out.path) == []
    fresh.close()
