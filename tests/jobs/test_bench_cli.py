"""`eaglectl bench spec` refuses options it cannot report on, before loading any model; `python -m
bench.NAME` points to `eaglectl bench NAME`."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from eaglectl.bench import bench_spec


@pytest.mark.parametrize("name", ["decode", "spec", "job", "serve", "mixed"])
def test_python_m_bench_points_to_the_cli(name, monkeypatch):
    """`python -m bench.NAME` used to run spec and decode with their defaults whatever the arguments
    said; the options live in `eaglectl bench NAME` alone, and the module says so instead of running."""
    import runpy

    monkeypatch.setattr("sys.argv", [f"bench/{name}.py", "--max-tokens", "1"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module(f"bench.{name}", run_name="__main__")
    assert f"eaglectl bench {name}" in str(done.value.code)


def test_bench_spec_needs_vanilla():
    res = CliRunner().invoke(bench_spec, ["--methods", "dynamic,hybrid"])
    assert res.exit_code == 2
    assert "--methods" in res.output and "vanilla" in res.output


def test_bench_spec_needs_at_least_one_round():
    res = CliRunner().invoke(bench_spec, ["--rounds", "0"])
    assert res.exit_code == 2
    assert "--rounds" in res.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_bench_spec_on_a_missing_gpu_says_so():
    res = CliRunner().invoke(bench_spec, ["--device", "cuda"])
    assert res.exit_code == 2
    assert "--device" in res.output and "CUDA is not available" in res.output


def test_bench_spec_warms_up_on_prompts_it_does_not_measure(tmp_path):
    from bench.prompts import SPEC_BENCH, load_questions, render
    from bench.spec import _warmup_prompts

    measured = {render(r) for r in load_questions(SPEC_BENCH, per_category=2)}
    warm = _warmup_prompts(SPEC_BENCH, 2, 4)
    assert len(warm) == 4 and not set(warm) & measured
    cats = {r["category"] for r in load_questions(SPEC_BENCH, per_category=3) if render(r) in warm}
    assert len(cats) == 4                                    # spread over categories
    assert _warmup_prompts(SPEC_BENCH, 2, 0) == []
    small = tmp_path / "q.jsonl"                             # a file with nothing else: its own prompts
    small.write_text('{"category": "a", "turns": ["hi"]}\n')
    assert _warmup_prompts(small, 2, 4) == [render({"turns": ["hi"]})]
    res = CliRunner().invoke(bench_spec, ["--warmup", "-1"])
    assert res.exit_code == 2 and "--warmup" in res.output


def test_bench_spec_rotates_the_order_and_takes_each_prompts_median_time(monkeypatch, tmp_path):
    import json

    import bench.spec as bs

    calls = []

    def fake_runners(model, dtype, draft, methods, tree, max_tokens, temperature, warm_prompts, device):
        def runner(method):
            def run(ps, shares=None):
                calls.append((method, ps[0]))
                secs = 1.0 if method == "vanilla" else 0.5
                if method == "lookup" and "aq0\n" in ps[0] and calls.count((method, ps[0])) == 2:
                    secs = 50.0                                  # a slow spell during one pass
                if shares is not None:                           # the hybrid's 3 lookup steps a prompt
                    shares["steps_lookup"] = shares.get("steps_lookup", 0) + 3
                return secs, 10, 10 if method == "vanilla" else 4
            return run
        return {m: runner(m) for m in methods}, {}

    monkeypatch.setattr(bs, "_runners", fake_runners)
    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps({"category": c, "turns": [f"{c}q{i}"]}) + "\n" for c in ("a", "b") for i in range(2)))
    rep = bs.run(model="x", prompts_file=q, per_category=2, methods=("vanilla", "lookup", "hybrid"),
                 json_out=None, rounds=3, warmup=0)
    assert len(calls) == 3 * 4 * 3                               # every method, prompt and round
    firsts = [calls[i][0] for i in range(0, len(calls), 3)]
    assert firsts[:4] == ["vanilla", "lookup", "hybrid", "vanilla"]   # the order rotates per prompt ...
    assert firsts[4:6] == ["lookup", "hybrid"]                   # ... and per round
    s = rep["summary"]
    assert s["lookup"]["a"]["tok_s"] == s["lookup"]["b"]["tok_s"] == 20.0   # the slow pass's median drops it
    assert s["lookup"]["overall"]["speedup"] == 2.0 and s["lookup"]["a"]["tau"] == 2.5
    assert rep["results"]["hybrid"]["a"]["steps_by_source"] == {"lookup": 6.0}   # per pass over 2 prompts
    # hybrid against lookup pass by pass: level (both 0.5 s) but for the slow pass, which the median drops
    level = rep["paired"]["hybrid/lookup"]
    assert level["a"]["ratio"] == level["b"]["ratio"] == 1.0 and level["a"]["pairs"] == 6
    assert level["a"]["ci95"][0] == 1.0 and level["a"]["ci95"][1] >= 1.0 and level["b"]["ci95"] == [1.0, 1.0]
    assert rep["paired"]["hybrid/vanilla"]["overall"]["ratio"] == 2.0


def test_bench_specs_overall_tau_is_pooled_like_its_tok_s():
    """All tokens over all target forwards: an average of the categories' τ weighs a category that
    took 10 forwards like one that took 100."""
    from bench.spec import _summarise

    def cat(tokens, seconds, forwards):
        return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "tau": tokens / forwards}

    results = {"vanilla": {"a": cat(100, 10, 100), "b": cat(100, 10, 100)},
               "lookup": {"a": cat(100, 1, 10), "b": cat(100, 5, 100)}}
    overall = _summarise(results)["lookup"]["overall"]
    assert overall["tau"] == pytest.approx(200 / 110) and overall["speedup"] == pytest.approx(200 / 6 / 10)


def test_the_batch_sweeps_ratio_is_throughput_paired_by_round():
    """Batch 1's "batches" are single prompts of different lengths and speedups: the ratio is the
    summed time of a round over the summed time, not the median prompt's own speedup."""
    from bench.spec_batch import _summarise, round_ratios

    def passes(*secs_per_batch):      # per batch: the seconds of each round
        return [[{"seconds": s, "tokens": 10, "tau": 1.0, "nodes_per_seq_step": 0.0, "draft_share": 0.0,
                  "steps_by_source": {}} for s in rounds] for rounds in secs_per_batch]

    vanilla = passes([10, 10], [1, 1], [1, 1])         # one long prompt, two short ones, two rounds
    method = passes([5, 5], [0.25, 0.25], [0.25, 0.25])  # 2x on the long one, 4x on the short ones
    assert round_ratios(method, vanilla) == [12 / 5.5, 12 / 5.5]   # not the median prompt's 4x
    row = _summarise(1, {"vanilla": vanilla, "default": method})
    d = row["methods"]["default"]
    assert d["ratio"] == pytest.approx(12 / 5.5) and d["rounds"] == 2 and d["seconds"][0] == [5, 5]
    slow = passes([5, 50], [0.25, 0.25], [0.25, 0.25])   # one slow spell in round 2
    d = _summarise(1, {"vanilla": vanilla, "default": slow})["methods"]["default"]
    assert d["ratio_range"] == [pytest.approx(12 / 50.5), pytest.approx(12 / 5.5)]


