"""The job driver as a process: run one job here and exit with its code.

`eaglectl submit-job` without a cluster calls `drive` in its own process; on a cluster the Ray job's
entrypoint is `python -m jobs.driver --config-json JSON [--address auto]` (jobs/ray_jobs.py), so
the cluster runs the driver without the CLI. Exit codes: 0 the job completed, 1 it failed, 2 bad
input or settings (nothing generated), 3 it completed with error rows (or unreadable rows, or rows
skipped for a duplicate id: see the manifest; `--retry-errors` runs the error rows again), 130
cancelled. As a Ray job entrypoint the driver exits 0 for "completed with error rows" (Ray would
call the job FAILED) and prints RESULT_MARKER, which `eaglectl submit-job --address` turns back
into exit code 3.
"""
from __future__ import annotations

import argparse
import logging
import sys

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_WITH_ERRORS, EXIT_CANCELLED = 0, 1, 2, 3, 130
RESULT_MARKER = "eagle-job: completed with error rows"


def setup_logging() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("jobs").setLevel(logging.INFO)


def _error(msg: str, code: int) -> int:
    print(f"error: {msg}", file=sys.stderr, flush=True)
    return code


def drive(cfg, ray_address: str) -> int:
    """Run the job `cfg` (a JobConfig) in this process; prints the summary, returns the exit code."""
    from jobs.input_reader import InputError
    from jobs.job_config import JobConfigError
    from jobs.output_writer import MANIFEST, OutputError
    from jobs.progress import summary
    from jobs.replica_pool import JobFailed
    from jobs.runner import run_job
    from jobs.storage import StorageError

    setup_logging()
    try:
        manifest = run_job(cfg, ray_address=ray_address)
    except (InputError, JobConfigError, OutputError) as e:
        return _error(str(e), EXIT_USAGE)
    except StorageError as e:   # mid-run: e.g. this job's lease on a bucket output was taken over
        return _error(f"job failed: {e}", EXIT_FAILED)
    except OSError as e:     # storage unreachable or failing mid-run (object store credentials, network)
        return _error(f"job failed: storage error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", EXIT_FAILED)
    except JobFailed as e:
        return _error(f"job failed: {e}", EXIT_FAILED)
    except KeyboardInterrupt:
        return _error("interrupted; committed rows are kept, run the same command again to resume", EXIT_CANCELLED)
    print(summary(manifest), flush=True)
    if manifest["status"] == "cancelled":
        return EXIT_CANCELLED
    if manifest.get("error_rows") or manifest.get("unreadable_rows"):
        print(f"{RESULT_MARKER} (exit code {EXIT_WITH_ERRORS}; see error rows in the output, "
              "fix their input and rerun with --retry-errors)", flush=True)
        return EXIT_WITH_ERRORS
    if manifest.get("duplicate_ids_skipped"):     # rows of the input not in the output: not a complete job
        print(f"{RESULT_MARKER} (exit code {EXIT_WITH_ERRORS}; {manifest['duplicate_ids_skipped']} input row(s) "
              "skipped: their id was already used by an earlier row; give every row its own id)", flush=True)
        return EXIT_WITH_ERRORS
    if not manifest.get("complete"):     # whatever the reason, never exit 0 on an output its manifest calls incomplete
        print(f"{RESULT_MARKER} (exit code {EXIT_WITH_ERRORS}; the output holds {manifest.get('rows')} rows for "
              f"{manifest.get('input_rows')} input rows: see {MANIFEST})", flush=True)
        return EXIT_WITH_ERRORS
    return EXIT_OK


def main(argv: list[str] | None = None) -> None:
    from jobs.job_config import RESOLVED, JobConfig

    p = argparse.ArgumentParser(prog="python -m jobs.driver", description="The job driver on a cluster "
                                "(the Ray job entrypoint that `eaglectl submit-job --address ...` submits).")
    p.add_argument("--config-json", required=True, help="The job's resolved JobConfig as JSON.")
    p.add_argument("--address", default="auto", help="Ray cluster to join (default: %(default)s).")
    args = p.parse_args(argv)
    code = drive(JobConfig.model_validate_json(args.config_json, context=RESOLVED), args.address)
    sys.exit(EXIT_OK if code == EXIT_WITH_ERRORS else code)   # Ray: a job with error rows still SUCCEEDED


if __name__ == "__main__":
    main()
