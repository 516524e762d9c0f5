"""`eaglectl bench decode|spec|job|serve|mixed|prefix|structured`: the benchmarks in bench/, results as a table and JSON."""
from __future__ import annotations

import contextlib

import click

from bench.methods import BATCH_METHODS, HEAD_METHODS, PREFIX_SCENARIOS, SPEC_METHODS, check_methods  # light
from eagle_worker.speculative.config import HEAD_DTYPES, SpecConfig  # light: no torch
from eaglectl.common import POSITIVE, FiniteFloat, given_flags

DTYPES = ("float32", "bfloat16")
# Beyond this many sequences at once a batch size or concurrency is a typo, not a benchmark: it would
# build a prompt list, a KV cache and a thread pool that large before the first measurement.
MAX_BATCH = 4096


class CommaList(click.ParamType):
    """A comma-separated list of positive integers (up to MAX_BATCH), or of `choices`, each at most
    once: the one parser of every bench option that takes several values, so `0`, `-3`, `a`, `²`, `8,8`
    or `1,,8` are refused by click (exit 2, naming the option) before any model loads."""

    def __init__(self, choices: tuple[str, ...] | None = None):
        self.choices = choices
        self.name = "list" if choices is None else f"list of {','.join(choices)}"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):            # a default already converted
            return value
        items = [s.strip() for s in str(value).split(",")]
        if not any(items):
            self.fail(f"{value!r} is empty", param, ctx)
        if not all(items):
            self.fail(f"{value!r} has an empty item (two commas in a row, or one at an end)", param, ctx)
        if self.choices is None:
            # ASCII digits only: str.isdigit() is True for '²' and '٣' too, which int() refuses or reads as 3
            bad = [s for s in items if not (s.isascii() and s.isdigit() and len(s) < 20 and 1 <= int(s) <= MAX_BATCH)]
            if bad:
                self.fail(f"{bad[0]!r} is not an integer from 1 to {MAX_BATCH}", param, ctx)
            items = [int(s) for s in items]
        else:
            unknown = [s for s in items if s not in self.choices]
            if unknown:
                self.fail(f"{', '.join(map(repr, unknown))}: not among {', '.join(self.choices)}", param, ctx)
        repeated = sorted({str(x) for x in items if items.count(x) > 1})
        if repeated:
            self.fail(f"{', '.join(repeated)} given more than once", param, ctx)
        return tuple(items)


BATCH = click.IntRange(1, MAX_BATCH)


def _refuse(option: str, check, *args, **kwargs):
    """`check(*args)`, its ValueError a usage error naming `option` (exit 2): the one way a bench
    command turns a failed check into one line instead of a traceback."""
    try:
        return check(*args, **kwargs)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint=option) from None


def _preflight(json_out: str | None, model: str | None = None, draft: str | None = None) -> None:
    """What every bench command checks before anything loads (bench/preflight.py, bench/report_file.py):
    the model and draft the engine would load, and that the JSON report can be written, so a run of
    minutes is neither wasted on a typo nor lost at its end. None: not checked."""
    from bench.preflight import check_draft, check_model
    from bench.report_file import check_writable

    if model is not None:
        _refuse("--model", check_model, model)
    if draft is not None:
        _refuse("--draft", check_draft, draft, model)
    if json_out:
        _refuse("--json", check_writable, json_out)


def _job_rows(ctx, param, rows: int) -> int:
    """`--rows` of the Spec-Bench job input: at most one row a question (bench/job.py write_input)."""
    from bench.job import available_rows

    if rows > available_rows():
        raise click.BadParameter(f"{rows} is more than the {available_rows()} Spec-Bench questions", ctx, param)
    return rows


@click.group("bench")
def bench() -> None:
    """Benchmarks (results printed as a table and written as JSON)."""


