"""Input and settings rules found by an attacker sweep, without Ray: uint64 ids beyond int64, per-row
sampling columns (taken or refused, never ignored), a row with both `prompt` and `messages`, a folder
mixing formats, `--device cuda` without CUDA, a `--model` path that does not exist (all refused up
front, exit 2, nothing written), and duplicate ids (exit 3; a resume's committed rows are not
duplicates). Jobs that generate run on a fake pool in-process (`fake_pool`)."""
from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from eagle_worker.sampling_params import SamplingParams
from eaglectl.jobs import submit_job
from jobs.driver import RESULT_MARKER, drive
from jobs.input_reader import InputError, iter_rows, open_input
from jobs.job_config import JobConfig, JobConfigError
from jobs.runner import JobRunner, row_params

from .conftest import read_manifest, read_rows, write_parquet

ENV = {"RAY_ADDRESS": ""}


def rows_of(spec, **kw):
    return list(iter_rows(open_input(str(spec), **kw)))


@pytest.fixture
def no_ray(monkeypatch):
    """A refusal must come before Ray and replicas start (without it these tests would start them)."""
    monkeypatch.setattr(JobRunner, "_start_pool", lambda self: pytest.fail("Ray and replicas started"))


# ---- 1. uint64 ids ------------------------------------------------------------------------------
@pytest.mark.parametrize("stats", [True, False])
def test_uint64_ids_beyond_int64_are_refused_up_front(tmp_path, stats, no_ray):
    p = tmp_path / "big.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "id": pa.array([1, 2**64 - 1], pa.uint64())}), p,
                   write_statistics=stats)
    with pytest.raises(InputError, match=r"big.parquet: the uint64 `id` column holds 18446744073709551615 in row "
                                         r"group 0, above the int64 maximum"):
        open_input(str(p))
    res = CliRunner().invoke(submit_job, [str(p), "--model", "no-model-needed"], env=ENV)
    assert res.exit_code == 2 and str(p) in res.output and "uint64 `id`" in res.output, res.output
    assert not (tmp_path / "big.out").exists()


def test_uint64_ids_that_fit_are_integer_ids(tmp_path):
    p = tmp_path / "ok.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "id": pa.array([1, 2**63 - 1], pa.uint64())}), p)
    plan = open_input(str(p))
    assert plan.id_type == pa.int64() and [r.id for r in iter_rows(plan)] == [1, 2**63 - 1]


# ---- 2. per-row sampling columns ----------------------------------------------------------------
def test_engine_sampling_columns_are_per_row_settings(tmp_path):
    bias = pa.array([[(5, 1.5)], None, [(7, 1.0), (7, 2.0)]], pa.map_(pa.int64(), pa.float64()))
    p = write_parquet(tmp_path / "s.parquet", prompt=["a", "b", "c"], min_p=[0.1, 2.0, None],
                      presence_penalty=[0.5, None, None], frequency_penalty=pa.array([1, None, None], pa.int32()),
                      repetition_penalty=[1.2, None, None], stop_token_ids=[[3, 4], None, None], logit_bias=bias,
                      ignore_eos=[True, None, None], include_stop_str_in_output=[False, None, None],
                      min_tokens=[2, None, None], allowed_token_ids=[[3, 4, 9], None, None], category=["x", "y", "z"])
    a, b, c = rows_of(p)
    assert a.params == {"min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": 1, "repetition_penalty": 1.2,
                        "stop_token_ids": [3, 4], "logit_bias": {5: 1.5}, "ignore_eos": True,
                        "include_stop_str_in_output": False, "min_tokens": 2, "allowed_token_ids": [3, 4, 9]} \
        and a.error is None and a.extra == {}
    cfg = JobConfig(input=str(p), max_tokens=4)
    sp = SamplingParams(**row_params(cfg, a))          # what the replica builds from a row's params
    assert sp.min_p == 0.1 and sp.logit_bias == {5: 1.5} and sp.stop_token_ids == [3, 4] and sp.ignore_eos
    assert sp.min_tokens == 2 and sp.allowed_token_ids == [3, 4, 9]
    with pytest.raises(ValueError, match=r"SamplingParams\.min_p must be in \[0, 1\], got 2.0"):
        SamplingParams(**row_params(cfg, b))           # the replica's Rejected: an error row naming the field
    assert c.error == "logit_bias: a token id appears more than once"