def test_reports_record_the_command_commit_cpu_and_versions():
    import sys

    from bench.report_file import run_meta

    meta = run_meta()
    assert meta["command"] == sys.argv and meta["cpus"] and meta["cpu"]
    assert meta["versions"]["torch"] and meta["versions"]["ray"] and meta["versions"]["transformers"]
    assert meta["commit"] is None or len(meta["commit"]) == 40


@pytest.mark.slow  # the whole GPU check end to end on CPU: engines, a head training, decode benches
def test_cuda_check_dry_runs_on_cpu(tmp_path):
    """The prepared GPU check (`python -m bench.cuda_check`) runs end to end with --device cpu, so it
    works the day a GPU machine is lent; every check it reports holds."""
    import json

    from bench.cuda_check import main

    res = CliRunner().invoke(main, ["--out", str(tmp_path), "--device", "cpu", "--decode-tokens", "12"])
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "cuda_check.json").read_text())
    for family in ("llama", "qwen2", "gemma3"):
        assert set(report[f"engine_{family}"].values()) == {True}
    tp2 = report["tp2_spec"]                                 # TP 2 on gloo here, NCCL on 2 GPUs
    assert tp2.pop("backend") == "gloo" and len(tp2) == 6 and set(tp2.values()) == {True}
    assert report["train_head"]["trained_head_lossless"] and report["train_head"]["train_head_steps"] == 24
    assert [r["batch"] for r in report["decode_tok_s"]] == [1, 16, 64]