@bench.command("decode")
@click.option("--model", default="gemma-3-270m", show_default=True)
@click.option("--dtypes", default="float32,bfloat16", show_default=True, type=CommaList(DTYPES))
@click.option("--batch-sizes", default="1,8", show_default=True, type=CommaList())
@click.option("--max-tokens", default=64, show_default=True, type=POSITIVE)
@click.option("--json", "json_out", default="bench/results/decode.json", show_default=True)
@click.option("--threads", default=None, type=POSITIVE, help="torch intra-op threads for both engines [default: torch's].")
@click.option("--rounds", default=3, show_default=True, type=POSITIVE,
              help="Runs per measurement, the engines taking turns; the median counts.")
def bench_decode(model, dtypes, batch_sizes, max_tokens, json_out, threads, rounds):
    """Tokens/s of this engine vs transformers generate, same model and dtype."""
    _preflight(json_out, model=model)
    from bench.decode import run

    run(model=model, dtypes=list(dtypes), batch_sizes=list(batch_sizes), max_tokens=max_tokens, json_out=json_out,
        threads=threads, rounds=rounds)


@bench.command("spec")
@click.option("--model", default="gemma-3-270m", show_default=True)
@click.option("--prompts", "prompts_file", default=None, help="Spec-Bench-format JSONL [default: the bundled Spec-Bench].")
@click.option("--per-category", default=2, show_default=True, type=POSITIVE)
@click.option("--max-tokens", default=128, show_default=True, type=POSITIVE)
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(DTYPES))
@click.option("--draft", default="default", show_default=True, help="Head folder, 'default', or 'random' (cost only).")
@click.option("--methods", default=None, type=CommaList(tuple(dict.fromkeys(SPEC_METHODS + BATCH_METHODS))),
              help="[default: vanilla,hf,hf_lookup,lookup,chain,static,dynamic,hybrid; with --batch-sizes "
                   "vanilla,default,head,lookup,hybrid]")
@click.option("--json", "json_out", default=None,
              help="[default: bench/results/spec.json; with --batch-sizes bench/results/spec_batch_DTYPE.json; "
                   "with --tp-size 2 bench/results/spec_tp.json]")
@click.option("--threads", default=None, type=POSITIVE,
              help="torch intra-op threads [default: torch's; with --tp-size 2 always 1 per rank].")
@click.option("--temperature", default=0.0, show_default=True, type=FiniteFloat(min=0),
              help="0 = greedy; > 0 samples.")
@click.option("--num-draft-tokens", default=None, type=POSITIVE,
              help="Node budget of the dynamic tree, the hybrid and lookup [default: SpecConfig's].")
@click.option("--depth", default=None, type=POSITIVE, help="Dynamic tree / hybrid draft levels [default: SpecConfig's].")
@click.option("--top-k", default=None, type=POSITIVE, help="Dynamic tree / hybrid expansion width [default: SpecConfig's].")
@click.option("--rounds", default=1, show_default=True, type=POSITIVE,
              help="Passes over the prompts; each prompt's (with --batch-sizes each batch's) median time counts.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N (every method runs there).")
@click.option("--warmup", default=4, show_default=True, type=click.IntRange(min=0),
              help="Prompts each engine serves first, from outside the measured set (adaptive state settles).")
@click.option("--tp-size", default=1, show_default=True, type=click.Choice(["1", "2"]),
              help="2: vanilla TP 1 (1 and 2 threads), vanilla/head/hybrid TP 2 on CPU (gloo), greedy, with the "
                   "collectives' share of a step (bench/spec_tp.py; --methods, --draft, --temperature, the "
                   "tree options (--num-draft-tokens, --depth, --top-k) and --warmup do not apply).")
@click.option("--head-dtype", default="target", show_default=True,
              type=click.Choice(HEAD_DTYPES),
              help="With --batch-sizes: the dtype the head runs in (SpecConfig.head_dtype).")
@click.option("--batch-sizes", default=None, type=CommaList(),
              help="Batch sizes: every method at each (bench/spec_batch.py: vanilla, the default, the fixed head, "
                   "lookup and hybrid trees); with --tp-size 2 [default 1,8] the sizes the TP run measures.")