def test_token_lists_longer_than_the_servers_cap_are_error_rows(tmp_path):
    long_ids = list(range(1025))
    p = write_parquet(tmp_path / "l.parquet", prompt=["a", "b", "c"],
                      allowed_token_ids=[long_ids, None, list(range(1024))], stop_token_ids=[None, long_ids, None])
    a, b, c = rows_of(p)
    assert (a.error_param, b.error_param, c.error) == ("allowed_token_ids", "stop_token_ids", None)
    assert a.error == "allowed_token_ids: at most 1024 token ids per row, got 1025"


def test_structured_outputs_is_a_per_row_json_column(tmp_path):
    """vLLM's structured_outputs as JSON text per row: an object reaches SamplingParams; text that is not
    a JSON object, or a spec the engine refuses, is an error row naming the column."""
    specs = ['{"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}', '{"choice": ["x", "y"]}',
             None, "{oops", '["regex"]', '{"regex": "a", "choice": ["b"]}', "[" * 100_000 + "]" * 100_000,
             '{"regex": "a", "regex": "b"}']
    p = write_parquet(tmp_path / "so.parquet", prompt=list("abcdefgh"), structured_outputs=specs)
    a, b, c, d, e, f, g, h = rows_of(p)
    assert "the key 'regex' appears twice" in h.error and h.error_param == "structured_outputs"
    assert g.error == "structured_outputs: nested too deeply" and f.error is None     # that row alone
    cfg = JobConfig(input=str(p), max_tokens=4)
    assert SamplingParams(**row_params(cfg, a)).structured_outputs.json["properties"] == {"a": {"type": "integer"}}
    assert SamplingParams(**row_params(cfg, b)).structured_outputs.choice == ["x", "y"]
    assert "structured_outputs" not in c.params and SamplingParams(**row_params(cfg, c)).structured_outputs is None
    assert (d.error_param, e.error_param) == ("structured_outputs", "structured_outputs")
    assert d.error.startswith("structured_outputs: not valid JSON") and e.error == \
        "structured_outputs: must be a JSON object, got list"
    with pytest.raises(ValueError, match=r"SamplingParams\.structured_outputs must set exactly one"):
        SamplingParams(**row_params(cfg, f))           # the replica's Rejected: an error row naming the field
    bad = write_parquet(tmp_path / "so-int.parquet", prompt=["a"], structured_outputs=[3])
    with pytest.raises(InputError, match=r"column `structured_outputs` .*string"):
        open_input(str(bad))


@pytest.mark.parametrize("column, value", [("n", [2]), ("best_of", [2]), ("logprobs", [5]), ("top_logprobs", [3]),
                                           ("max_completion_tokens", [8])])
def test_sampling_columns_a_row_cannot_take_are_refused_by_name(tmp_path, column, value, no_ray):
    p = write_parquet(tmp_path / "u.parquet", prompt=["a"], **{column: value})
    res = CliRunner().invoke(submit_job, [str(p), "--model", "no-model-needed"], env=ENV)
    assert res.exit_code == 2 and f"u.parquet: column `{column}` is not a per-row setting" in res.output, res.output
    assert not (tmp_path / "u.out").exists()


@pytest.mark.parametrize("column, meant", [("temprature", "temperature"), ("Max-Tokens", "max_tokens"),
                                           ("message", "messages")])
