"""`eaglectl submit-job` and `eaglectl job status|list|logs|cancel` (registered in eaglectl/main.py).

Without `--address` and `RAY_ADDRESS` a job runs right here on an embedded Ray (jobs/driver.py);
with one, it is submitted to that cluster through the Ray Jobs API (jobs/ray_jobs.py, whose driver
entrypoint is `python -m jobs.driver`) and `job ...` follows it. Exit codes: 0 the job completed,
1 it failed, 2 bad input or settings (nothing generated), 3 completed with error rows, 130 cancelled.
Failing to reach the cluster (jobs.ray_jobs raises ConnectionError) is one line, never a traceback.
With `--serve-app NAME` the rows go to that running Serve application (jobs/app_pool.py) instead of
the job's own replicas; without `--address` the driver joins the Ray cluster running here.
"""
from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import click
from click.core import ParameterSource

from eaglectl.common import fail
from jobs.driver import EXIT_CANCELLED, EXIT_FAILED, EXIT_WITH_ERRORS, RESULT_MARKER  # light imports

DEFAULT_APP = "eagle"   # cluster.config.ServeConfig.app_name's default (tests/jobs/test_job_serve_app.py checks)


def _address(address: str | None) -> str | None:
    address = address or os.environ.get("RAY_ADDRESS") or None
    return None if address in (None, "local") else address


def _run_local(cfg, ray_address: str) -> None:
    """Run the driver in this process; exits with the job's code."""
    from jobs.driver import drive

    sys.exit(drive(cfg, ray_address))


@click.command("submit-job")
@click.argument("input", metavar="INPUT")
@click.option("--output", "-o", help="Output folder or s3://, gs:// prefix [default: beside the input: <input name>.out; "
              "a glob: <its folder>.glob-<hash>.out].")
@click.option("--format", "fmt", type=click.Choice(["auto", "parquet", "openai-batch"]), default="auto",
              show_default=True,
              help="Output format; auto = openai-batch for JSONL input (a .jsonl file, or a folder or glob of them), "
                   "else parquet.")
@click.option("--model", help="Built-in name, local folder or hub id [default: gemma-3-270m].")
@click.option("--draft", help="Speculation: auto (the hybrid with the model's built-in head, or prompt lookup "
              "where it has none), default (that head, required), none (off), or a head folder [default: auto].")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]))
@click.option("--device", type=click.Choice(["cpu", "cuda"]))
@click.option("--max-tokens", type=int, help="Per-row default, overridden by a max_tokens column [default: 256].")
@click.option("--temperature", type=float, help="[default: 0.0]")
@click.option("--top-p", type=float, help="[default: 1.0]")
@click.option("--top-k", type=int, help="[default: -1, off]")
@click.option("--seed", type=int, help="Seed for every row [default: one derived from each row's id].")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--truncate-prompt-tokens", type=int, help="Keep each prompt's last N tokens; -1: as many as leave "
              "room for max_tokens [default: none; a prompt beyond the context is an error row].")
@click.option("--max-model-len", type=int)
@click.option("--replicas", type=int, help="Engine replicas [default: 1].")
@click.option("--tp-size", type=int, help="Tensor-parallel ranks per replica [default: 1].")
@click.option("--cpus-per-replica", type=float, help="[default: the cluster's CPUs split over the replicas]")
@click.option("--max-num-seqs", type=int, help="Batch size of each engine [default: 64].")
@click.option("--max-in-flight", type=int, help="Rows sent to one replica at once [default: max-num-seqs plus a quarter].")
@click.option("--min-ready-replicas", type=int, help="Replicas loaded before rows are sent [default: 1].")
@click.option("--keep-columns", is_flag=True, help="Carry the input's other columns into the output.")
@click.option("--overwrite", is_flag=True, help="Delete existing output instead of resuming it.")
@click.option("--retry-errors", is_flag=True, help="Run the error rows already in the output again (same ids; "
              "fix their input first), replacing them.")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=None,
              help="Reuse the KV cache of shared prompt prefixes (outputs are the same either way) [default: on].")