def bench_spec(model, prompts_file, per_category, max_tokens, dtype, draft, methods, json_out, threads,
               temperature, num_draft_tokens, depth, top_k, rounds, device, warmup, tp_size, head_dtype, batch_sizes):
    """Vanilla, transformers (plain, prompt lookup), our lookup, EAGLE chain/static/dynamic, hybrid at
    batch 1; or, with --batch-sizes, the default against the fixed methods at every batch size."""
    from bench.prompts import SPEC_BENCH, load_questions

    sizes = batch_sizes or ((1, 8) if tp_size == "2" else None)
    tree = {k: v for k, v in (("num_draft_tokens", num_draft_tokens), ("depth", depth), ("top_k", top_k)) if v is not None}
    for key, value in tree.items():            # SpecConfig's own limits, before any model loads
        _refuse("--" + key.replace("_", "-"), SpecConfig, lookup=True, **{key: value})
    if head_dtype != "target" and (batch_sizes is None or tp_size == "2"):
        raise click.BadParameter("applies to the batch-size sweep only (--batch-sizes without --tp-size 2)",
                                 param_hint="--head-dtype")
    prompts_file = prompts_file or SPEC_BENCH
    if batch_sizes is not None and tp_size != "2":
        unused = given_flags(click.get_current_context(), "num_draft_tokens", "depth", "top_k", "warmup")
        if unused:                   # the sweep's methods draft their full trees and warm up on 8 prompts of their own
            raise click.BadParameter(f"{', '.join(unused)} do{'es' if len(unused) == 1 else ''} not apply to the "
                                     "batch-size sweep (bench/spec_batch.py: each method's fixed tree, its own "
                                     "warm-up batch)", param_hint="--batch-sizes")
    if tp_size == "2":
        unused = given_flags(click.get_current_context(), "methods", "draft", "temperature", "num_draft_tokens",
                             "depth", "top_k", "warmup")
        if unused:                   # not silently ignored
            raise click.BadParameter(f"{', '.join(unused)} do{'es' if len(unused) == 1 else ''} not apply to the TP "
                                     "run (vanilla, head and hybrid, greedy, the built-in head)", param_hint="--tp-size")
        if threads not in (None, 1):
            raise click.BadParameter("TP 2 runs 1 torch thread per rank (and TP 1 at 1 and 2 threads)",
                                     param_hint="--threads")
        if device != "cpu":
            raise click.BadParameter("the TP benchmark runs on CPU (gloo); bench/cuda_check.py checks TP 2 on GPUs",
                                     param_hint="--device")
        json_out = json_out or "bench/results/spec_tp.json"
        _preflight(json_out, model=model)
        _refuse("--prompts", load_questions, prompts_file)
        from bench.spec_tp import run as run_tp

        run_tp(model=model, prompts_file=prompts_file, per_category=per_category, max_tokens=max_tokens,
               dtype=dtype, batch_sizes=sizes, json_out=json_out, rounds=rounds)
        return
    allowed = SPEC_METHODS if sizes is None else BATCH_METHODS
    chosen = methods or allowed
    try:
        check_methods(chosen, allowed)
    except ValueError as e:
        raise click.BadParameter(f"{e} ({'without' if sizes is None else 'with'} --batch-sizes)",
                                 param_hint="--methods") from None
    if sizes is not None and draft == "random":
        raise click.BadParameter("'random' is for the batch-1 methods (without --batch-sizes)", param_hint="--draft")
    # 'random' is built from the target; 'default' matters only where a method drafts with the head
    check_head = draft != "random" and (draft != "default" or any(m in HEAD_METHODS for m in chosen))
    json_out = json_out or ("bench/results/spec.json" if sizes is None else f"bench/results/spec_batch_{dtype}.json")
    _preflight(json_out, model=model, draft=draft if check_head else None)
    _refuse("--prompts", load_questions, prompts_file)
    from eagle_worker.config import check_device  # imports torch

    _refuse("--device", check_device, device)
    if sizes is not None:
        from bench.spec_batch import run as run_batch

        run_batch(model=model, prompts_file=prompts_file, per_category=per_category,
                  max_tokens=max_tokens, dtype=dtype, draft=draft, methods=chosen, batch_sizes=sizes,
                  rounds=rounds, temperature=temperature, device=device, threads=threads,
                  json_out=json_out, head_dtype=head_dtype)
        return
    from bench.spec import run

    run(model=model, prompts_file=prompts_file, per_category=per_category, max_tokens=max_tokens, dtype=dtype,
        draft=draft, methods=chosen, json_out=json_out, threads=threads, temperature=temperature, tree=tree,
        rounds=rounds, device=device, warmup=warmup)