def test_a_column_that_is_a_typo_of_a_setting_is_refused_not_dropped(tmp_path, column, meant, no_ray):
    p = write_parquet(tmp_path / "typo.parquet", prompt=["a"], **{column: [0.5]})
    res = CliRunner().invoke(submit_job, [str(p), "--model", "no-model-needed"], env=ENV)
    assert res.exit_code == 2 and f"column `{column}` is not read; did you mean `{meant}`?" in res.output, res.output
    assert not (tmp_path / "typo.out").exists()
    assert open_input(str(p), keep_columns=True).files          # carried as data when asked, not refused
    assert open_input(str(write_parquet(tmp_path / "ok.parquet", prompt=["a"], category=["x"]))).files


def test_an_empty_stop_string_in_a_row_is_an_error_row_naming_stop(tmp_path):
    p = write_parquet(tmp_path / "e.parquet", prompt=["a", "b"], stop=["", "x"])
    empty, fine = rows_of(p)
    cfg = JobConfig(input=str(p), max_tokens=4)
    with pytest.raises(ValueError, match="SamplingParams.stop must not hold an empty string"):
        SamplingParams(**row_params(cfg, empty))
    assert SamplingParams(**row_params(cfg, fine)).stop == ["x"]


def test_per_row_columns_of_a_wrong_type_are_refused(tmp_path):
    p = write_parquet(tmp_path / "t.parquet", prompt=["a"], stop_token_ids=["3"])
    with pytest.raises(InputError, match="column `stop_token_ids` has type string; expected list<integer>"):
        open_input(str(p))


def test_a_row_with_both_prompt_and_messages_is_an_error_row(tmp_path):
    msgs = [[{"role": "user", "content": "hi"}], None, [{"role": "user", "content": "yo"}]]
    p = write_parquet(tmp_path / "b.parquet", prompt=["a", "b", None], messages=msgs)
    both, prompt, chat = rows_of(p)
    assert both.error == "both `prompt` and `messages` are set; give a row one of them"
    assert prompt.prompt == "b" and prompt.error is None and not prompt.chat
    assert chat.messages == [{"role": "user", "content": "yo"}] and chat.chat and chat.error is None


# ---- 4. a folder mixing formats -----------------------------------------------------------------
def test_a_folder_mixing_parquet_and_jsonl_is_refused_and_other_files_are_named(tmp_path, caplog, no_ray):
    d = tmp_path / "mixed"
    for name in ("a.parquet", "d.PARQUET", "e.parq"):
        write_parquet(d / name, prompt=["p"])
    (d / "c.csv").write_text("prompt\nhello\n")
    (d / "_SUCCESS").write_text("")
    (d / ".hidden.csv").write_text("")
    with caplog.at_level(logging.WARNING, logger="jobs.input_files"):
        plan = open_input(str(d))
    assert [f.label for f in plan.files] == ["a.parquet", "d.PARQUET"]
    warned = [r.getMessage() for r in caplog.records if r.name == "jobs.input_files"]
    assert len(warned) == 1 and "skipping 2 file(s)" in warned[0] and "c.csv, e.parq" in warned[0], warned
    assert "_SUCCESS" not in warned[0] and ".hidden" not in warned[0]

    (d / "b.jsonl").write_text('{"custom_id": "x", "body": {"prompt": "hi"}}\n')
    with pytest.raises(InputError, match=r"mixed: mixes Parquet and JSONL files; use one format per job "
                                         r"\(e.g. a.parquet and b.jsonl\)"):
        open_input(str(d))
    res = CliRunner().invoke(submit_job, [str(d)], env=ENV)
    assert res.exit_code == 2 and "mixes Parquet and JSONL files" in res.output
    with pytest.raises(InputError, match="mixes Parquet and JSONL files; use one format per job$"):
        open_input(str(d / "*"))                                # the glob: the same words


# ---- 3, 6. settings this machine cannot run -----------------------------------------------------
def test_device_cuda_without_cuda_is_refused_before_ray_starts(tmp_path, tiny_model, monkeypatch, no_ray):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    p = write_parquet(tmp_path / "in.parquet", prompt=["a"])
    res = CliRunner().invoke(submit_job, [str(p), "--model", tiny_model, "--device", "cuda"], env=ENV)
    assert res.exit_code == 2 and "--device cuda: CUDA is not available on this machine" in res.output, res.output
    assert not (tmp_path / "in.out").exists()
    cfg = JobConfig(input=str(p), model="/not/on/the/client", device="cuda")
    JobRunner(cfg, "http://head:8265")._check_this_machine()   # a cluster's GPUs and paths are not this machine's


