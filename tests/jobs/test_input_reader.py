"""Input resolution, schema checks before generation, row-level errors, OpenAI Batch JSONL. No Ray."""
from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from eaglectl.jobs import submit_job
from jobs.input_reader import InputError, iter_rows, open_input
from jobs.job_config import JobConfig, default_output

from .conftest import write_parquet


def rows_of(spec, **kw):
    return list(iter_rows(open_input(str(spec), **kw), batch_rows=2))


def test_prompt_rows_with_overrides_and_derived_ids(tmp_path):
    p = write_parquet(tmp_path / "in.parquet", prompt=["a b", "", None, "c"], max_tokens=[3, None, 5, None],
                      temperature=[0.5, None, None, 1], stop=[["x"], None, None, ["y", "z"]])
    rows = rows_of(p)
    assert [r.id for r in rows] == ["in.parquet:0", "in.parquet:1", "in.parquet:2", "in.parquet:3"]
    assert rows[0].params == {"max_tokens": 3, "temperature": 0.5, "stop": ["x"]}
    assert rows[1].error == "prompt is empty" and rows[2].error == "prompt is null"
    assert rows[3].params == {"temperature": 1, "stop": ["y", "z"]} and rows[3].error is None


def test_folder_and_glob_inputs(tmp_path):
    d = tmp_path / "data"
    write_parquet(d / "b.parquet", prompt=["x"], id=["7"])
    write_parquet(d / "sub" / "a.parquet", prompt=["y", "z"])
    (d / "_SUCCESS").write_text("")
    assert [r.id for r in rows_of(d)] == ["7", "sub/a.parquet:0", "sub/a.parquet:1"]
    assert [r.id for r in rows_of(str(d) + "/**/*.parquet")] == ["7", "sub/a.parquet:0", "sub/a.parquet:1"]
    assert open_input(str(d)).total_rows == 3
    assert default_output(str(d)) == str(tmp_path / "data.out")
    assert default_output(str(d / "b.parquet")) == str(d / "b.out")


def test_messages_column(tmp_path):
    msgs = [[{"role": "user", "content": "hi"}], [], None]
    p = write_parquet(tmp_path / "m.parquet", messages=msgs)
    rows = rows_of(p)
    assert rows[0].messages == [{"role": "user", "content": "hi"}] and rows[0].chat and rows[0].error is None
    assert rows[1].error.startswith("messages must be a non-empty list")   # the engine's words
    assert rows[2].error == "messages is null"


@pytest.mark.parametrize("columns, needle", [
    ({"text": ["a"]}, "needs a `prompt` column (string) or a `messages` column"),
    ({"prompt": [1, 2]}, "column `prompt` has type int64; expected string"),
    ({"prompt": ["a"], "max_tokens": ["8"]}, "column `max_tokens` has type string; expected integer"),
    ({"prompt": ["a"], "temperature": ["hot"]}, "column `temperature` has type string; expected float"),
    ({"messages": ["hello"]}, "column `messages` has type string; expected list<struct<role: string, content: string>>"),
    ({"prompt": ["a"], "id": [1.5]}, "column `id` has type double; expected string or integer"),
])
def test_schema_errors_name_file_column_and_type(tmp_path, columns, needle):
    p = write_parquet(tmp_path / "bad.parquet", **columns)
    with pytest.raises(InputError) as e:
        open_input(str(p))
    assert str(p) in str(e.value) and needle in str(e.value)


def test_a_column_name_given_twice_is_refused_naming_it(tmp_path):
    for name in ("prompt", "id"):
        p = tmp_path / f"twice-{name}.parquet"
        pq.write_table(pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"]), pa.array(["c"])],
                                            names=["prompt", name, name if name == "id" else "other"]), p)
        with pytest.raises(InputError, match=f"`{name}` appear more than once") as e:
            open_input(str(p))
        assert str(p) in str(e.value)


def test_not_parquet_and_missing(tmp_path):
    bad = tmp_path / "x.parquet"
    bad.write_text("not parquet")
    with pytest.raises(InputError, match="not a readable Parquet file"):
        open_input(str(bad))
    with pytest.raises(InputError, match="no such file or folder"):
        open_input(str(tmp_path / "nope.parquet"))
    with pytest.raises(InputError, match="matches no files"):
        open_input(str(tmp_path / "*.parquet.gz"))


