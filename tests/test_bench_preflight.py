"""`eaglectl bench ...` refuses bad input in its first second, one line naming the option (exit 2),
before any model, Ray or Serve starts; the JSON report is checked before the run and written whole."""
from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from eaglectl.bench import bench as bench_cli
from tests.jobs.test_bench_cli import _no_benchmark

COMMANDS = ("decode", "spec", "job", "serve", "mixed", "prefix", "structured")


@pytest.fixture
def no_benchmark(monkeypatch):
    """Every benchmark's entry point fails the test if reached."""
    _no_benchmark(monkeypatch)


def _refused(args: list[str], hint: str, said: str | None = None) -> str:
    res = CliRunner().invoke(bench_cli, args)
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output   # no traceback
    assert hint in res.output, res.output
    if said is not None:
        assert said in res.output, res.output
    return res.output


@pytest.fixture
def bad_models(tmp_path):
    """Model folders the engine would refuse only once loading: empty, a corrupt config.json, a JSON list,
    a config without weights, weights without a tokenizer."""
    empty, corrupt, listed = tmp_path / "empty", tmp_path / "corrupt", tmp_path / "listed"
    no_weights, no_tokenizer = tmp_path / "no-weights", tmp_path / "no-tokenizer"
    for d in (empty, corrupt, listed, no_weights, no_tokenizer):
        d.mkdir()
    (corrupt / "config.json").write_text("{not json")
    (listed / "config.json").write_text("[1, 2]")
    for d in (no_weights, no_tokenizer):
        (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (no_weights / "tokenizer.json").write_text("{}")
    (no_tokenizer / "model.safetensors").write_bytes(b"")
    return {"empty": (empty, "no config.json"), "corrupt": (corrupt, "not readable JSON"),
            "listed": (listed, "not a JSON object"), "missing": (tmp_path / "nowhere", "no such file or folder"),
            "no weights": (no_weights, "no *.safetensors, pytorch_model*.bin or .gguf checkpoint"),
            "no tokenizer": (no_tokenizer, "has no tokenizer")}


# ---- lists: ASCII digits, no empty items, choices each once -------------------------------------------
@pytest.mark.parametrize("command,option,value", [
    ("decode", "--batch-sizes", "²"), ("serve", "--concurrencies", "³"), ("decode", "--batch-sizes", "٣"),
    ("decode", "--batch-sizes", "1,²"), ("decode", "--batch-sizes", "1,,8"), ("serve", "--concurrencies", "4,"),
    ("decode", "--batch-sizes", "9" * 5000),
])
def test_lists_take_ascii_integers_only(command, option, value, no_benchmark):
    """`²` was int()'s ValueError traceback (str.isdigit() is True for it) and `٣` ran batch 3."""
    _refused([command, option, value], option)


@pytest.mark.parametrize("value,said", [
    ("", "empty"), ("vanilla,lookup,vanilla", "vanilla given more than once"), ("vanilla,vanilla", "more than once"),
    ("bogus", "'bogus'"), ("vanilla,bogus,nope", "'bogus', 'nope'"), ("vanilla,,hybrid", "empty item"),
    ("dynamic,hybrid", "vanilla"), ("vanilla,default", "'default'"),
])
def test_bench_spec_methods_are_a_checked_list(value, said, no_benchmark):
    """`--methods ""` ran every method, `vanilla,vanilla` ran vanilla twice a prompt, `bogus` said only
    "must include vanilla", `vanilla,,hybrid` "unknown method(s) ;"."""
    _refused(["spec", "--methods", value], "--methods", said)


def test_bench_spec_methods_of_the_batch_sweep_are_checked_too(no_benchmark):
    _refused(["spec", "--batch-sizes", "1", "--methods", "vanilla,chain"], "--methods", "'chain'")
    _refused(["spec", "--batch-sizes", "1", "--methods", "vanilla,head,head"], "--methods", "head given more than once")


def test_bench_spec_methods_reach_the_benchmark_parsed(monkeypatch):
    import bench.spec
    import bench.spec_batch

    calls = {}
    monkeypatch.setattr(bench.spec, "run", lambda **k: calls.setdefault("spec", k))
    monkeypatch.setattr(bench.spec_batch, "run", lambda **k: calls.setdefault("batch", k))
    assert CliRunner().invoke(bench_cli, ["spec", "--methods", " vanilla, lookup"]).exit_code == 0
    assert calls["spec"]["methods"] == ("vanilla", "lookup")
    assert CliRunner().invoke(bench_cli, ["spec", "--batch-sizes", "1", "--methods", "vanilla,head"]).exit_code == 0
    assert calls["batch"]["methods"] == ("vanilla", "head")


def test_bench_spec_run_refuses_a_method_twice():
    from bench.spec import run

    with pytest.raises(ValueError, match="more than once"):
        run(model="x", methods=("vanilla", "lookup", "vanilla"), json_out=None)


@pytest.mark.parametrize("value", ["a,a", "b,b", "a,b,a"])
def test_bench_prefix_refuses_a_scenario_twice(value, no_benchmark):
    _refused(["prefix", "--scenarios", value], "--scenarios", "more than once")


# ---- --prompts, --model, --draft: checked before anything loads ---------------------------------------
def test_bench_spec_checks_the_prompt_file_first(tmp_path, no_benchmark):
    """A missing file was FileNotFoundError, a text file JSONDecodeError, each only once engines loaded."""
    text, empty, other = tmp_path / "notes.txt", tmp_path / "empty.jsonl", tmp_path / "other.jsonl"
    text.write_text("just some words\n")
    empty.write_text("\n")
    other.write_text('{"turns": ["fine"]}\n{"prompt": "no turns"}\n')
    for path, said in ((tmp_path / "nonexistent.jsonl", "cannot read it"), (text, "line 1: not JSON"),
                       (empty, "no prompts"), (other, "line 2: not a Spec-Bench record"), (tmp_path, "cannot read it")):
        for extra in ([], ["--batch-sizes", "1"], ["--tp-size", "2"]):
            _refused(["spec", "--prompts", str(path), *extra], "--prompts", said)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_bench_command_checks_its_model_first(command, bad_models, no_benchmark, monkeypatch):
    """An empty folder or a corrupt config.json was the engine's ValueError traceback (bench job: a
    JobFailed from its replica after 11 s)."""
    import bench.job

    monkeypatch.setattr(bench.job, "_variant", lambda *a, **k: pytest.fail("a job ran"))
    for path, said in bad_models.values():
        _refused([command, "--model", str(path)], "--model", said)


@pytest.mark.parametrize("command,extra", [
    ("spec", []), ("spec", ["--batch-sizes", "1"]), ("job", []), ("serve", []), ("mixed", []),
    ("prefix", ["--scenarios", "a"]),
])
def test_every_bench_command_checks_its_draft_first(command, extra, tmp_path, no_benchmark):
    """`spec --draft /bogus` failed after ~40 s of loading the other engines, `serve` in resolve_head,
    `mixed` after a failed Serve deploy; `prefix` started running."""
    (tmp_path / "no-config").mkdir()
    for draft, said in (("/bogus", "not a folder"), (str(tmp_path / "no-config"), "not a head folder")):
        _refused([command, "--draft", draft, *extra], "--draft", said)


def test_builtin_names_pass_the_checks_without_building_or_loading_the_model(monkeypatch, tmp_path):
    """`gemma-3-270m` is resolved by name (eagle_worker.default_models), not by loading it."""
    import bench.prefix
    import bench.spec
    from eagle_worker import default_models

    monkeypatch.setattr(default_models, "materialize", lambda name: pytest.fail("the model was built"))
    calls = []
    for module in (bench.spec, bench.prefix):
        monkeypatch.setattr(module, "run", lambda **k: calls.append(k))
    for args in (["spec", "--draft", "default"], ["prefix", "--draft", "auto", "--scenarios", "a"]):
        res = CliRunner().invoke(bench_cli, [*args, "--model", "gemma-3-270m", "--json", str(tmp_path / "r.json")])
        assert res.exit_code == 0, res.output
    assert len(calls) == 2


def test_a_model_without_a_head_is_refused_only_where_a_method_needs_one(tmp_path, monkeypatch):
    import bench.spec

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (model / "model.safetensors").write_bytes(b"")       # not read: only the files' presence is checked
    (model / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(bench.spec, "run", lambda **k: None)
    _refused(["spec", "--model", str(model)], "--draft", "no built-in draft head")      # the tree methods draft
    res = CliRunner().invoke(bench_cli, ["spec", "--model", str(model), "--methods", "vanilla,lookup"])
    assert res.exit_code == 0, res.output


def test_a_signal_that_stops_a_benchmarks_job_stops_the_benchmark(monkeypatch, tmp_path):
    """SIGTERM stopped the first of `bench job`'s two jobs gracefully, and the benchmark went on to the
    second and reported a partial run; now it ends there, 128 + the signal, writing no report."""
    import jobs.runner

    calls = []

    def stopped(cfg):
        calls.append(cfg.draft)
        return {"status": "cancelled", "runs": [{"stopped_by": "SIGTERM", "wall_s": 1.0}], "rows": 0}

    monkeypatch.setattr(jobs.runner, "run_job", stopped)
    report = tmp_path / "j.json"
    res = CliRunner().invoke(bench_cli, ["job", "--rows", "2", "--max-tokens", "1", "--json", str(report)])
    assert res.exit_code == 143 and isinstance(res.exception, SystemExit), res.output
    assert "stopped by SIGTERM during the 'none' job: nothing reported" in res.output and "Traceback" not in res.output
    assert calls == ["none"] and not report.exists()


@pytest.mark.parametrize("command, args", [("job", ["--rows", "1", "--max-tokens", "1"]), ("mixed", ["--rows", "1"]),
                                           ("prefix", ["--scenarios", "c"])])
def test_a_benchmark_jobs_failure_is_one_line_not_a_traceback(monkeypatch, tmp_path, command, args):
    """A replica that cannot start ended `bench job` (and `mixed`, `prefix`'s scenario c, which run
    jobs too) in a `jobs.replica_pool.JobFailed` traceback."""
    import importlib

    from jobs.replica_pool import JobFailed

    def failing(**kwargs):
        raise JobFailed("replica 0 cannot start: something it cannot fix")

    monkeypatch.setattr(importlib.import_module(f"bench.{command}"), "run", failing)
    res = CliRunner().invoke(bench_cli, [command, *args, "--json", str(tmp_path / "j.json")])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
    assert "replica 0 cannot start" in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("args, named", [(["--methods", "vanilla"], "--methods"), (["--temperature", "1"], "--temperature"),
                                         (["--depth", "3", "--warmup", "2"], "--depth, --warmup")])
def test_the_tp_run_refuses_options_it_would_ignore(args, named):
    res = CliRunner().invoke(bench_cli, ["spec", "--tp-size", "2", *args])
    assert res.exit_code == 2 and f"{named} do" in res.output and "not apply to the TP run" in res.output, res.output


# ---- --json: checked before the run, written atomically -----------------------------------------------
@pytest.mark.parametrize("command,extra", [(c, []) for c in COMMANDS if c != "spec"] + [
    ("spec", []), ("spec", ["--batch-sizes", "1"]), ("spec", ["--tp-size", "2"])])
def test_every_bench_command_checks_its_json_path_first(command, extra, tmp_path, no_benchmark):
    """A JSON path under a file was found only after the benchmark ended, and its results were lost."""
    afile = tmp_path / "afile.txt"
    afile.write_text("keep")
    for path, said in ((afile / "decode.json", "is a file, not a folder"), (tmp_path, "is a folder")):
        _refused([command, "--json", str(path), *extra], "--json", said)
    assert afile.read_text() == "keep" and sorted(p.name for p in tmp_path.iterdir()) == ["afile.txt"]


def test_the_json_check_leaves_nothing_behind(tmp_path):
    from bench.report_file import check_writable

    check_writable(tmp_path / "new" / "deeper" / "r.json")
    assert list(tmp_path.iterdir()) == []


def test_reports_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    import os
    from pathlib import Path

    from bench import report_file

    out = tmp_path / "sub" / "r.json"
    report_file.write_json(out, {"a": 1, "path": Path("x")})
    assert json.loads(out.read_text()) == {"a": 1, "path": "x"}

    def broken(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError):
        report_file.write_json(out, {"a": 2})
    assert json.loads(out.read_text()) == {"a": 1, "path": "x"}        # the old report, whole
    assert [p.name for p in out.parent.iterdir()] == ["r.json"]       # no temp file left


def test_every_bench_module_writes_its_report_through_the_shared_helper():
    """One way to write a report: no module writes its JSON in place (half a file if cut short)."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "bench"
    for path in root.glob("*.py"):
        src = path.read_text()
        assert not re.search(r"write_text\(json\.dumps", src), path.name
    for name in ("decode", "spec", "spec_batch", "spec_tp", "job", "serve", "mixed", "prefix", "cuda_check", "structured"):
        assert "write_json(" in (root / f"{name}.py").read_text(), name


# ---- help ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", COMMANDS)
def test_help_names_only_options_that_exist(command):
    """`bench spec --help` pointed to a `--sweep` option that does not exist."""
    cmd = bench_cli.commands[command]
    res = CliRunner().invoke(bench_cli, [command, "--help"], terminal_width=200)
    assert res.exit_code == 0
    known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", res.output))
    assert named <= known, named - known