@pytest.mark.parametrize("model", ["{tmp}/nope", "./no-such-model-dir", "../no-such-model-dir", "~/no-such-model-dir"])
def test_a_model_path_that_does_not_exist_is_refused_up_front(tmp_path, model, no_ray):
    p = write_parquet(tmp_path / "in.parquet", prompt=["a"])
    model = model.format(tmp=tmp_path)
    res = CliRunner().invoke(submit_job, [str(p), "--model", model], env=ENV)
    assert res.exit_code == 2 and f"--model {model}: no such file or folder" in res.output, res.output
    assert not (tmp_path / "in.out").exists()


def test_a_max_model_len_beyond_the_models_context_is_refused_up_front(tmp_path, tiny_model, no_ray, monkeypatch):
    """The tiny model's config says 512 positions: a replica would refuse 1024 only once Ray and it started."""
    p = write_parquet(tmp_path / "in.parquet", prompt=["a"])
    res = CliRunner().invoke(submit_job, [str(p), "--model", tiny_model, "--max-model-len", "1024"], env=ENV)
    assert res.exit_code == 2, res.output
    assert f"--max-model-len 1024: more than the model's context of 512 tokens ({tiny_model})" in res.output
    assert not (tmp_path / "in.out").exists()
    JobRunner(JobConfig(input=str(p), model=tiny_model, max_model_len=512), "local")._check_this_machine()
    # the built-in model: its config once materialised (here a stand-in cache), nothing to check before
    monkeypatch.setenv("EAGLE_CACHE_DIR", str(tmp_path / "cache"))
    JobRunner(JobConfig(input=str(p), max_model_len=10**6), "local")._check_this_machine()
    (tmp_path / "cache" / "gemma-3-270m").mkdir(parents=True)
    (tmp_path / "cache" / "gemma-3-270m" / "config.json").write_text('{"max_position_embeddings": 32768}')
    with pytest.raises(JobConfigError, match="more than the model's context of 32768 tokens"):
        JobRunner(JobConfig(input=str(p), max_model_len=40000), "local")._check_this_machine()


def test_model_names_that_are_not_paths_are_left_to_the_engine(tmp_path):
    p = write_parquet(tmp_path / "in.parquet", prompt=["a"])
    for model in ("gemma-3-270m", "some-org/some-model"):
        JobRunner(JobConfig(input=str(p), model=model), "local")._check_this_machine()
    with pytest.raises(JobConfigError):
        JobRunner(JobConfig(input=str(p), model=str(tmp_path / "nope")), "local")._check_this_machine()


# ---- 5. duplicate ids ---------------------------------------------------------------------------
class FakePool:
    """The replica pool's face, answering at once: what a replica would (SamplingParams refusals too)."""
    accepting = True

    def __init__(self):
        self.sent, self.done = [], []

    def free_slots(self) -> int:
        return 8

    @property
    def in_flight(self) -> int:
        return len(self.done)

    def submit(self, row, params) -> None:
        self.sent.append((row.id, params))
        try:
            SamplingParams(**params)
            res = {"text": f"re: {row.prompt}", "finish_reason": "length", "prompt_tokens": 1, "completion_tokens": 1,
                   "accepted_tokens_per_step": 1.0}
        except ValueError as e:
            res = {"error": str(e)}
        self.done.append((row, res))

    def poll(self, timeout):
        done, self.done = self.done, []
        return done, []

    def shutdown(self) -> None:
        pass


@pytest.fixture
def fake_pool(monkeypatch):
    pools = []

    def start(self):
        self.pool = FakePool()
        pools.append(self.pool)
    monkeypatch.setattr(JobRunner, "_start_pool", start)
    return pools


