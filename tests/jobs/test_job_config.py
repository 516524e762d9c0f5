"""JobConfig at the edge, without Ray: every setting out of range (NaN, infinities, seeds outside the
engine's range, counts beyond 32 bits) is refused by name at config time (exit 2) rather than
turning every row into an error row; `--serve-app` refuses an own-replica flag the user gave, even
at its default value, while the driver's resolved JSON (every field present) still runs."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from eaglectl.jobs import submit_job
from jobs.job_config import RESOLVED, JobConfig, JobConfigError


@pytest.mark.parametrize("field, value", [
    ("temperature", float("inf")), ("temperature", float("nan")), ("top_p", float("nan")),
    ("cpus_per_replica", float("inf")), ("startup_timeout_s", float("inf")), ("commit_interval_s", float("inf")),
    ("log_interval_s", float("nan")), ("seed", -1), ("seed", 2**63), ("seed", 99999999999999999999),
    ("max_tokens", 2**31), ("top_k", 10**20), ("replicas", 10**20), ("rows_per_file", 2**40),
    ("max_in_flight", 2**31), ("max_model_len", 2**63),
])
def test_out_of_range_settings_are_refused_by_name(field, value):
    with pytest.raises(JobConfigError, match=rf"invalid job settings:\n  {field}: "):
        JobConfig.from_options(input="x.parquet", **{field: value})


@pytest.mark.parametrize("stop", ["", ["a", ""]])
def test_an_empty_stop_string_is_refused(stop):
    with pytest.raises(JobConfigError, match="stop: .*empty string"):
        JobConfig.from_options(input="x.parquet", stop=stop)


def test_the_edges_of_the_ranges_are_accepted():
    cfg = JobConfig.from_options(input="x.parquet", seed=2**63 - 1, temperature=2.0, max_tokens=2**31 - 1)
    assert cfg.seed == 2**63 - 1
    assert JobConfig.from_options(input="x.parquet", seed=0).seed == 0


@pytest.mark.parametrize("args, field", [
    (["--temperature", "inf"], "temperature"), (["--temperature", "-inf"], "temperature"),
    (["--seed", "-1"], "seed"), (["--seed", "99999999999999999999"], "seed"),
    (["--commit-interval", "inf"], "commit_interval_s"), (["--max-tokens", "99999999999"], "max_tokens"),
])
def test_cli_refuses_them_before_anything_runs(tmp_path, args, field):
    res = CliRunner().invoke(submit_job, [str(tmp_path / "in.parquet"), *args], env={"RAY_ADDRESS": ""})
    assert res.exit_code == 2 and f"{field}: " in res.output and "Traceback" not in res.output, res.output
    assert not (tmp_path / "in.out").exists()


@pytest.mark.parametrize("args, flag", [
    (["--model", "gemma-3-270m"], "--model"), (["--draft", "auto"], "--draft"), (["--dtype", "float32"], "--dtype"),
    (["--device", "cpu"], "--device"), (["--replicas", "1"], "--replicas"), (["--max-num-seqs", "64"], "--max-num-seqs"),
    (["--enable-prefix-caching"], "--enable-prefix-caching/--no-enable-prefix-caching"),
])
def test_serve_app_refuses_own_replica_flags_given_at_their_default(args, flag):
    res = CliRunner().invoke(submit_job, ["x.parquet", "--serve-app", "tiny", "--max-tokens", "2", *args])
    assert res.exit_code == 2, res.output
    assert f"--serve-app tiny: {flag} only applies to a job's own replicas" in res.output and "(drop it," in res.output


def test_serve_app_refusal_names_every_flag_given():
    res = CliRunner().invoke(submit_job, ["x.parquet", "--serve-app", "tiny", "--model", "gemma-3-270m",
                                          "--device", "cpu"])
    assert res.exit_code == 2 and "--model, --device only apply to" in res.output and "(drop them," in res.output


def test_own_replica_flags_at_their_defaults_are_fine_without_serve_app():
    cfg = JobConfig.from_options(input="x.parquet", model="gemma-3-270m", draft="auto", dtype="float32", replicas=1,
                                 enable_prefix_caching=True)
    assert cfg.generation_fingerprint() == JobConfig(input="x.parquet").generation_fingerprint()   # resumes alike


def test_the_drivers_resolved_json_of_a_serve_app_job_runs():
    """The Ray job entrypoint carries every field (jobs/ray_jobs.py dumps the whole config): the driver
    reads it as resolved, so the defaults there are not taken for flags the user gave."""
    from jobs.ray_jobs import entrypoint

    cfg = JobConfig.from_options(input="/data/x.parquet", serve_app="tiny", max_tokens=8).absolute()
    raw = entrypoint(cfg).split("--config-json ", 1)[1].strip("'")
    assert JobConfig.model_validate_json(raw, context=RESOLVED) == cfg
    with pytest.raises(ValueError, match="--model"):          # the same JSON as user input: every field given
        JobConfig.model_validate_json(raw)
    app = cfg.with_app_engine({"model": "/models/tiny", "dtype": "float32", "draft": None})
    assert app.model == "/models/tiny" and app.serve_app == "tiny"   # the app's settings, not a refusal


@pytest.mark.parametrize("inp, out", [("x.parquet", "./x.parquet"), ("data/x.parquet", "data//x.parquet"),
                                      ("s3://b/in.parquet", "s3://b//in.parquet")])
def test_an_output_that_is_the_input_is_refused_at_config_time(inp, out):
    """Before anything runs, and in what `eaglectl deploy render` checks for a RayJob as well."""
    with pytest.raises(JobConfigError, match="is the input itself"):
        JobConfig.from_options(input=inp, output=out)
    assert JobConfig.from_options(input=inp, output=out + ".out").output == out + ".out"


def test_an_output_name_that_is_not_utf8_is_refused_at_config_time():
    """A shell passes undecodable bytes as surrogates: pyarrow's file system failed on them with a
    UnicodeEncodeError traceback once the job had started."""
    with pytest.raises(JobConfigError, match=r"outbad\\udcff: not valid UTF-8"):
        JobConfig.from_options(input="x.parquet", output="outbad\udcff")