def test_cuda_check_spec_bench_calls_the_batch_bench_as_it_is(monkeypatch, tmp_path):
    """`--spec-bench` (GPU only, so never run end to end here) calls bench/spec_batch.run with
    arguments it takes, and reports its rows per batch size."""
    import inspect

    from bench import cuda_check, spec_batch

    calls = []

    def fake_run(*args, **kwargs):
        inspect.signature(spec_batch.run).bind(*args, **kwargs)      # raises on an argument it does not take
        calls.append(kwargs)
        return {"batches": [{"batch": b} for b in kwargs["batch_sizes"]]}

    monkeypatch.setattr(spec_batch, "run", fake_run)
    assert cuda_check.spec_bench_step("cuda", tmp_path) == [{"batch": 1}, {"batch": 8}, {"batch": 32}]
    assert calls[0]["device"] == "cuda" and "vanilla" in calls[0]["methods"] and "default" in calls[0]["methods"]


def test_comm_stats_count_each_collective_only_while_on(monkeypatch):
    """eagle_worker/parallel.py's counters: off, nothing is kept; on, calls and seconds per collective
    (the command broadcast included); reset starts over. dist is faked: no process group here."""
    import time

    from eagle_worker import parallel

    class FakeDist:
        def all_reduce(self, x):
            time.sleep(0.002)

        def all_gather(self, parts, x):
            for p in parts:
                p.copy_(x)

        def broadcast_object_list(self, box, src):
            assert src == 0

    monkeypatch.setattr(parallel, "dist", FakeDist())
    monkeypatch.setattr(parallel, "_TP_SIZE", 2)
    x = torch.ones(2, 3)
    parallel.all_reduce(x)
    assert parallel.comm_stats() == {}                          # off by default
    parallel.enable_comm_stats()
    try:
        for _ in range(3):
            parallel.all_reduce(x)
        assert parallel.all_gather_last_dim(x).shape == (2, 6)
        assert parallel.all_gather_rows(x).shape == (4, 3)
        assert parallel.broadcast_from_rank0(("forward", 1)) == ("forward", 1)
        stats = parallel.comm_stats(reset=True)
        assert {k: v["calls"] for k, v in stats.items()} == {"all_reduce": 3, "all_gather_last_dim": 1,
                                                             "all_gather_rows": 1, "broadcast_from_rank0": 1}
        assert stats["all_reduce"]["seconds"] >= 0.006
        assert parallel.comm_stats() == {}                      # reset
    finally:
        parallel.enable_comm_stats(False)
    parallel.all_reduce(x)
    assert parallel.comm_stats() == {}