@bench.command("job")
@click.option("--model", default="gemma-3-270m", show_default=True)
@click.option("--rows", default=200, show_default=True, type=POSITIVE, callback=_job_rows)
@click.option("--max-tokens", default=64, show_default=True, type=POSITIVE)
@click.option("--draft", default="auto", show_default=True,
              help="The speculative run's draft: auto (the default speculation), default, a head folder, or none.")
@click.option("--replicas", default=1, show_default=True, type=POSITIVE)
@click.option("--rounds", default=1, show_default=True, type=POSITIVE,
              help="Both jobs this many times, taking turns to go first; the speedup is the median round's.")
@click.option("--json", "json_out", default="bench/results/job.json", show_default=True)
def bench_job(model, rows, max_tokens, draft, replicas, rounds, json_out):
    """An offline job over Spec-Bench prompts, with and without speculation."""
    _preflight(json_out, model=model, draft=draft)
    from bench.job import run
    from jobs.job_config import JobConfigError

    try:
        with _job_failures():
            run(model=model, rows=rows, max_tokens=max_tokens, json_out=json_out, draft=draft, replicas=replicas,
                rounds=rounds)
    except JobConfigError as e:
        raise click.UsageError(str(e)) from None


@contextlib.contextmanager
def _job_failures():
    """A benchmark's job that fails (a replica that cannot start, ...) is its one-line reason, exit 1;
    one a signal stopped ends the benchmark there, exit 128 + the signal's number (130 for Ctrl-C)."""
    import signal

    from bench.job import BenchStopped
    from jobs.replica_pool import JobFailed

    try:
        yield
    except JobFailed as e:
        raise click.ClickException(f"the benchmark job failed: {e}") from None
    except BenchStopped as e:
        err = click.ClickException(str(e))
        err.exit_code = 128 + getattr(signal, e.signal or "", signal.SIGINT)
        raise err from None


@bench.command("serve")
@click.option("--url", default=None, help="An already running endpoint [default: start one on this machine].")
@click.option("--model", default="gemma-3-270m", show_default=True)
@click.option("--concurrencies", default="1,8", show_default=True, type=CommaList())
@click.option("--num-prompts", default=8, show_default=True, type=POSITIVE)
@click.option("--max-tokens", default=48, show_default=True, type=POSITIVE)
@click.option("--draft", default="default", show_default=True,
              help="Head for the with-head run: folder, 'default', or 'none' (no head: plain only).")
@click.option("--threads", default=None, type=POSITIVE,
              help="torch threads of the replica and of the LLM.generate baseline [default: every core].")
@click.option("--engine/--no-engine", "engine_baseline", default=True, show_default=True,
              help="Also run the same prompts through LLM.generate here (same threads, no head) and report HTTP/engine.")
@click.option("--stream-interval", default=1, show_default=True, type=POSITIVE,
              help="The started app's ingress.stream_interval: streamed chunks carry up to this many tokens.")
@click.option("--direct-ingress", is_flag=True,
              help="The started app's ingress.direct: the ingress replica serves HTTP, no Serve proxy (experimental).")
@click.option("--rounds", default=1, show_default=True, type=POSITIVE,
              help="Engine and HTTP levels taking turns this many times; HTTP/engine is the median of the rounds' ratios.")
@click.option("--separate-ingress", is_flag=True,
              help="The started app's ingress.colocate: false: the ingress in its own process, not the engine's.")