@click.option("--speculation", help='EAGLE settings as JSON, the serve config\'s `speculation:` keys, e.g. '
              '\'{"adaptive": false, "num_draft_tokens": 8}\' (a fixed tree every step) [default: the hybrid, '
              'sized per step].')
@click.option("--rows-per-file", type=int, help="Rows per committed output file [default: 10000].")
@click.option("--commit-interval", "commit_interval_s", type=float, help="Commit at least every N seconds [default: 30].")
@click.option("--engine", hidden=True)
@click.option("--serve-app", is_flag=False, flag_value=DEFAULT_APP, default=None,
              help=f"Send the rows to this running Serve application at offline priority instead of starting "
              f"replicas; the app's model, dtype and draft are used. Alone (after INPUT): {DEFAULT_APP}, the app "
              "`eaglectl serve` deploys by default. Without --address: the Ray cluster running here.")
@click.option("--address", help="Ray cluster: host:GCS-port (head:6379), dashboard http://head:8265, "
              "ray://head:10001 or auto [default: RAY_ADDRESS; none = run here].")
@click.option("--job-id", help="Submission id on the cluster [default: generated].")
@click.option("--wait/--no-wait", default=True, show_default=True, help="On a cluster: follow the job until it ends.")
def submit_job(input, fmt, stop, address, job_id, wait, **opts):
    """Generate completions for every row of INPUT (Parquet file, folder or glob; or OpenAI Batch JSONL;
    local, s3:// or gs://).

    \b
    Exit codes: 0 completed, 1 failed, 2 bad input or settings (nothing generated),
    3 completed with error rows (rerun with --retry-errors after fixing them) or with rows skipped
    for a duplicate id, 130 cancelled.
    """
    from jobs.job_config import JobConfigError

    try:
        cfg = _job_config(click.get_current_context(), input, fmt, stop, opts).absolute()
    except JobConfigError as e:
        fail(str(e))
    address = _address(address)
    if address is None and job_id is not None:      # not silently ignored
        fail("--job-id names a job submitted to a cluster (--address or RAY_ADDRESS); a job run here is "
             "known by its output folder")
    if address is None:
        _run_local(cfg, "local")
        return
    _submit_remote(cfg, address, job_id, wait)


def _job_config(ctx: click.Context, input: str, fmt: str, stop: tuple[str, ...], opts: dict):
    """The JobConfig of a parsed `submit-job` command line (JobConfigError naming what is wrong), before
    its paths are made absolute: what `submit-job` checks before it runs or submits anything."""
    from jobs.job_config import JobConfig, JobConfigError

    # only the options given: `--serve-app` refuses an own-replica flag given even at its default value
    opts = {k: v for k, v in opts.items() if ctx.get_parameter_source(k) is not ParameterSource.DEFAULT}
    if opts.get("speculation") is not None:
        try:
            opts["speculation"] = json.loads(opts["speculation"])
        except json.JSONDecodeError as e:
            raise JobConfigError(f"--speculation: not JSON ({e.msg} at character {e.pos}): {opts['speculation']}") from None
    return JobConfig.from_options(input=input, format=fmt, stop=list(stop) or None, **opts)


def submit_job_refusal(args: list[str]) -> str | None:
    """None when `eaglectl submit-job ARGS` would start: parsed by this very command (click's types and
    choices) and its job settings validated as the command validates them, nothing run or submitted;
    else why not, in the command's words. The KubeRay renderer checks RayJob entrypoints with it
    (`eaglectl deploy render`)."""
    from jobs.job_config import JobConfigError

    try:
        ctx = submit_job.make_context("submit-job", list(args))
    except click.exceptions.Exit:             # --help: prints and stops, runs nothing
        return "it would only print its help"
    except click.ClickException as e:
        return e.format_message()
    with ctx:
        params = dict(ctx.params)
        input, fmt, stop = params.pop("input"), params.pop("fmt"), params.pop("stop")
        for key in ("address", "job_id", "wait"):
            params.pop(key)
        try:
            _job_config(ctx, input, fmt, stop, params)
        except JobConfigError as e:
            return str(e)
    return None


