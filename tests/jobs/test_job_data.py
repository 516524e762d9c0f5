"""Issue #25 on real files, without a model: input identity on resume, default output beside a glob,
id types, corrupt data pages behind an intact footer, error rows taken out for --retry-errors,
unsupported / logprobs fields of OpenAI Batch requests, `job status --json`, the no-op rerun, the
exit code of a job with error rows. Jobs whose rows are all bad need no replica, so they run here
in-process without Ray."""
from __future__ import annotations

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from jobs.input_reader import InputError, iter_rows, open_input
from jobs.job_config import JobConfig, default_output
from jobs.output_writer import BASE_SCHEMA, OutputDir, OutputError, PartWriter
from jobs.progress import Progress, RowCounts
from jobs.runner import run_job

from .conftest import read_manifest, write_parquet

WORDS = "the quick brown fox jumps over the lazy dog speculative decoding drafts tokens".split()


def corrupt_column_chunk(path, row_group: int, column: str, n: int = 16) -> None:
    """Overwrite `n` bytes in the middle of a column chunk's pages (the footer stays intact)."""
    g = pq.read_metadata(path).row_group(row_group)
    c = next(g.column(i) for i in range(g.num_columns) if g.column(i).path_in_schema == column)
    start = c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset
    with open(path, "r+b") as f:
        f.seek(start + c.total_compressed_size // 2)
        f.write(b"\xff" * n)


def prompts(n: int, seed: int = 0) -> list[str]:
    rnd = random.Random(seed)            # varied text, as real prompts are (compresses like them)
    return [" ".join(rnd.choice(WORDS) for _ in range(20)) + f" {i}" for i in range(n)]


def bad_rows_job(tmp_path, name: str, ids, **cfg):
    """A Parquet input whose rows are all bad (empty prompts): a job over it needs no model."""
    inp = write_parquet(tmp_path / name, id=ids, prompt=[""] * len(ids))
    return JobConfig(input=str(inp), model="no-model-needed", draft="none", **cfg)


# ---- 1. input identity --------------------------------------------------------------------------
def test_a_different_input_into_the_same_output_is_refused(tmp_path):
    out = tmp_path / "out" / "mix"
    m = run_job(bad_rows_job(tmp_path, "temp.parquet", ["a", "b"], output=str(out)))
    assert m["status"] == "completed" and m["rows"] == 2 and m["input_identity"]["files"][0][0].endswith("temp.parquet")
    with pytest.raises(OutputError, match=r"different input \(its files differ: 1 file\(s\) no longer in it"):
        run_job(bad_rows_job(tmp_path, "other.parquet", ["a", "b"], output=str(out)))     # same ids, other file
    write_parquet(tmp_path / "temp.parquet", id=["a", "b"], prompt=["  ", "\t"])           # rewritten in place
    with pytest.raises(OutputError, match="temp.parquet was .* bytes, now|temp.parquet has different content"):
        run_job(JobConfig(input=str(tmp_path / "temp.parquet"), output=str(out), model="no-model-needed", draft="none"))
    assert read_manifest(out)["rows"] == 2                                                 # untouched
    m = run_job(bad_rows_job(tmp_path, "other.parquet", ["a", "b"], output=str(out), overwrite=True))
    assert m["input_identity"]["files"][0][0].endswith("other.parquet")


def test_resume_may_change_prefix_caching(tmp_path):
    cfg = bad_rows_job(tmp_path, "in.parquet", ["a"])
    run_job(cfg)
    m = run_job(cfg.model_copy(update={"enable_prefix_caching": False}))   # not an output-changing setting
    assert m["status"] == "completed" and "enable_prefix_caching" not in m["fingerprint"]


def test_default_output_lies_beside_what_the_input_reads(tmp_path):
    d = tmp_path / "data"
    write_parquet(d / "x" / "a.parquet", prompt=["p"])
    a, b = default_output(str(d / "x" / "*.parquet")), default_output(str(d / "**" / "*.parquet"))
    assert a.startswith(str(d / "x.glob-")) and a.endswith(".out") and b.startswith(str(tmp_path / "data.glob-"))
    assert a != default_output(str(d / "x" / "a*.parquet"))        # two globs over one folder: two outputs
    assert default_output(str(d / "x")) == str(d / "x.out")
    assert default_output("s3://bkt/data/in.parquet") == "s3://bkt/data/in.out"
    assert default_output("s3://bkt/data/").startswith("s3://bkt/data.out")
    with pytest.raises(ValueError, match="needs --output"):
        default_output("s3://bkt")


# ---- 3. ids keep their type ---------------------------------------------------------------------
def test_integer_ids_stay_integers_and_types_never_mix(tmp_path):
    m = run_job(bad_rows_job(tmp_path, "ints.parquet", pa.array([1, 2, 3], pa.int32())))
    t = pq.read_table(tmp_path / "ints.out")
    assert t.schema.field("id").type == pa.int64() and sorted(t.column("id").to_pylist()) == [1, 2, 3]
    assert m["input_identity"]["id_type"] == "int64"
    d = tmp_path / "mixed"
    write_parquet(d / "a.parquet", id=[1], prompt=["x"])
    write_parquet(d / "b.parquet", id=["1"], prompt=["y"])
    with pytest.raises(InputError, match=r"b.parquet has string ids \(string\) but .*a.parquet has integer ids"):
        open_input(str(d))
    write_parquet(d / "b.parquet", prompt=["y"])
    with pytest.raises(InputError, match="derived string ids"):
        open_input(str(d))
    write_parquet(tmp_path / "nulls.parquet", id=pa.array([1, None], pa.int64()), prompt=["a", "b"])
    with pytest.raises(InputError, match="integer `id` column has 1 null"):
        open_input(str(tmp_path / "nulls.parquet"))


def test_a_null_string_id_never_takes_another_rows_id(tmp_path):
    """A null id cannot fall back to the derived `<file>:<row>`: that may be another row's real id, which
    would then be skipped as its duplicate. Refused up front (the footer's null count), naming the rows."""
    inp = write_parquet(tmp_path / "idcoll.parquet", id=[None, "idcoll.parquet:0"], prompt=["", ""])
    with pytest.raises(InputError, match=r"idcoll.parquet: the string `id` column has 1 null value\(s\) in row "
                                         r"group 0 \(row 0\); give every row an id"):
        run_job(JobConfig(input=str(inp), model="no-model-needed", draft="none"))
    assert not (tmp_path / "idcoll.out").exists()
    # a file without statistics: found at run time; the null row alone is listed as unreadable, the
    # others run as usual under their own ids (before: the rest of the row group became error rows)
    pq.write_table(pa.table({"id": ["a", None, "nostats.parquet:1"], "prompt": ["", "x", "y"]}),
                   tmp_path / "nostats.parquet", write_statistics=False)
    plan = open_input(str(tmp_path / "nostats.parquet"))
    rows = list(iter_rows(plan))
    assert [(r.id, r.prompt, r.error) for r in rows] == [("a", "", "prompt is empty"), ("nostats.parquet:1", "y", None)]
    assert plan.unreadable == [{"file": str(tmp_path / "nostats.parquet"), "row_group": 0, "rows": 1, "null_id_rows": [1],
                                "error": f"{tmp_path / 'nostats.parquet'}: row group 0: a null `id` (row 1); give every "
                                         "row an id"}]
    n = 2000                                   # many batches of one row group: one entry, the null rows named
    ids = [f"id{i}" for i in range(n)]
    ids[3] = ids[700] = None
    pq.write_table(pa.table({"id": ids, "prompt": ["p"] * n}), tmp_path / "big.parquet", write_statistics=False)
    plan = open_input(str(tmp_path / "big.parquet"))
    rows = list(iter_rows(plan, batch_rows=256))
    assert [r.id for r in rows] == [i for i in ids if i] and not any(r.error for r in rows)
    assert len(plan.unreadable) == 1 and plan.unreadable[0]["rows"] == 2
    assert "row group 0: a null `id` (rows 3, 700)" in plan.unreadable[0]["error"]
    # an `id` column of nulls only (type null) is no ids at all: derived ones, as without the column
    write_parquet(tmp_path / "noids.parquet", id=pa.array([None, None], pa.null()), prompt=["a", "b"])
    assert [r.id for r in iter_rows(open_input(str(tmp_path / "noids.parquet")))] == ["noids.parquet:0", "noids.parquet:1"]


@pytest.mark.parametrize("name, content", [("empty.parquet", None), ("empty.jsonl", "")])
def test_an_empty_input_completes_with_a_sensible_summary(tmp_path, name, content):
    from jobs.progress import summary

    inp = tmp_path / name
    if content is None:
        pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), inp)
    else:
        inp.write_text(content)
    m = run_job(JobConfig(input=str(inp), model="no-model-needed", draft="none"))
    assert m["status"] == "completed" and m["rows"] == 0 and m["complete"]
    assert m["runs"][-1]["driver_peak_rss_mb"] > 0                      # measured, though no row ran
    assert "RSS 0 MB" not in summary(m) and "driver peak RSS" in summary(m)
    assert "driver peak RSS" not in summary({**m, "runs": [{**m["runs"][-1], "driver_peak_rss_mb": None}]})