def test_spec_tp_summary_table_and_output_check_from_fake_runs():
    from bench.spec_tp import OutputsDiffer, compare_outputs, summarise, table

    def r(secs, coll, bcast):
        return {"seconds": secs, "tokens": 20, "forwards": 10, "steps": 10,
                "comm": {"all_reduce": {"calls": 36, "seconds": coll}, "broadcast_from_rank0": {"calls": 10, "seconds": bcast}}}

    runs = {("vanilla-tp1", 1, 0): [{"seconds": 1.0, "tokens": 20, "forwards": 20, "steps": 20, "comm": {}}] * 3,
            ("head-tp2", 1, 0): [r(2.0, 0.5, 0.1), r(9.0, 0.5, 0.1), r(2.0, 0.5, 0.1)]}   # a slow round: median 2 s
    rows = summarise(runs, {"head-tp2": {"broadcast_from_rank0": {"calls": 30, "seconds": 0.4}}})
    assert [x["method"] for x in rows] == ["vanilla-tp1", "head-tp2"]
    head = rows[1]
    assert head["tok_s"] == 10.0 and head["tau"] == 2.0 and head["step_ms"] == 200.0
    assert head["collective_ms"] == 50.0 and abs(head["collective_calls"] - 3.6) < 1e-9 and head["broadcast_calls"] == 1
    assert abs(head["broadcast_ms"] - 10.0) < 1e-9 and abs(head["comm_share"] - 0.3) < 1e-9
    assert head["rank1_seconds_by_name"] == {"broadcast_from_rank0": 0.4}
    text = table(rows)
    assert "| 1 | head-tp2 | 2 x 1 | 10.0 | 2.00 | 200.0 | 50.00 (3.6) | 10.00 | 30% |" in text
    assert "| 1 | vanilla-tp1 | 1 x 1 | 20.0 | 1.00 | 50.0 | - | - | - |" in text
    same = {"vanilla-tp1@1": [[1, 2]], "head-tp2@1": [[1, 2]], "vanilla-tp1@8": [[1], [2]], "hybrid-tp2@8": [[1], [3]]}
    assert compare_outputs(same) == ["hybrid-tp2@8"]
    assert issubclass(OutputsDiffer, RuntimeError)


def test_bench_spec_tp_refuses_options_it_cannot_honour():
    for args, hint in ((["--threads", "2"], "--threads"), (["--batch-sizes", "1,x"], "--batch-sizes"),
                       (["--batch-sizes", "0"], "--batch-sizes")):
        res = CliRunner().invoke(bench_spec, ["--tp-size", "2", *args])
        assert res.exit_code == 2 and hint in res.output, res.output


def test_bench_spec_head_dtype_reaches_every_head_method_of_the_sweep(monkeypatch):
    """`--head-dtype` sets the head's dtype of the default, head and hybrid methods; where nothing
    would read it (batch 1 methods, the TP run) it is refused, not ignored."""
    import inspect

    from bench import spec_batch

    calls = []

    def fake_run(*args, **kwargs):
        inspect.signature(spec_batch.run).bind(*args, **kwargs)
        calls.append(kwargs)

    monkeypatch.setattr(spec_batch, "run", fake_run)
    res = CliRunner().invoke(bench_spec, ["--batch-sizes", "1,8", "--head-dtype", "float32"])
    assert res.exit_code == 0, res.output
    assert calls[0]["head_dtype"] == "float32"
    for method in ("default", "head", "hybrid"):
        assert spec_batch.spec_for(method, "gemma-3-270m", "default", "float32").head_dtype == "float32"
    assert spec_batch.spec_for("default", "gemma-3-270m", "none", "float32") is None     # --draft none: no speculation
    for args in ([], ["--tp-size", "2"]):
        res = CliRunner().invoke(bench_spec, [*args, "--head-dtype", "float32"])
        assert res.exit_code == 2 and "--head-dtype" in res.output, res.output


@pytest.mark.parametrize("value", ["5000", "-1", "inf", "nan", "lots"])
def test_bench_mixed_refuses_a_slowdown_the_serve_config_would_refuse(value):
    from eaglectl.bench import bench_mixed

    res = CliRunner().invoke(bench_mixed, ["--offline-slowdown", value])
    assert res.exit_code == 2 and "--offline-slowdown" in res.output and "0 to 1000" in res.output, res.output