def _submit_remote(cfg, address: str, job_id: str | None, wait: bool) -> None:
    from jobs import ray_jobs
    from jobs.input_reader import InputError, open_input

    if "://" not in cfg.input and Path(cfg.input).exists():   # a path we can see: check it now, not on the cluster
        try:
            open_input(cfg.input, cfg.keep_columns, exclude=cfg.output)
        except InputError as e:
            fail(str(e))
    try:
        jid = ray_jobs.submit(address, cfg, job_id)
    except ValueError as e:       # a malformed or taken --job-id
        fail(str(e))
    except ConnectionError as e:
        fail(str(e), EXIT_FAILED)
    click.echo(f"submitted job {jid} to {ray_jobs.jobs_address(address)}; output: {cfg.output}")
    click.echo(f"follow it with: eaglectl job status {jid} --address {shlex.quote(address)} --follow")
    if not wait:
        return
    try:
        ray_jobs.tail_logs(address, jid, lambda s: click.echo(s, nl=False))
        st = ray_jobs.wait(address, jid, poll_s=1.0)
    except KeyboardInterrupt:
        _stopped_following(jid, address)
    except ConnectionError as e:
        fail(str(e), EXIT_FAILED)
    click.echo(f"job {jid}: {st['status']}" + (f" ({st['message']})" if st.get("message") else ""))
    code = ray_jobs.exit_code(st)       # the driver's own: 2 bad input or settings, 130 cancelled, ...
    if code:
        sys.exit(code)
    try:
        with_errors = RESULT_MARKER in ray_jobs.logs(address, jid)
    except (ConnectionError, RuntimeError):
        with_errors = False
    sys.exit(EXIT_WITH_ERRORS if with_errors else 0)


# ---- following jobs -----------------------------------------------------------------------------
def _stopped_following(job_id: str, address: str) -> None:
    """Ctrl-C while following: the job goes on; 130 (not 1, which says the job failed)."""
    click.echo(f"\nstopped following; job {job_id} keeps running (eaglectl job cancel {job_id} "
               f"--address {shlex.quote(address)} to stop it)", err=True)
    sys.exit(EXIT_CANCELLED)


def _is(path: str, kind: str) -> bool:
    """Path(path).is_dir() / is_file(), False for a name no filesystem takes (too long, ...)."""
    try:
        return getattr(Path(path), kind)()
    except (OSError, ValueError):
        return False


def _need_address(address: str | None, job_id: str | None = None) -> str:
    from jobs.ray_jobs import check_job_id

    a = _address(address)
    if a is None:
        if job_id is not None and _is(job_id, "is_file"):    # neither a submission id nor an output folder
            fail(f"{job_id} is a file, not a job's output folder (JOB is that folder, or a submission id "
                 "with --address or RAY_ADDRESS)")
        fail("needs --address or RAY_ADDRESS (the cluster: head:6379, http://head:8265, ray://head:10001 or auto); "
              "jobs without one run in the foreground and their status is in <output>/_manifest.json")
    if job_id is not None:
        try:
            check_job_id(job_id)
        except ValueError as e:
            fail(str(e))
    return a


def _manifest_line(output: str | None) -> str | None:
    from jobs.output_writer import read_manifest
    from jobs.progress import summary

    if output and ("://" in output or Path(output).is_dir()):
        try:
            m = read_manifest(output)
        except (OSError, RuntimeError, ValueError):   # e.g. no credentials for the bucket here
            return None
        if m:
            return summary(m)
    return None