# ---- 2. corrupt data pages ----------------------------------------------------------------------
@pytest.mark.parametrize("compression", ["zstd", "snappy", "none"])
def test_a_corrupt_prompt_page_becomes_error_rows_of_that_row_group(tmp_path, compression):
    n = 300
    p = tmp_path / "c.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(n)], "prompt": prompts(n)}), p,
                   compression=compression, row_group_size=100)
    corrupt_column_chunk(p, 1, "prompt")
    plan = open_input(str(p))                                   # the footer is intact: accepted up front
    rows = list(iter_rows(plan, batch_rows=32))
    assert [r.id for r in rows] == [f"r{i}" for i in range(n)]    # every id once, in order
    bad = [int(r.id[1:]) for r in rows if r.error]
    # the row group's rows from the first batch that cannot be decoded (uncompressed: the damaged
    # rows' batch; compressed: the whole page) to its end; the rows before it decoded correctly
    assert bad and bad == list(range(bad[0], 200)) and 100 <= bad[0] < 200 and not plan.unreadable
    assert f"{p}: row group 1 cannot be read" in rows[bad[0]].error
    assert all(r.prompt == want for r, want in zip(rows, prompts(n)) if not r.error)


def test_corrupt_pages_without_an_id_column_and_in_the_id_column(tmp_path):
    n = 200
    p = tmp_path / "noid.parquet"
    pq.write_table(pa.table({"prompt": prompts(n)}), p, compression="zstd", row_group_size=100)
    corrupt_column_chunk(p, 0, "prompt")
    rows = list(iter_rows(open_input(str(p))))
    assert [r.id for r in rows if r.error] == [f"noid.parquet:{i}" for i in range(100)]   # derived ids are known
    q = tmp_path / "badid.parquet"
    # zstd frames carry no checksum: damage the codec does not notice reads as other values; page
    # checksums (write_page_checksum) catch it, and the job verifies them where the file has them
    pq.write_table(pa.table({"id": [f"some-long-id-{i * 7919}" for i in range(n)], "prompt": prompts(n)}), q,
                   compression="zstd", row_group_size=100, write_page_checksum=True)
    corrupt_column_chunk(q, 1, "id")
    plan = open_input(str(q))
    rows = list(iter_rows(plan))
    assert len(rows) == 100 and plan.unreadable[0]["row_group"] == 1 and plan.unreadable[0]["rows"] == 100
    assert str(q) in plan.unreadable[0]["error"]