# ---- every numeric option is checked by click, before any model loads ---------------------------------
def _no_benchmark(monkeypatch):
    """Every benchmark's entry point fails the test if reached: a refused option must stop before it."""
    import bench.decode
    import bench.job
    import bench.mixed
    import bench.prefix
    import bench.serve
    import bench.spec
    import bench.spec_batch
    import bench.spec_tp
    import bench.structured

    for module in (bench.decode, bench.job, bench.mixed, bench.prefix, bench.serve, bench.spec, bench.spec_batch,
                   bench.spec_tp, bench.structured):
        monkeypatch.setattr(module, "run", lambda *a, _m=module.__name__, **k: pytest.fail(f"{_m}.run was reached"))


@pytest.mark.parametrize("command,args,hint", [
    ("decode", ["--batch-sizes", "a"], "--batch-sizes"), ("decode", ["--batch-sizes", "0"], "--batch-sizes"),
    ("decode", ["--batch-sizes", "-3"], "--batch-sizes"), ("decode", ["--batch-sizes", "1,8,8"], "--batch-sizes"),
    ("decode", ["--batch-sizes", "100000"], "--batch-sizes"), ("decode", ["--dtypes", "foo"], "--dtypes"),
    ("decode", ["--dtypes", "float32,float32"], "--dtypes"), ("decode", ["--threads", "-2"], "--threads"),
    ("decode", ["--max-tokens", "0"], "--max-tokens"), ("decode", ["--rounds", "0"], "--rounds"),
    ("spec", ["--batch-sizes", "-1"], "--batch-sizes"), ("spec", ["--per-category", "0"], "--per-category"),
    ("spec", ["--max-tokens", "0"], "--max-tokens"), ("spec", ["--threads", "0"], "--threads"),
    ("spec", ["--temperature", "-1"], "--temperature"), ("spec", ["--temperature", "nan"], "--temperature"),
    ("spec", ["--temperature", "inf"], "--temperature"), ("spec", ["--depth", "0"], "--depth"),
    ("spec", ["--top-k", "-1"], "--top-k"), ("spec", ["--num-draft-tokens", "0"], "--num-draft-tokens"),
    ("spec", ["--batch-sizes", "1", "--draft", "random"], "--draft"),
    ("job", ["--rows", "-1"], "--rows"), ("job", ["--rows", "0"], "--rows"), ("job", ["--rows", "100000"], "--rows"),
    ("job", ["--max-tokens", "0"], "--max-tokens"), ("job", ["--replicas", "0"], "--replicas"),
    ("serve", ["--concurrencies", "a"], "--concurrencies"), ("serve", ["--concurrencies", "0,8"], "--concurrencies"),
    ("serve", ["--concurrencies", ","], "--concurrencies"), ("serve", ["--num-prompts", "0"], "--num-prompts"),
    ("serve", ["--max-tokens", "-5"], "--max-tokens"), ("serve", ["--threads", "0"], "--threads"),
    ("mixed", ["--rows", "0"], "--rows"), ("mixed", ["--rows", "100000"], "--rows"),
    ("mixed", ["--concurrency", "100000"], "--concurrency"), ("mixed", ["--max-num-seqs", "0"], "--max-num-seqs"),
    ("prefix", ["--rows", "0"], "--rows"), ("prefix", ["--system-tokens", "0"], "--system-tokens"),
])
def test_bench_refuses_meaningless_numbers_naming_the_option(command, args, hint, monkeypatch):
    """`decode --batch-sizes a` was a ValueError traceback, `0` an IndexError, `-3` a "batch -3" row,
    `--dtypes foo` an AttributeError, `--threads -2` torch's RuntimeError, `--max-tokens 0` a traceback
    after loading the model; `job --rows -1` wrote 479 rows. Now click refuses each: exit 2, naming it."""
    from eaglectl.bench import bench

    _no_benchmark(monkeypatch)
    res = CliRunner().invoke(bench, [command, *args])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert hint in res.output, res.output