@click.option("--json", "json_out", default="bench/results/serve.json", show_default=True)
def bench_serve(url, model, concurrencies, num_prompts, max_tokens, draft, threads, engine_baseline, stream_interval,
                direct_ingress, rounds, separate_ingress, json_out):
    """HTTP load vs the engine itself: request throughput, output tok/s, TTFT, TPOT, ITL per concurrency."""
    if url is None:     # an endpoint is measured as it is: --model and --draft are for the app started here
        # 'default' for a model that ships no head is no error here: the plain setup runs alone, with a note
        _preflight(json_out, model=model, draft=None if draft == "default" else draft)
    else:
        unused = given_flags(click.get_current_context(), "model", "draft", "threads", "engine_baseline",
                             "stream_interval", "direct_ingress", "rounds", "separate_ingress")
        if unused:                   # not silently ignored: they set up the app (and the engine run) started here
            unused = ["--engine/--no-engine" if u == "--engine-baseline" else u for u in unused]
            raise click.BadParameter(f"{', '.join(unused)} appl{'ies' if len(unused) == 1 else 'y'} to the app this "
                                     "command starts and the engine it compares with; an endpoint given by --url is "
                                     "measured as it runs (HTTP levels only, one round)", param_hint="--url")
        _preflight(json_out)
    from bench.serve import EndpointError, run

    try:
        run(url=url, model=model, concurrencies=concurrencies, num_prompts=num_prompts, max_tokens=max_tokens,
            draft=draft, json_out=json_out, threads=threads, engine_baseline=engine_baseline,
            stream_interval=stream_interval, direct_ingress=direct_ingress,
            colocate=False if separate_ingress else None, rounds=rounds)
    except EndpointError as e:
        if url is None:              # the app this run started: not the user's input
            raise click.ClickException(str(e)) from None
        raise click.BadParameter(str(e), param_hint="--url") from None


@bench.command("mixed")
@click.option("--model", default="gemma-3-270m", show_default=True)
@click.option("--rows", default=200, show_default=True, type=POSITIVE, callback=_job_rows, help="The job's rows.")
@click.option("--online-requests", default=16, show_default=True, type=POSITIVE)
@click.option("--concurrency", default=4, show_default=True, type=BATCH, help="Online requests in flight.")
@click.option("--max-tokens", default=32, show_default=True, type=POSITIVE)
@click.option("--draft", default="none", show_default=True, help="none, auto, default or a head folder.")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(DTYPES))
@click.option("--max-num-seqs", default=16, show_default=True, type=BATCH)
@click.option("--threads", default=None, type=POSITIVE, help="The replica's torch threads [default: every core].")
@click.option("--separate-ingress", is_flag=True,
              help="The app's ingress.colocate: false: the ingress in its own process, not the engine's.")
@click.option("--offline-slowdown", default="0.25", show_default=True,
              help="The app's offline_slowdown (how much a job's rows may slow online steps), or none: no cap.")
@click.option("--json", "json_out", default="bench/results/mixed.json", show_default=True)
def bench_mixed(model, rows, online_requests, concurrency, max_tokens, draft, dtype, max_num_seqs, threads,
                separate_ingress, offline_slowdown, json_out):
    """Online load alone, a job alone, and both on one app: online TTFT/TPOT with the job, job rows/s."""
    slowdown = None if offline_slowdown == "none" else _slowdown(offline_slowdown, "--offline-slowdown")
    _preflight(json_out, model=model, draft=draft)
    from bench.mixed import run

    with _job_failures():
        run(model=model, rows=rows, online_requests=online_requests, concurrency=concurrency, max_tokens=max_tokens,
            draft=None if draft == "none" else draft, dtype=dtype, max_num_seqs=max_num_seqs, threads=threads,
            json_out=json_out, colocate=False if separate_ingress else None, offline_slowdown=slowdown)