def test_a_job_over_a_corrupt_file_goes_on_to_the_next_and_exits_3(tmp_path):
    from eaglectl.jobs import submit_job

    d = tmp_path / "in"
    d.mkdir()
    for name in ("a", "b", "c"):
        pq.write_table(pa.table({"id": [f"{name}{i}" for i in range(200)], "prompt": [""] * 200}), d / f"{name}.parquet",
                       row_group_size=50)
    q = d / "b.parquet"
    pq.write_table(pa.table({"id": [f"b{i}" for i in range(200)], "prompt": prompts(200)}), q,
                   compression="zstd", row_group_size=50)
    corrupt_column_chunk(q, 2, "prompt")
    assert len([r for r in iter_rows(open_input(str(q))) if r.error]) == 50
    pq.write_table(pa.table({"id": [f"b{i}" for i in range(200)], "prompt": [""] * 200}), q, row_group_size=50)
    corrupt_column_chunk(q, 2, "id", n=64)
    res = CliRunner().invoke(submit_job, [str(d), "--model", "none-needed", "--draft", "none"], env={"RAY_ADDRESS": ""})
    m = read_manifest(tmp_path / "in.out")
    ids = pq.read_table(tmp_path / "in.out").column("id").to_pylist()
    assert res.exit_code == 3, res.output
    assert len(ids) == len(set(ids)) == 550 and {f"c{i}" for i in range(200)} <= set(ids)   # c after b: done
    assert m["unreadable_rows"] == 50 and "b.parquet: row group 2" in m["unreadable"][0]["error"]


# ---- 4. --retry-errors --------------------------------------------------------------------------
def _rec(i, error=None):
    return {"id": f"r{i}", "text": None if error else f"t{i}", "finish_reason": None if error else "length",
            "prompt_tokens": None if error else 3, "completion_tokens": None if error else 4,
            "accepted_tokens_per_step": 1.0, "latency_s": 0.1, "error": error, "chat": False, "model": "m"}