def test_bench_lists_reach_the_benchmarks_parsed(monkeypatch):
    """One parser for batch sizes and concurrencies: what `bench spec` accepted before still arrives."""
    import bench.decode
    import bench.serve
    import bench.spec_tp
    from eaglectl.bench import bench as bench_group

    calls = {}
    for module, name in ((bench.decode, "decode"), (bench.serve, "serve"), (bench.spec_tp, "tp")):
        monkeypatch.setattr(module, "run", lambda _n=name, **k: calls.setdefault(_n, k))
    assert CliRunner().invoke(bench_group, ["decode", "--batch-sizes", " 1, 16 ", "--dtypes", "bfloat16"]).exit_code == 0
    assert calls["decode"]["batch_sizes"] == [1, 16] and calls["decode"]["dtypes"] == ["bfloat16"]
    assert CliRunner().invoke(bench_group, ["serve", "--concurrencies", "4"]).exit_code == 0
    assert calls["serve"]["concurrencies"] == (4,)
    assert CliRunner().invoke(bench_group, ["spec", "--tp-size", "2"]).exit_code == 0
    assert calls["tp"]["batch_sizes"] == (1, 8)


def test_bench_serve_on_an_unreachable_url_says_so(tmp_path):
    """Not requests' ConnectionError traceback: one line naming --url, before anything loads."""
    import socket

    with socket.socket() as s:                          # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from eaglectl.bench import bench_serve

    for url in (f"http://127.0.0.1:{port}", f"127.0.0.1:{port}"):
        res = CliRunner().invoke(bench_serve, ["--url", url, "--json", str(tmp_path / "serve.json")])
        assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
        assert "--url" in res.output and "no answer from" in res.output
    assert not (tmp_path / "serve.json").exists()


def test_bench_serve_on_a_url_that_is_not_an_openai_endpoint_says_so(monkeypatch):
    import bench.serve as bserve

    class NotOpenAI:
        def raise_for_status(self):
            pass

        def json(self):
            return {"hello": "world"}

    monkeypatch.setattr(bserve.requests, "get", lambda *a, **k: NotOpenAI())
    with pytest.raises(bserve.EndpointError, match="not an OpenAI-compatible endpoint"):
        bserve._served_model("http://somewhere")


def test_bench_job_input_writes_exactly_the_rows_asked(tmp_path):
    """`write_input(path, -1)` used to write all but one question (the slice mixed[:-1]), and more rows
    than questions quietly fewer."""
    from bench.job import available_rows, write_input

    assert len(write_input(tmp_path / "a.parquet", 3)) == 3
    ids = write_input(tmp_path / "b.parquet", available_rows())
    assert len(set(ids)) == available_rows()
    for rows in (-1, 0, available_rows() + 1):
        with pytest.raises(ValueError, match="rows must be from 1"):
            write_input(tmp_path / "c.parquet", rows)


def test_bench_job_checks_its_job_settings_before_anything_runs(monkeypatch, tmp_path):
    """A draft that is no head folder failed the first run's engine; a max_tokens the job config refuses
    was a pydantic traceback. Both now exit 2 before either run."""
    import bench.job
    from eaglectl.bench import bench_job

    monkeypatch.setattr(bench.job, "_variant", lambda *a, **k: pytest.fail("a job ran"))
    for args, said in ((["--draft", str(tmp_path / "no-head")], "no-head"), (["--max-tokens", str(2**40)], "max_tokens")):
        res = CliRunner().invoke(bench_job, [*args, "--json", str(tmp_path / "j.json")])
        assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
        assert said in res.output, res.output