def _local_status(output: str, as_json: bool) -> None:
    """Status of a job from its output folder (local path or bucket URI): the manifest."""
    from jobs.output_writer import MANIFEST, is_locked, read_manifest
    from jobs.progress import summary

    path = f"{output.rstrip('/')}/{MANIFEST}"
    try:
        m = read_manifest(output)
    except (OSError, RuntimeError, ValueError) as e:
        fail(f"{path}: cannot read the job manifest ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
    if not m:
        fail(f"{output}: no job manifest there")
    if m.get("status") == "running" and not is_locked(output):   # flock: only trusted on this machine
        m["status"] = "interrupted (no driver is running; run the same command again to resume)"
    click.echo(json.dumps(m, default=str) if as_json else summary(m))


@click.group("job")
def job():
    """Follow jobs submitted to a Ray cluster (status, list, logs, cancel)."""


_address_opt = click.option("--address", help="Ray cluster: host:GCS-port (head:6379), dashboard http://head:8265, "
                            "ray://head:10001 or auto [default: RAY_ADDRESS].")


@job.command("status")
@click.argument("job_id", metavar="JOB")
@_address_opt
@click.option("--follow", "-f", is_flag=True, help="Wait until the job ends; exit 0 only if it succeeded.")
@click.option("--json", "as_json", is_flag=True)
def job_status(job_id, address, follow, as_json):
    """Status of JOB (a submission id, or a local output folder)."""
    from jobs import ray_jobs

    if ("://" in job_id or _is(job_id, "is_dir")) and _address(address) is None:   # a job's output folder
        _local_status(job_id, as_json)
        return
    address = _need_address(address, job_id)

    def show(st):
        if as_json:
            click.echo(json.dumps(st, default=str))
        else:
            msg = f" ({st['message']})" if st.get("message") else ""
            click.echo(f"{st['job_id']}: {st['status']}{msg}")
            line = _manifest_line(st["metadata"].get("output"))
            if line:
                click.echo(line)
    try:
        st = ray_jobs.wait(address, job_id, on_change=show) if follow else ray_jobs.info(address, job_id)
    except KeyboardInterrupt:
        _stopped_following(job_id, address)
    except ConnectionError as e:
        fail(str(e), EXIT_FAILED)
    except RuntimeError as e:
        fail(f"job {job_id}: {e}", EXIT_FAILED)
    if not follow:
        show(st)
    if follow:
        sys.exit(0 if st["status"] == "SUCCEEDED" else EXIT_FAILED)


@job.command("list")
@_address_opt
@click.option("--all", "show_all", is_flag=True, help="Include Ray jobs that are not eaglectl jobs.")
@click.option("--json", "as_json", is_flag=True)
def job_list(address, show_all, as_json):
    """Jobs on the cluster, oldest first."""
    from jobs import ray_jobs

    try:
        jobs = ray_jobs.list_jobs(_need_address(address))
    except ConnectionError as e:
        fail(str(e), EXIT_FAILED)
    if not show_all:
        jobs = [j for j in jobs if j["metadata"].get("eagle_job")]
    if as_json:
        click.echo(json.dumps(jobs, default=str))
        return
    for j in jobs:
        md = j["metadata"]
        click.echo(f"{j['job_id']}\t{j['status']}\t{md.get('input', j['entrypoint'][:60])} -> {md.get('output', '')}")


@job.command("logs")
@click.argument("job_id", metavar="JOB")
@_address_opt
@click.option("--follow", "-f", is_flag=True, help="Keep printing until the job ends.")
def job_logs(job_id, address, follow):
    """The driver's log of JOB (progress lines and summary)."""
    from jobs import ray_jobs

    address = _need_address(address, job_id)
    try:
        if follow:
            ray_jobs.tail_logs(address, job_id, lambda s: click.echo(s, nl=False))
        else:
            click.echo(ray_jobs.logs(address, job_id), nl=False)
    except KeyboardInterrupt:
        _stopped_following(job_id, address)
    except ConnectionError as e:
        fail(str(e), EXIT_FAILED)
    except RuntimeError as e:
        fail(f"job {job_id}: {e}", EXIT_FAILED)


@job.command("cancel")
@click.argument("job_id", metavar="JOB")
@_address_opt
def job_cancel(job_id, address):
    """Stop JOB; committed rows stay, and submitting the same job again resumes it."""
    from jobs import ray_jobs

    try:
        stopped = ray_jobs.stop(_need_address(address, job_id), job_id)
    except ConnectionError as e:
        fail(str(e), EXIT_FAILED)
    except RuntimeError as e:
        fail(f"job {job_id}: {e}", EXIT_FAILED)
    click.echo(f"{job_id}: {'stopping' if stopped else 'already finished'}")