@pytest.mark.parametrize("fmt", ["parquet", "openai-batch"])
def test_retry_errors_takes_exactly_the_error_rows_out(tmp_path, fmt):
    fp = {"model": "m"}
    out = OutputDir(tmp_path / "o", fmt)
    out.open(fp)
    out.write_manifest({"fingerprint": fp, "runs": [{"run_id": "run1"}]})   # as a run records itself
    w = PartWriter(out, BASE_SCHEMA, "run1", rows_per_file=4)
    for i in range(10):                          # parts of 4, 4, 2 rows; r1, r2, r5, r8, r9 are error rows
        w.add(_rec(i, error="bad" if i in (1, 2, 5, 8, 9) else None))
    w.commit()
    out.close()
    again = OutputDir(tmp_path / "o", fmt)
    ids, counts = again.open(fp, retry_errors=True)
    assert again.retried_error_rows == 5 and counts.rows == 5 and counts.error_rows == 0
    assert sorted(i for i in (f"r{k}" for k in range(10)) if i in ids) == ["r0", "r3", "r4", "r6", "r7"]
    assert len(again.parts()) == 2                # the part of error rows only is gone
    again.close()
    third = OutputDir(tmp_path / "o", fmt)
    ids, counts = third.open(fp)                  # what a rerun sees: the same rows, from the rewritten files
    assert counts.rows == 5 and "r1" not in ids
    third.close()


def test_retry_errors_accepts_fixed_input_files_but_not_other_files(tmp_path):
    cfg = bad_rows_job(tmp_path, "in.parquet", ["a", "b"])
    m = run_job(cfg)
    assert m["error_rows"] == 2
    write_parquet(tmp_path / "in.parquet", id=["a", "b"], prompt=["", ""], max_tokens=[4, 4])   # "fixed" (still bad)
    with pytest.raises(OutputError, match="or --retry-errors after fixing rows in place"):
        run_job(cfg)
    m = run_job(cfg.model_copy(update={"retry_errors": True}))
    assert m["runs"][-1]["retried_error_rows"] == 2 and m["rows"] == 2 and m["error_rows"] == 2
    assert sorted(pq.read_table(tmp_path / "in.out").column("id").to_pylist()) == ["a", "b"]   # once each


# ---- 8. job parts -------------------------------------------------------------------------------
def test_openai_batch_unsupported_fields_and_logprobs(tmp_path):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    reqs = [
        {"custom_id": "tools", "body": {**body, "tools": [{"type": "function"}]}},
        {"custom_id": "stream", "body": {**body, "stream": True}},
        {"custom_id": "lp-chat", "body": {**body, "logprobs": True, "top_logprobs": 3}},
        {"custom_id": "lp-bad", "body": {**body, "top_logprobs": 3}},
        {"custom_id": "lp-cmpl", "url": "/v1/completions", "body": {"prompt": "x", "logprobs": 2, "user": "u"}},
        {"custom_id": "lp-cmpl-bad", "url": "/v1/completions", "body": {"prompt": "x", "logprobs": 99}},
    ]
    p = tmp_path / "b.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    rows = {r.id: r for r in iter_rows(open_input(str(p)))}
    assert rows["tools"].error == "tools: tool calling is not supported by this server"
    assert rows["tools"].error_param == "tools"
    assert rows["stream"].error_param == "stream"
    assert rows["lp-chat"].error is None and rows["lp-chat"].params["logprobs"] == 3
    assert "needs logprobs set to true" in rows["lp-bad"].error
    assert rows["lp-cmpl"].error is None and rows["lp-cmpl"].params["logprobs"] == 2
    assert rows["lp-cmpl-bad"].error == "logprobs: Input should be less than or equal to 20"
    assert all(r.strict_max_tokens for r in rows.values())


def test_status_json_noop_rerun_and_progress_errors(tmp_path):
    from eaglectl.jobs import job

    cfg = bad_rows_job(tmp_path, "in.parquet", ["a", "b", "c"])
    first = run_job(cfg)
    again = run_job(cfg)                                             # nothing to do
    assert [r["run_id"] for r in again["runs"]] == [r["run_id"] for r in first["runs"]]
    assert again["last_noop_rerun"]["skipped_already_done"] == 3
    res = CliRunner().invoke(job, ["status", str(tmp_path / "in.out"), "--json"], env={"RAY_ADDRESS": ""})
    st = json.loads(res.output)
    assert res.exit_code == 0 and st["status"] == "completed" and st["error_rows"] == 3 and st["rows"] == 3
    res = CliRunner().invoke(job, ["status", str(tmp_path / "in.out")], env={"RAY_ADDRESS": ""})
    assert "this run: nothing to do (3 rows already in the output); last run that generated: 3 rows" in res.output
    line = Progress(10, 3, stream=open("/dev/null", "w"), tty=False, initial_errors=3).line(RowCounts())
    assert "errors 3" in line                                       # error rows already in the output count


def test_a_file_cut_short_with_its_footer_kept_is_refused_up_front(tmp_path):
    p = tmp_path / "cut.parquet"
    pq.write_table(pa.table({"prompt": prompts(1000)}), p, row_group_size=500)
    data = p.read_bytes()
    footer = data[-(int.from_bytes(data[-8:-4], "little") + 8):]
    p.write_bytes(data[:len(data) // 3] + footer)              # pages lost, footer intact
    with pytest.raises(InputError, match=r"cut.parquet: row group \d, column `prompt` lies outside the file"):
        open_input(str(p))