def test_keep_columns_needs_one_schema(tmp_path):
    write_parquet(tmp_path / "d" / "a.parquet", prompt=["a"], cat=["x"])
    write_parquet(tmp_path / "d" / "b.parquet", prompt=["b"], cat=[1])
    with pytest.raises(InputError, match="--keep-columns needs every input file to have the same columns"):
        open_input(str(tmp_path / "d"), keep_columns=True)
    plan = open_input(str(tmp_path / "d" / "a.parquet"), keep_columns=True)
    assert plan.kept_names == {"prompt": "prompt", "cat": "cat"}


def _jsonl(path, recs):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in recs) + "\n")
    return path


def test_openai_batch_rows(tmp_path):
    p = _jsonl(tmp_path / "b.jsonl", [
        {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                  "max_completion_tokens": 5, "temperature": 0.2, "seed": 3}},
        {"custom_id": "c2", "url": "/v1/completions", "body": {"prompt": "once upon", "max_tokens": 4, "stop": "\n"}},
        {"custom_id": "c3", "body": {"messages": [{"role": "user", "content": "x"}], "n": 2}},
        {"custom_id": "c4", "body": {"prompt": ""}},
        {"custom_id": "c5", "body": {"prompt": "x", "stop": []}},      # no stop strings: not the job's
        {"custom_id": "c6", "body": {"prompt": ["a", "b"]}},           # the server's batch: not a row's
        {"custom_id": "c7", "body": {"prompt": [[5, 6]], "temperature": None, "max_tokens": None}},
    ])
    rows = rows_of(p)
    assert rows[4].params == {"stop": []}
    assert rows[5].error_param == "prompt" and "a batch line holds one prompt" in rows[5].error
    assert rows[6].prompt == [5, 6] and rows[6].params == {} and rows[6].error is None   # null: the job's settings
    assert rows[0].messages == [{"role": "user", "content": "hi"}] and rows[0].chat and rows[0].model == "m"
    assert rows[0].params == {"max_tokens": 5, "temperature": 0.2, "seed": 3}
    assert rows[1].prompt == "once upon" and rows[1].params == {"max_tokens": 4, "stop": ["\n"]} and not rows[1].chat
    assert rows[1].model is None                                    # no `model`: the job's
    assert "n must be 1" in rows[2].error and rows[3].error == "prompt: prompt must not be empty"
    assert JobConfig(input=str(p)).output_format() == "openai-batch"