def test_bench_job_rounds_take_turns_and_report_the_median_rounds_ratio(monkeypatch, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    import bench.job

    order, speeds = [], {"none": iter([100.0, 90.0, 110.0]), "default": iter([130.0, 180.0, 99.0])}

    def fake_variant(name, draft, inp, out, *rest):
        order.append(name)
        pq.write_table(pa.table({"id": ["a"], "text": ["same"]}), out)
        tok_s = next(speeds[name])
        return {"variant": name, "rows": 1, "output_tokens_per_s": tok_s, "rows_per_s": tok_s / 10, "tau": 1.0}

    monkeypatch.setattr(bench.job, "_variant", fake_variant)
    monkeypatch.setattr("bench.preflight.check_model", lambda model: None)
    monkeypatch.setattr("bench.preflight.check_draft", lambda draft, model: "head")
    rows = bench.job.run(rows=3, json_out=None, rounds=3)
    assert order == ["none", "default", "default", "none", "none", "default"]      # turns to go first
    none, default = rows
    assert default["speedup"] == pytest.approx(1.3) and default["speedup_range"] == [pytest.approx(0.9), 2.0]
    assert default["rounds_tok_s"] == [130.0, 180.0, 99.0] and default["output_tokens_per_s"] == 130.0
    assert none["speedup"] == 1.0 and default["same_text_as_baseline"] == 1.0


def test_bench_spec_refuses_unknown_methods_before_loading(monkeypatch):
    import bench.spec as bs

    monkeypatch.setattr(bs, "_runners", lambda *a, **k: pytest.fail("engines were loaded"))
    res = CliRunner().invoke(bench_spec, ["--methods", "vanilla,dinamic"])
    assert res.exit_code == 2 and "--methods" in res.output and "dinamic" in res.output, res.output


def test_bench_spec_random_head_fits_a_small_vocabulary(tiny_model_dir, tmp_path):
    """`--draft random` built an 8192-token draft vocabulary whatever the target's: an IndexError on a
    smaller vocabulary (the tiny model's 320). Now min(8192, the target's), and the head runs."""
    import json

    import bench.spec as bs

    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"category": "a", "turns": ["Count: 1 2 3 4"]}) + "\n")
    rep = bs.run(model=str(tiny_model_dir("llama")), prompts_file=q, per_category=1, max_tokens=4, dtype="float32",
                 draft="random", methods=("vanilla", "dynamic"), json_out=None, warmup=0)
    assert rep["summary"]["dynamic"]["a"]["tok_s"] > 0


# ---- `eaglectl job status|logs|cancel PATH`: what is wrong with the path, in one line --------------------
def test_job_status_of_a_manifest_that_is_no_object_names_the_file(tmp_path, monkeypatch):
    """A `_manifest.json` holding a JSON list was `AttributeError: 'list' object has no attribute 'get'`."""
    from eaglectl.jobs import job

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out = tmp_path / "run.out"
    out.mkdir()
    for text in ("[1, 2]", '"done"'):
        (out / "_manifest.json").write_text(text)
        res = CliRunner().invoke(job, ["status", str(out)])
        assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
        assert str(out / "_manifest.json") in res.output and "not a job manifest" in res.output


def test_job_commands_on_a_plain_file_say_it_is_no_output_folder(tmp_path, monkeypatch):
    """`job status FILE` said only "needs --address"; the path is a file, not a job's output folder."""
    from eaglectl.jobs import job

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    f = tmp_path / "rows.parquet"
    f.write_text("x")
    for command in ("status", "logs", "cancel"):
        res = CliRunner().invoke(job, [command, str(f)])
        assert res.exit_code == 2, res.output
        assert "is a file, not a job's output folder" in res.output, res.output


# ---- options a run would ignore are refused, not dropped -------------------------------------------------
@pytest.mark.parametrize("args,named", [
    (["--num-draft-tokens", "8"], "--num-draft-tokens"), (["--depth", "3"], "--depth"), (["--top-k", "4"], "--top-k"),
    (["--warmup", "0"], "--warmup"), (["--warmup", "4"], "--warmup"),          # given, even at its default
    (["--depth", "3", "--top-k", "4"], "--depth, --top-k"),
])
def test_bench_spec_batch_sizes_refuses_the_batch_1_options(monkeypatch, args, named):
    """bench/spec_batch.py runs each method's fixed tree and warms up on its own batch: the tree
    options and --warmup were silently ignored with --batch-sizes."""
    _no_benchmark(monkeypatch)
    res = CliRunner().invoke(bench_spec, ["--batch-sizes", "1,8", *args])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert named in res.output and "--batch-sizes" in res.output and "sweep" in res.output, res.output