def test_duplicate_ids_exit_3_and_committed_rows_of_a_resume_are_not_duplicates(tmp_path, fake_pool, capsys):
    dup = write_parquet(tmp_path / "dup.parquet", id=["a", "b", "a"], prompt=["x", "y", "DIFFERENT"])
    cfg = JobConfig(input=str(dup), model="no-model-needed", draft="none")
    assert drive(cfg, "local") == 3
    out = capsys.readouterr().out
    assert RESULT_MARKER in out and "1 input row(s) skipped: their id was already used" in out
    assert "1 duplicate ids skipped" in out
    m = read_manifest(tmp_path / "dup.out")
    assert m["duplicate_ids_skipped"] == 1 and not m["complete"] and m["rows"] == 2 and m["error_rows"] == 0
    assert {r["id"]: r["text"] for r in read_rows(tmp_path / "dup.out")} == {"a": "re: x", "b": "re: y"}
    assert drive(cfg, "local") == 3                              # the input still has it
    assert read_manifest(tmp_path / "dup.out")["last_noop_rerun"]["skipped_already_done"] == 2

    ok = write_parquet(tmp_path / "ok.parquet", id=["a", "b"], prompt=["x", "y"], min_p=[0.5, None])
    cfg = JobConfig(input=str(ok), model="no-model-needed", draft="none")
    assert drive(cfg, "local") == 0 and read_manifest(tmp_path / "ok.out")["complete"]
    assert fake_pool[-1].sent[0][1]["min_p"] == 0.5               # a per-row setting reaches the replica
    assert drive(cfg, "local") == 0                              # a resume: committed rows are not duplicates
    m = read_manifest(tmp_path / "ok.out")
    assert m["complete"] and m["duplicate_ids_skipped"] == 0 and m["last_noop_rerun"]["skipped_already_done"] == 2


def test_a_replicas_refusal_of_a_format_is_an_error_row_naming_the_column(tmp_path, fake_pool):
    """The replica refuses a spec with two kinds (SamplingParams.structured_outputs ...): the row's error
    reads as the input's field, as the HTTP server words it; the other row runs."""
    p = write_parquet(tmp_path / "so.parquet", id=["two", "ok"], prompt=["a", "b"],
                      structured_outputs=['{"regex": "a", "choice": ["b"]}', '{"choice": ["x"]}'])
    assert drive(JobConfig(input=str(p), model="no-model-needed", draft="none"), "local") == 3
    rows = {r["id"]: r for r in read_rows(tmp_path / "so.out")}
    assert rows["two"]["error"].startswith("structured_outputs: must set exactly one"), rows["two"]["error"]
    assert rows["ok"]["error"] is None


def test_truncate_prompt_tokens_is_a_job_setting_and_a_per_row_column(tmp_path, fake_pool):
    p = write_parquet(tmp_path / "t.parquet", id=["job", "row"], prompt=["a", "b"], truncate_prompt_tokens=[None, 7],
                      bad_words=[None, ["x", "y z"]])
    assert drive(JobConfig(input=str(p), model="no-model-needed", draft="none", truncate_prompt_tokens=-1), "local") == 0
    assert {rid: params["truncate_prompt_tokens"] for rid, params in fake_pool[-1].sent} == {"job": -1, "row": 7}
    assert [params.get("bad_words") for _, params in fake_pool[-1].sent] == [None, ["x", "y z"]]
    many = write_parquet(tmp_path / "many.parquet", prompt=["a"], bad_words=[["w"] * 1025])
    assert rows_of(many)[0].error == "bad_words: at most 1024 words per row, got 1025"
    ints = write_parquet(tmp_path / "ints.parquet", prompt=["a"], bad_words=[[3]])
    with pytest.raises(InputError, match=r"column `bad_words` .*list<string>"):
        open_input(str(ints))
    res = CliRunner().invoke(submit_job, [str(p), "--model", "no-model-needed", "--truncate-prompt-tokens", "0"], env=ENV)
    assert res.exit_code == 2 and "truncate_prompt_tokens" in res.output and "got 0" in res.output, res.output