def _slowdown(text: str, option: str) -> float:
    """A number the serve config's `offline_slowdown` accepts (0 to 1000), checked before anything starts."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= 1000:
        raise click.BadParameter(f"{text!r} is not a number from 0 to 1000 or 'none'", param_hint=option)
    return value


@bench.command("prefix")
@click.option("--model", default="gemma-3-270m", show_default=True)
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(DTYPES))
@click.option("--draft", default="auto", show_default=True,
              help="Head for the with-head runs: auto (the model's built-in head), default, a folder, or none.")
@click.option("--scenarios", default="a,b,c", show_default=True, type=CommaList(PREFIX_SCENARIOS),
              help="a: shared system prompt; b: multi-turn conversations; c: an offline job with a shared preamble.")
@click.option("--rounds", default=3, show_default=True, type=POSITIVE,
              help="Runs of each measurement, caching off and on taking turns; the median counts.")
@click.option("--requests", default=32, show_default=True, type=POSITIVE, help="a: requests.")
@click.option("--system-tokens", default=512, show_default=True, type=POSITIVE, help="a: system prompt length.")
@click.option("--question-tokens", default=20, show_default=True, type=POSITIVE,
              help="a, b: each question's length.")
@click.option("--conversations", default=8, show_default=True, type=POSITIVE, help="b: conversations.")
@click.option("--turns", default=4, show_default=True, type=POSITIVE, help="b: turns per conversation.")
@click.option("--history-tokens", default=256, show_default=True, type=POSITIVE,
              help="b: the first turn's document length.")
@click.option("--rows", default=200, show_default=True, type=POSITIVE, help="c: job rows.")
@click.option("--preamble-tokens", default=400, show_default=True, type=POSITIVE,
              help="c: the shared few-shot preamble's length.")
@click.option("--max-tokens", default=64, show_default=True, type=POSITIVE)
@click.option("--c-runner", default="job", show_default=True, type=click.Choice(["job", "engine"]),
              help="c through the jobs runner (Ray replicas, Parquet) or one LLM.generate burst.")
@click.option("--json", "json_out", default=None,
              help="[default: bench/results/prefix.json; bfloat16: bench/results/prefix_bf16.json]")
def bench_prefix(model, dtype, draft, scenarios, rounds, requests, system_tokens, question_tokens, conversations,
                 turns, history_tokens, rows, preamble_tokens, max_tokens, c_runner, json_out):
    """Automatic prefix caching: caching off vs on, without and with the head (TTFT, tok/s, hit rate, tau)."""
    json_out = json_out or ("bench/results/prefix_bf16.json" if dtype == "bfloat16" else "bench/results/prefix.json")
    _preflight(json_out, model=model, draft=draft)
    from bench.prefix import Sizes, run

    sizes = Sizes(requests=requests, system_tokens=system_tokens, question_tokens=question_tokens,
                  conversations=conversations, turns=turns, history_tokens=history_tokens, rows=rows,
                  preamble_tokens=preamble_tokens, max_tokens=max_tokens)
    with _job_failures():
        run(model=model, dtype=dtype, draft=draft, scenarios=scenarios, rounds=rounds, sizes=sizes, json_out=json_out,
            c_runner=c_runner)


@bench.command("structured")
@click.option("--model", default="gemma-3-270m", show_default=True)
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(DTYPES))
@click.option("--draft", default="default", show_default=True,
              help="The speculation measured against plain decoding: default, auto, a head folder.")
@click.option("--formats", default="free,json_object,json_schema", show_default=True,
              type=CommaList(("free", "json_object", "json_schema")))
@click.option("--batch-sizes", default="1,4", show_default=True, type=CommaList())
@click.option("--prompts", "num_prompts", default=8, show_default=True, type=POSITIVE, help="Spec-Bench prompts.")
@click.option("--max-tokens", default=64, show_default=True, type=POSITIVE)
@click.option("--rounds", default=2, show_default=True, type=POSITIVE,
              help="Runs of each measurement, the methods taking turns; the median counts.")
@click.option("--json", "json_out", default="bench/results/structured.json", show_default=True)
def bench_structured(model, dtype, draft, formats, batch_sizes, num_prompts, max_tokens, rounds, json_out):
    """Structured outputs (free text, json_object, a JSON schema): plain decoding vs speculation, tok/s and tau."""
    if draft in ("none", "None"):
        raise click.BadParameter("the benchmark compares a speculation with none; name one", param_hint="--draft")
    _preflight(json_out, model=model, draft=draft)
    from bench.structured import run

    run(model=model, dtype=dtype, draft=draft, formats=list(formats), batch_sizes=list(batch_sizes),
        num_prompts=num_prompts, max_tokens=max_tokens, rounds=rounds, json_out=json_out)