def test_openai_batch_bodies_are_checked_as_the_http_server_checks_them(tmp_path):
    """One set of rules: a row the server would refuse is an error row with the server's message."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    cases = {
        "temp": ({**chat, "temperature": 3}, "temperature"),
        "stops": ({**chat, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        "str-int": ({**chat, "max_tokens": "4"}, "max_tokens"),
        "bool-int": ({**chat, "seed": True}, "seed"),
        "nan": ({**chat, "top_p": float("nan")}, "top_p"),
        "model-null": ({**chat, "model": None}, "model"),
        "role": ({**chat, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        "image": ({**chat, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0"),
        "tools": ({**chat, "tools": [{"type": "function"}]}, "tools"),
        "echo": ({"prompt": "x", "echo": True, "max_tokens": 2}, "echo"),
        "online": ({**chat, "priority": 0}, "priority"),
        "stream": ({**chat, "stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
        "bias": ({**chat, "logit_bias": {"x": 1}}, "logit_bias"),
        "min-over-max": ({**chat, "max_tokens": 3, "min_tokens": 4}, "min_tokens"),
        "allowed-none": ({**chat, "allowed_token_ids": []}, "allowed_token_ids"),
        "bad-regex": ({**chat, "structured_outputs": {"regex": "(a"}}, "structured_outputs"),
        "format-both": ({**chat, "structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
                        "structured_outputs"),
        "format-type": ({**chat, "response_format": {"type": "yaml"}}, "response_format.type"),
        "format-deep": ({**chat, "structured_outputs": {"json": "[" * 5000 + "]" * 5000}}, "structured_outputs"),
    }
    p = _jsonl(tmp_path / "b.jsonl", [{"custom_id": k, "url": "/v1/completions" if "prompt" in b else
                                       "/v1/chat/completions", "body": b} for k, (b, _) in cases.items()]
               + [{"custom_id": "ok", "body": {**chat, "min_p": 0.1, "logit_bias": {"7": -100}, "priority": 1,
                                               "stop_token_ids": [3], "max_completion_tokens": 9, "min_tokens": 4,
                                               "allowed_token_ids": [5, 6]}}])
    rows = {r.id: r for r in rows_of(p)}
    for k, (_, param) in cases.items():
        assert rows[k].error and rows[k].error_param == param, (k, rows[k].error, rows[k].error_param)
    assert "strict" not in rows["temp"].error and "less than or equal to 2" in rows["temp"].error
    ok = rows["ok"]
    assert ok.error is None and ok.params == {"min_p": 0.1, "logit_bias": {7: -100}, "stop_token_ids": [3],
                                              "max_tokens": 9, "min_tokens": 4, "allowed_token_ids": [5, 6]}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "array"}}}
    p = _jsonl(tmp_path / "f.jsonl", [{"custom_id": "rf", "body": {**chat, "response_format": fmt}},
                                      {"custom_id": "so", "body": {"prompt": "x", "structured_outputs": {"choice": ["a"]}}},
                                      {"custom_id": "text", "body": {**chat, "response_format": {"type": "text"}}}])
    rows = {r.id: r for r in rows_of(p)}
    assert rows["rf"].params == {"structured_outputs": {"json": {"type": "array"}}}       # never dropped
    assert rows["so"].params == {"structured_outputs": {"choice": ["a"]}} and rows["text"].params == {}


@pytest.mark.parametrize("line, needle", [
    ("{not json", "line 2: not valid JSON"),
    ('{"custom_id": "b", "body": {"prompt": "x", "max_tokens": 1, "max_tokens": 9}}',
     "line 2: not valid JSON (the key 'max_tokens' appears twice"),             # one value would be dropped
    (json.dumps({"body": {"prompt": "x"}}), "line 2: `custom_id` must be a non-empty string"),
    (json.dumps({"custom_id": "a", "body": {"prompt": "x"}}), "line 2: duplicate custom_id 'a'"),
    (json.dumps({"custom_id": "b", "body": {"input": "x"}}), "line 2: `body` must be an object with `messages` or `prompt`"),
    (json.dumps({"custom_id": "b", "url": "/v1/embeddings", "body": {"prompt": "x"}}), "`url` '/v1/embeddings' is not supported"),
    (json.dumps({"custom_id": "b", "method": "GET", "body": {"prompt": "x"}}), "line 2: `method` 'GET' is not supported"),
    (json.dumps({"custom_id": "b", "body": {"prompt": "x"}, "headers": {}}), "line 2: unsupported field(s) 'headers'"),
    # valid JSON, but no output can hold it (UnicodeEncodeError at the first write, on every run)
    ('{"custom_id": "x\\ud800", "body": {"prompt": "x"}}', "line 2: `custom_id` 'x\\ud800' is not valid Unicode text"),
    ('{"custom_id": "b", "body": {"prompt": "x", "x": ' + "[" * 100_000 + "]" * 100_000 + "}}",
     "line 2: JSON nested too deeply to read"),                                 # was a RecursionError traceback
])
def test_openai_batch_file_errors(tmp_path, line, needle):
    p = _jsonl(tmp_path / "b.jsonl", [{"custom_id": "a", "body": {"prompt": "x"}}, line])
    with pytest.raises(InputError) as e:
        open_input(str(p))
    assert needle in str(e.value) and str(p) in str(e.value)


def test_openai_batch_lines_are_split_at_newlines_only_and_may_start_with_a_bom(tmp_path):
    p = tmp_path / "b.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"custom_id": "a", "body": {"prompt": "hi"}}\r\n'       # BOM, CRLF
                  b'{"custom_id": "b",\r "body": {"prompt": "yo"}}\n')                # a lone CR: whitespace
    assert [(r.id, r.prompt, r.error) for r in rows_of(p)] == [("a", "hi", None), ("b", "yo", None)]


def test_a_file_name_that_is_not_utf8_is_refused_by_name(tmp_path):
    d = tmp_path / "in"
    write_parquet(d / "ok.parquet", prompt=["p"])
    os.rename(d / "ok.parquet", os.fsencode(d) + b"/caf\xe9.parquet")
    with pytest.raises(InputError, match=r"in/caf\\xe9.parquet: the file name is not valid UTF-8; rename the file$"):
        open_input(str(d))
    res = CliRunner().invoke(submit_job, [str(d), "--model", "no-model-needed"], env={"RAY_ADDRESS": ""})
    assert res.exit_code == 2 and "caf\\xe9.parquet: the file name is not valid UTF-8" in res.output, res.output
    assert not (tmp_path / "in.out").exists()


def test_keep_columns_that_would_share_an_output_name_are_refused(tmp_path):
    p = write_parquet(tmp_path / "a.parquet", prompt=["p"], text=["reference"], input_text=["raw"])
    with pytest.raises(InputError, match=r"a.parquet: --keep-columns would carry columns `text` and `input_text` both "
                                         r"as `input_text` \(`text` is renamed: the output has its own `text`\)"):
        open_input(str(p), keep_columns=True)
    assert open_input(str(p)).kept is None                                    # not carried: not refused
    p = write_parquet(tmp_path / "b.parquet", prompt=["p"], text=["reference"], model=["gpt-4"])
    assert open_input(str(p), keep_columns=True).kept_names == {"prompt": "prompt", "text": "input_text",
                                                                "model": "model"}


def test_globs_match_part_by_part_and_skip_hidden_parts_locally_and_in_buckets(tmp_path, monkeypatch):
    """An object-store glob matched the whole key with fnmatch (`*` across `/`): `data/*.parquet` read
    `data/sub/`, `data/_temporary/`, `data/.staging/`; a local `**` read `_temporary/` too."""
    import pyarrow.fs as pafs

    import jobs.input_files as input_files

    for rel in ["data/a.parquet", "data/sub/b.parquet", "data/_temporary/0/part-0.parquet", "data/.staging/c.parquet",
                "data/sub/_tmp/d.parquet"]:
        write_parquet(tmp_path / rel, prompt=["p"])
    bucket = input_files.filesystem        # s3://data/... -> the same tree through pyarrow's LocalFileSystem
    monkeypatch.setattr(input_files, "filesystem", lambda uri: (pafs.LocalFileSystem(), f"{tmp_path}/{uri.split('://')[1]}")
                        if "://" in uri else bucket(uri))
    for pattern, want in [("data/*.parquet", ["data/a.parquet"]), ("data/*/*.parquet", ["data/sub/b.parquet"]),
                          ("data/**/*.parquet", ["data/a.parquet", "data/sub/b.parquet"]),
                          ("data/s?b/*.parquet", ["data/sub/b.parquet"]), ("data/**", ["data/a.parquet", "data/sub/b.parquet"])]:
        for spec in (f"{tmp_path}/{pattern}", f"s3://{pattern}"):
            assert [f[len(str(tmp_path)) + 1:] for f in input_files.resolve_files(spec)[1]] == want, spec


def test_an_existing_path_with_wildcard_characters_is_that_file_or_folder(tmp_path):
    p = write_parquet(tmp_path / "my data [v2].parquet", prompt=["p"])
    write_parquet(tmp_path / "my data 2.parquet", prompt=["other"])           # what `[v2]` as a glob would match
    assert [r.prompt for r in rows_of(p)] == ["p"] and default_output(str(p)) == str(tmp_path / "my data [v2].out")
    d = tmp_path / "runs*?"
    write_parquet(d / "a.parquet", prompt=["q"])
    assert [r.prompt for r in rows_of(d)] == ["q"] and default_output(str(d)) == str(tmp_path / "runs*?.out")
    assert default_output(str(tmp_path / "run[s]*")).startswith(f"{tmp_path}.glob-")   # no such name: a glob


def test_an_existing_bucket_object_with_wildcard_characters_gets_a_literal_files_output(tmp_path, monkeypatch):
    """As on local disk: read as that object or folder, and named as one (not `<folder>.glob-<hash>.out`)."""
    import pyarrow.fs as pafs

    import jobs.input_files as input_files
    from jobs.storage import StorageError

    write_parquet(tmp_path / "bkt/data/my data [v2].parquet", prompt=["p"])
    write_parquet(tmp_path / "bkt/data/my data 2.parquet", prompt=["other"])
    write_parquet(tmp_path / "bkt/runs*?/a.parquet", prompt=["q"])
    bucket = input_files.filesystem        # s3://bkt/... -> the same tree through pyarrow's LocalFileSystem
    monkeypatch.setattr(input_files, "filesystem", lambda uri: (pafs.LocalFileSystem(), f"{tmp_path}/{uri.split('://')[1]}")
                        if "://" in uri else bucket(uri))
    obj = "s3://bkt/data/my data [v2].parquet"
    assert [f.rsplit("/", 1)[1] for f in input_files.resolve_files(obj)[1]] == ["my data [v2].parquet"]
    assert default_output(obj) == "s3://bkt/data/my data [v2].out"
    assert default_output("s3://bkt/runs*?/") == "s3://bkt/runs*?.out"
    assert default_output("s3://bkt/data/my data [2].parquet").startswith("s3://bkt/data.glob-")   # no such name
    def unreachable(uri):
        raise StorageError(f"{uri}: cannot open (no credentials)")
    monkeypatch.setattr(input_files, "filesystem", unreachable)
    assert default_output(obj).startswith("s3://bkt/data.glob-")   # a store it cannot ask: named as a pattern


def test_cli_malformed_file_fails_before_generation(tmp_path):
    p = write_parquet(tmp_path / "bad.parquet", question=["what?"], max_tokens=[1])
    res = CliRunner().invoke(submit_job, [str(p), "--model", "/does/not/matter"], env={"RAY_ADDRESS": ""})
    assert res.exit_code == 2
    assert str(p) in res.output and "needs a `prompt` column (string)" in res.output
    assert not (tmp_path / "bad.out").exists()          # nothing started, nothing written

    pq.write_table(pa.table({"prompt": pa.array([1], pa.int32())}), tmp_path / "typed.parquet")
    res = CliRunner().invoke(submit_job, [str(tmp_path / "typed.parquet")], env={"RAY_ADDRESS": ""})
    assert res.exit_code == 2 and "column `prompt` has type int32; expected string" in res.output


def test_cli_bad_settings(tmp_path):
    p = write_parquet(tmp_path / "in.parquet", prompt=["a"])
    res = CliRunner().invoke(submit_job, [str(p), "--top-p", "2", "--replicas", "0"], env={"RAY_ADDRESS": ""})
    assert res.exit_code == 2 and "top_p" in res.output and "replicas" in res.output


def test_cli_speculation_settings_are_checked_before_anything_runs(tmp_path):
    """`--speculation` takes the serve config's `speculation:` keys as JSON; what is not JSON, a key
    it does not know, a value out of range and speculation with `--draft none` are each refused
    (exit 2) with what was wrong, and nothing is written."""
    from jobs.job_config import JobConfig

    p = write_parquet(tmp_path / "in.parquet", prompt=["a"])
    for value, needle in [("{adaptive: false", "--speculation: not JSON"),
                          ('{"adaptiv": false}', "speculation.adaptiv"),
                          ('{"depth": 0}', "speculation.depth"),
                          ('{"adaptive": false}', "--draft none turns speculation off")]:
        args = [str(p), "--speculation", value] + (["--draft", "none"] if "draft none" in needle else [])
        res = CliRunner().invoke(submit_job, args, env={"RAY_ADDRESS": ""})
        assert res.exit_code == 2 and needle in res.output, (value, res.output)
    assert not (tmp_path / "in.out").exists()
    cfg = JobConfig(input=str(p), speculation={"adaptive": False, "num_draft_tokens": 8})
    assert JobConfig.model_validate_json(cfg.model_dump_json()) == cfg          # the cluster entrypoint's JSON
    assert "speculation" not in cfg.generation_fingerprint()                 # lossless: a resume may change it


def test_cli_with_address_checks_input_before_submitting(tmp_path):
    bad = write_parquet(tmp_path / "bad.parquet", question=["what?"])
    res = CliRunner().invoke(submit_job, [str(bad), "--address", "http://127.0.0.1:9"])
    assert res.exit_code == 2 and "needs a `prompt` column" in res.output     # refused before any network call
    good = write_parquet(tmp_path / "good.parquet", prompt=["hi"])
    res = CliRunner().invoke(submit_job, [str(good)], env={"RAY_ADDRESS": "http://127.0.0.1:9"})
    assert res.exit_code == 1 and "cannot reach" in res.output and "127.0.0.1:9" in res.output
    assert res.output.count("\n") == 1 and "Traceback" not in res.output         # one line (ray_jobs: ConnectionError)


def test_submit_job_flags_table_matches_the_cli():
    """jobs.job_config.SUBMIT_JOB_FLAGS (what the KubeRay renderer checks RayJob entrypoints against)
    is the click command's options, each with whether it takes a value."""
    from jobs.job_config import SUBMIT_JOB_FLAGS, submit_job_args_error

    cli_flags = {}
    for p in submit_job.params:
        if p.param_type_name == "option":
            for name in [*p.opts, *p.secondary_opts]:
                cli_flags[name] = not p.is_flag
    assert SUBMIT_JOB_FLAGS == cli_flags
    assert submit_job_args_error(["/in.parquet", "--keep-columns", "--max-tokens", "8", "--wait"]) is None
    assert "No such option: --no-such-flag" in submit_job_args_error(["/in.parquet", "--no-such-flag"])
    assert "requires an argument" in submit_job_args_error(["/in.parquet", "--model"])
    assert "Missing argument" in submit_job_args_error(["--wait"])