def test_bench_spec_batch_sizes_without_them_reaches_the_sweep(monkeypatch):
    from bench import spec_batch

    calls = []
    monkeypatch.setattr(spec_batch, "run", lambda **k: calls.append(k))
    res = CliRunner().invoke(bench_spec, ["--batch-sizes", "1,8", "--rounds", "2"])
    assert res.exit_code == 0, res.output
    assert calls and calls[0]["batch_sizes"] == (1, 8)


@pytest.mark.parametrize("args,named", [
    (["--direct-ingress"], "--direct-ingress"), (["--stream-interval", "4"], "--stream-interval"),
    (["--separate-ingress"], "--separate-ingress"), (["--draft", "none"], "--draft"), (["--threads", "2"], "--threads"),
    (["--no-engine"], "--engine/--no-engine"), (["--engine"], "--engine/--no-engine"), (["--rounds", "3"], "--rounds"),
    (["--model", "other"], "--model"), (["--threads", "2", "--draft", "none"], "--draft, --threads"),
])
def test_bench_serve_url_refuses_the_options_of_the_app_it_does_not_start(monkeypatch, args, named):
    """With --url the endpoint is measured as it runs: no app is started here and no engine run compared."""
    from eaglectl.bench import bench_serve

    _no_benchmark(monkeypatch)
    res = CliRunner().invoke(bench_serve, ["--url", "http://127.0.0.1:9", *args])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert named in res.output and "--url" in res.output, res.output


def test_bench_serve_url_with_its_own_options_reaches_the_benchmark(monkeypatch, tmp_path):
    import bench.serve
    from eaglectl.bench import bench_serve

    calls = []
    monkeypatch.setattr(bench.serve, "run", lambda **k: calls.append(k))
    res = CliRunner().invoke(bench_serve, ["--url", "http://127.0.0.1:9", "--concurrencies", "2", "--num-prompts", "4",
                                           "--max-tokens", "8", "--json", str(tmp_path / "s.json")])
    assert res.exit_code == 0, res.output
    assert calls[0]["url"] == "http://127.0.0.1:9" and calls[0]["concurrencies"] == (2,)


# ---- `eaglectl --help` loads none of the heavy libraries -------------------------------------------------
HEAVY = ("torch", "ray", "pydantic", "pyarrow", "numpy", "transformers")


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["bench", "prefix", "--help"],
                                  ["deploy", "render", "--help"], ["submit-job", "--help"]])
def test_help_imports_no_heavy_library(argv):
    """eaglectl/README: `eaglectl --help` imports none of torch, Ray, pydantic or pyarrow (`bench prefix`'s
    scenarios pulled in bench.prefix, and with it pyarrow and numpy)."""
    import json
    import subprocess
    import sys

    code = ("import json, sys\nfrom eaglectl.main import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
            "print(json.dumps([m for m in %r if m in sys.modules]))" % (argv, HEAVY))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [], r.stdout[-500:]


def test_prefix_scenarios_are_the_benchmarks():
    from bench import prefix
    from bench.methods import PREFIX_SCENARIOS

    assert prefix.SCENARIOS == PREFIX_SCENARIOS == ("a", "b", "c")


# ---- the CLI's documented examples name files that exist -----------------------------------------------
def test_train_head_example_names_a_shipped_data_file():
    import re
    from pathlib import Path

    import eaglectl.train

    root = Path(__file__).resolve().parents[2]
    specs = re.findall(r"--data (\S+)", eaglectl.train.__doc__)
    assert specs
    for spec in specs:
        path = spec.rsplit(":", 1)[0] if re.search(r":\d+$", spec) else spec
        assert (root / path).exists(), f"eaglectl/train.py's example: {path} does not exist"