# ---- 7. carried columns, the output format of JSONL input -----------------------------------------
def test_kept_columns_named_like_a_results_keys_keep_their_input_values(tmp_path, fake_pool):
    """`{..., **row.extra, "chat": ..., "model": ...}`: a kept `model` or `chat` column took the job's values,
    and `forwards` or `cached_tokens` columns counted as the row's engine figures."""
    p = write_parquet(tmp_path / "k.parquet", id=[1, 2], prompt=["x", ""], model=["gpt-4", "claude"],
                      chat=[True, False], forwards=[7, 8], cached_tokens=[5, 6], error_param=["a", "b"])
    cfg = JobConfig(input=str(p), model="no-model-needed", draft="none", keep_columns=True)
    assert drive(cfg, "local") == 3                                     # row 2 is an error row (empty prompt)
    rows = {r["id"]: r for r in read_rows(tmp_path / "k.out")}
    assert [rows[1][k] for k in ("text", "model", "chat", "forwards", "cached_tokens")] == ["re: x", "gpt-4", True, 7, 5]
    assert [rows[2][k] for k in ("error", "model", "error_param")] == ["prompt is empty", "claude", "b"]
    m = read_manifest(tmp_path / "k.out")
    assert m["runs"][-1]["target_forwards"] == 0 and m["prefix_cache"]["cached_prompt_tokens"] == 0


def test_jsonl_in_a_folder_or_glob_gets_openai_batch_output_and_parquet_output_refuses_logprobs(tmp_path, fake_pool):
    """The default format was chosen by the input's name (`.jsonl`): a folder of Batch files got Parquet
    output, and the logprobs its rows asked for were dropped without a word."""
    import json

    d = tmp_path / "batches"
    d.mkdir()
    (d / "b.jsonl").write_text(json.dumps({"custom_id": "a", "body": {"prompt": "hi", "logprobs": 2}}) + "\n"
                               + json.dumps({"custom_id": "b", "body": {"prompt": "yo"}}) + "\n")
    for spec, out in [(d, tmp_path / "batches.out"), (d / "*.jsonl", tmp_path / "glob")]:
        cfg = JobConfig(input=str(spec), output=str(out), model="no-model-needed", draft="none")
        assert drive(cfg, "local") == 0
        assert [p.suffix for p in out.glob("part-*")] == [".jsonl"] and read_manifest(out)["format"] == "openai-batch"
        assert drive(cfg, "local") == 0                                 # its resume: the same format
    cfg = JobConfig(input=str(d), output=str(tmp_path / "pq"), format="parquet", model="no-model-needed", draft="none")
    assert drive(cfg, "local") == 3
    rows = {r["id"]: r for r in read_rows(tmp_path / "pq")}
    assert rows["a"]["error"].startswith("logprobs: the Parquet output has no logprobs") and rows["b"]["error"] is None
    cfg = JobConfig(input=str(d), output=str(tmp_path / "kept"), keep_columns=True, model="no-model-needed")
    assert drive(cfg, "local") == 2 and not (tmp_path / "kept").exists()   # as for one .jsonl file


def test_a_batch_line_without_a_seed_samples_with_its_rows_stable_seed():
    """The HTTP request models draw a random seed for an unseeded request; a Batch line goes through
    them but keeps the job's seed by row id (a resume samples the row the same), or the one it gives."""
    from jobs.openai_requests import openai_row
    from jobs.runner import row_seed

    cfg = JobConfig(input="x.jsonl")
    line = {"custom_id": "r1", "method": "POST", "url": "/v1/completions",
            "body": {"model": "m", "prompt": "hi", "temperature": 1.0}}
    row = openai_row(line)
    assert row.error is None and row_params(cfg, row)["seed"] == row_seed("r1")
    seeded = openai_row({**line, "body": {**line["body"], "seed": 11}})
    assert row_params(cfg, seeded)["seed"] == 11
