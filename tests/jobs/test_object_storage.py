"""Jobs in and out of a bucket on a real S3-compatible server (moto's standalone server, started here
on 127.0.0.1): commit records, uncommitted parts removed, the lease, and a job killed with SIGKILL
mid-run and resumed with every id exactly once. Credentials and endpoint reach pyarrow through the
standard environment variables only (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from .conftest import cli, cli_env, cli_popen

pytestmark = pytest.mark.slow   # a server subprocess (and the CLI in subprocesses)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_env():
    pytest.importorskip("moto", reason="moto[server] (the `test` extra) starts the S3 server")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        t0 = time.monotonic()
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() - t0 < 30 and proc.poll() is None, "moto server did not start"
                time.sleep(0.1)
        yield env
    finally:
        proc.kill()
        proc.wait(10)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _bucket(name: str) -> pafs.S3FileSystem:
    import boto3

    boto3.client("s3").create_bucket(Bucket=name)
    return pafs.FileSystem.from_uri(f"s3://{name}")[0]


def _rec(i, error=None):
    return {"id": f"r{i}", "text": f"t{i}", "finish_reason": "length", "prompt_tokens": 3, "completion_tokens": 4,
            "accepted_tokens_per_step": 1.0, "latency_s": 0.1, "error": error, "chat": False, "model": "m"}


def test_parts_count_once_their_commit_record_exists(s3_env):
    from jobs.output_writer import BASE_SCHEMA, OutputDir, OutputError, PartWriter

    fs = _bucket("commits")
    fp = {"model": "m"}
    out = OutputDir("s3://commits/out", "parquet")
    out.open(fp)
    out.write_manifest({"fingerprint": fp, "runs": [{"run_id": "run1"}]})   # as a run records itself
    with pytest.raises(OutputError, match="another job is writing to this output"):
        OutputDir("s3://commits/out", "parquet").open(fp)       # the lease: this process is alive
    w = PartWriter(out, BASE_SCHEMA, "run1", rows_per_file=3)
    for i in range(5):
        w.add(_rec(i))                                           # 3 committed, 2 in an open upload
    # a driver that died after its part's upload completed but before the commit record was written
    sink = out.folder.open_part("part-run1-99999.parquet")
    pq.write_table(pa.table({"id": ["r3", "r4"]}), sink.stream)
    sink.stream.close()
    names = [i.base_name for i in fs.get_file_info(pafs.FileSelector("commits/out", recursive=True))]
    assert "part-run1-99999.parquet" in names and "part-run1-00000.parquet" in names
    out.folder._lease["pid"] = 2 ** 22 + 12345                   # as if the driver had died: its pid is gone
    out.folder.renew(force=True)
    again = OutputDir("s3://commits/out", "parquet")
    ids, counts = again.open(fp)
    assert counts.rows == 3 and "r3" not in ids and again.dropped_uncommitted == ["part-run1-99999.parquet"]
    assert not fs.get_file_info("commits/out/part-run1-99999.parquet").is_file
    again.close()
    assert not fs.get_file_info("commits/out/_lock.json").is_file


def test_job_in_and_out_of_a_bucket_killed_and_resumed(s3_env, tiny_model):
    fs = _bucket("jobs")
    n = 1200
    for k in range(2):
        pq.write_table(pa.table({"id": [f"f{k}-{i}" for i in range(n // 2)],
                                 "prompt": [f"the quick brown fox {k} {i}" for i in range(n // 2)]}),
                       f"jobs/in/part{k}.parquet", filesystem=fs)
    env = cli_env(**s3_env)
    args = ["submit-job", "s3://jobs/in", "--output", "s3://jobs/out", "--model", tiny_model, "--draft", "none",
            "--max-tokens", "2", "--rows-per-file", "100", "--max-num-seqs", "32"]
    proc = cli_popen(*args, env=env)
    t0 = time.monotonic()
    while len(fs.get_file_info(pafs.FileSelector("jobs/out/_commits", allow_not_found=True))) < 3:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() - t0 < 240, "no progress"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    proc.stdout.close()
    assert fs.get_file_info("jobs/out/_lock.json").is_file         # the dead driver's lease is left behind

    res = cli(*args, env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"job completed: {n}/{n} rows" in res.stdout
    parts = sorted(i.path for i in fs.get_file_info(pafs.FileSelector("jobs/out")) if i.base_name.startswith("part-"))
    records = {i.base_name for i in fs.get_file_info(pafs.FileSelector("jobs/out/_commits"))}
    assert {p.rsplit("/", 1)[1] for p in parts} == records                # nothing uncommitted left
    ids = pq.read_table("s3://jobs/out", columns=["id"]).column("id").to_pylist()
    assert len(ids) == n and set(ids) == {f"f{k}-{i}" for k in range(2) for i in range(n // 2)}
    status = cli("job", "status", "s3://jobs/out", "--json", env=env)
    assert status.returncode == 0 and '"complete": true' in status.stdout


def test_a_driver_whose_lease_another_took_over_writes_nothing_more(s3_env):
    """A driver that stalled past its lease (a paused VM) while another driver took the output over:
    its next write finds the lease gone and stops, so it never commits a part the other also writes
    (its upload stays uncommitted: it never counts), nor overwrites the other's manifest."""
    import json

    from jobs.output_writer import BASE_SCHEMA, OutputDir, PartWriter
    from jobs.storage import COMMITS, LEASE, StorageError

    fs = _bucket("takeover")
    fp = {"model": "m"}
    out = OutputDir("s3://takeover/out", "parquet")
    out.open(fp)
    w = PartWriter(out, BASE_SCHEMA, "run1", rows_per_file=2)
    w.add(_rec(0))
    w.add(_rec(1))                                               # one part committed while the lease was ours
    theirs = {"host": "elsewhere", "pid": 1, "token": "theirs", "expires_at": time.time() + 120}
    out.folder.write_bytes_atomic(LEASE, json.dumps(theirs).encode())
    out.folder._lease_at -= 10_000                               # this driver's last renewal: long ago
    w.add(_rec(2))
    with pytest.raises(StorageError, match="lease on the output expired and another job took it over"):
        w.add(_rec(3))                                           # the second part's commit
    with pytest.raises(StorageError, match="another job took it over"):
        out.write_manifest({"fingerprint": fp, "runs": []})
    records = [i.base_name for i in fs.get_file_info(pafs.FileSelector(f"takeover/out/{COMMITS}"))]
    assert records == ["part-run1-00000.parquet"]
    assert json.loads(out.folder.read_bytes(LEASE))["token"] == "theirs"
    assert out.folder.read_bytes("_manifest.json") is None


def test_an_object_named_with_a_wildcard_is_that_object_and_its_output_named_for_it(s3_env):
    """`s3://b/in/part*.parquet` that exists is read as that object (not also `part1.parquet`) and its
    default output is `part*.out` beside it, as a local file's; no such object: a glob's name."""
    from jobs.input_files import resolve_files
    from jobs.job_config import default_output

    fs = _bucket("wild")
    for name in ("part*", "part1"):
        pq.write_table(pa.table({"prompt": [name]}), f"wild/in/{name}.parquet", filesystem=fs)
    assert resolve_files("s3://wild/in/part*.parquet")[1] == ["wild/in/part*.parquet"]
    assert default_output("s3://wild/in/part*.parquet") == "s3://wild/in/part*.out"
    assert default_output("s3://wild/in/p*.parquet").startswith("s3://wild/in.glob-")


def test_keys_with_spaces_brackets_and_question_marks_are_read_and_written_as_written(s3_env):
    """The key after `s3://bucket/` is taken as written, as the AWS CLI does: pyarrow's URI parser
    refused spaces and `[` and took `?` for a query; a glob over such names still matches them."""
    from jobs.input_files import resolve_files
    from jobs.storage import Folder, filesystem

    fs = _bucket("odd")
    names = ["my prompts.parquet", "x[1].parquet", "q?.parquet", "a%20b.parquet"]
    for name in names:
        pq.write_table(pa.table({"prompt": [name]}), f"odd/in/{name}", filesystem=fs)
    for name in names:
        got_fs, path = filesystem(f"s3://odd/in/{name}")
        assert path == f"odd/in/{name}" and pq.read_table(path, filesystem=got_fs)["prompt"].to_pylist() == [name]
        assert resolve_files(f"s3://odd/in/{name}")[1] == [f"odd/in/{name}"]
    assert sorted(resolve_files("s3://odd/in/*.parquet")[1]) == sorted(f"odd/in/{n}" for n in names)
    out = Folder("s3://odd/out dir/run [1]")
    out.write_bytes_atomic("_manifest.json", b"{}")
    assert out.read_bytes("_manifest.json") == b"{}" and fs.get_file_info("odd/out dir/run [1]/_manifest.json").size == 2


def test_an_output_at_an_existing_objects_key_is_refused_before_any_row(s3_env):
    """`--output s3://b/in/b.parquet` where that object is one of the input's files: the input dropped it
    as the output's own and the job ran the other files' rows only, exit 0, its files behind the object."""
    from jobs.job_config import JobConfig
    from jobs.output_writer import OutputError
    from jobs.runner import JobRunner
    from jobs.storage import StorageError

    fs = _bucket("objout")
    for name, ids in (("a", ["a1", "a2"]), ("b", ["b1", "b2", "b3"])):
        pq.write_table(pa.table({"id": ids, "prompt": ids}), f"objout/in/{name}.parquet", filesystem=fs)
    for output in ("s3://objout/in/b.parquet", "s3://objout/in/b.parquet/deeper"):
        cfg = JobConfig(input="s3://objout/in", output=output, model="no-model-needed", draft="none")
        with pytest.raises((OutputError, StorageError), match=r"s3://objout/in/b.parquet is an existing object"):
            JobRunner(cfg).run()
    assert sorted(i.path for i in fs.get_file_info(pafs.FileSelector("objout", recursive=True))) == \
        ["objout/in", "objout/in/a.parquet", "objout/in/b.parquet"]        # nothing written


def test_an_input_inside_the_output_folder_is_named_as_such(s3_env, tmp_path):
    """Every input file would be skipped as the output's own: the message says why, not "no files"."""
    from jobs.input_files import InputError, resolve_files

    fs = _bucket("parentout")
    pq.write_table(pa.table({"prompt": ["x"]}), "parentout/data/in/x.parquet", filesystem=fs)
    for spec, output in (("s3://parentout/data/in", "s3://parentout/data"), ("s3://parentout/data/in", "s3://parentout"),
                         ("s3://parentout/data/in", "s3://parentout/data/in"),
                         ("s3://parentout/data/in/*.parquet", "s3://parentout/data/in")):
        with pytest.raises(InputError, match=f"the input is the output folder {output} or lies inside it"):
            resolve_files(spec, exclude=output)
    (tmp_path / "data" / "in").mkdir(parents=True)
    pq.write_table(pa.table({"prompt": ["x"]}), tmp_path / "data" / "in" / "x.parquet")
    for spec, output in ((tmp_path / "data" / "in" / "*.parquet", tmp_path / "data"),
                         (tmp_path / "data" / "in", tmp_path / "data" / "in"),
                         (tmp_path / "data" / "in" / "*.parquet", tmp_path / "data" / "in")):
        with pytest.raises(InputError, match="the input is the output folder .* or lies inside it"):
            resolve_files(str(spec), exclude=str(output))
    assert resolve_files(str(tmp_path / "data" / "in"), exclude=str(tmp_path / "data" / "in.out"))[1]


def test_a_same_host_lease_names_its_process_not_just_a_pid(s3_env):
    """A restarted container (same host name, pids reused) found its old lease held "by a live pid"
    forever. A lease now names its process (pid and start time): another process with that pid does
    not hold it, the process itself does however long since it renewed (a long step), and a lease
    written before start times were recorded ends when it expires. A container that shares the host
    name but not the pids (another pid namespace) is judged by the lease's expiry, not by a pid."""
    import json
    import socket

    import psutil

    from jobs.storage import LEASE, Folder

    _bucket("lease")
    folder = Folder("s3://lease/out")
    here = {"host": socket.gethostname(), "token": "old"}
    me = round(psutil.Process().create_time(), 2)
    space = f"{Path('/proc/sys/kernel/random/boot_id').read_text().strip()}/{os.readlink('/proc/self/ns/pid')}"
    for lease, held in ((here | {"pid": os.getpid(), "started": me, "expires_at": 0}, True),     # busy, still here
                        (here | {"pid": os.getpid(), "started": me - 3600, "expires_at": time.time() + 60}, False),
                        (here | {"pid": 2**22 + 12345, "started": me, "expires_at": time.time() + 60}, False),
                        (here | {"pid": 1, "expires_at": 0}, False),                # no start time: expired
                        (here | {"pid": 1, "expires_at": time.time() + 60}, True),
                        ({"host": "elsewhere", "pid": 1, "token": "x", "expires_at": time.time() + 60}, True),
                        ({"host": "elsewhere", "pid": 1, "token": "x", "expires_at": 0}, False),
                        # a container with this host name but its own pids: its lease is judged by expiry, as
                        # its pid means nothing here (here it names no process, or another one)
                        (here | {"pid": 2**22 + 1, "started": me, "pid_space": "other", "expires_at": time.time() + 60}, True),
                        (here | {"pid": os.getpid(), "started": me, "pid_space": "other", "expires_at": 0}, False),
                        (here | {"pid": os.getpid(), "started": me, "pid_space": space, "expires_at": 0}, True)):
        folder.write_bytes_atomic(LEASE, json.dumps(lease).encode())
        assert (folder.lease_holder() is not None) is held, lease
    folder.write_bytes_atomic(LEASE, json.dumps(here | {"pid": 1, "started": 1.0, "expires_at": 0}).encode())
    folder.lock()                                                   # another process once had pid 1: taken over
    assert json.loads(folder.read_bytes(LEASE))["started"] == me
    assert json.loads(folder.read_bytes(LEASE))["pid_space"] == space
    folder.unlock()


def test_a_damaged_part_in_a_bucket_says_which_two_objects_to_delete(s3_env):
    from jobs.output_writer import BASE_SCHEMA, OutputDir, OutputError, PartWriter
    from jobs.storage import COMMITS

    fs = _bucket("damaged")
    out = OutputDir("s3://damaged/out", "parquet")
    out.open({"model": "m"})
    w = PartWriter(out, BASE_SCHEMA, "run1", rows_per_file=1)
    w.add(_rec(0))
    w.commit()
    out.write_manifest({"fingerprint": {"model": "m"}, "runs": [{"run_id": "run1"}]})
    out.close()
    part = "part-run1-00000.parquet"
    with fs.open_output_stream(f"damaged/out/{part}") as f:
        f.write(b"PAR1 truncated")
    with pytest.raises(OutputError) as e:
        OutputDir("s3://damaged/out", "parquet").open({"model": "m"})
    assert f"delete it and its commit record s3://damaged/out/{COMMITS}/{part}" in str(e.value)
    fs.delete_file(f"damaged/out/{part}")                           # as the message says: then the rows run again
    fs.delete_file(f"damaged/out/{COMMITS}/{part}")
    done, _ = OutputDir("s3://damaged/out", "parquet").open({"model": "m"})
    assert len(done) == 0


def test_gcs_calls_retry_for_a_minute_not_fifteen():
    """Without credentials or network, pyarrow's default retried the first GCS call for 15 minutes,
    printing nothing; the job now fails within GCS_RETRY_S with the provider's error."""
    from datetime import timedelta

    from jobs.storage import GCS_RETRY_S, filesystem

    fs, root = filesystem("gs://some-bucket/prompts/in.parquet")
    assert root == "some-bucket/prompts/in.parquet" and fs.type_name == "gcs"
    assert fs.__reduce__()[1][0]["retry_time_limit"] == timedelta(seconds=GCS_RETRY_S)


def test_a_store_that_stops_answering_mid_input_fails_the_job_not_the_rows(s3_env, monkeypatch):
    """A bucket that went away mid-read made the rest of the input "unreadable" error rows (the
    advice: fix the input, --retry-errors); the store not answering is no row's fault: the run fails
    (exit 1) and a plain rerun goes on from the committed rows."""
    import boto3

    from jobs.input_reader import iter_rows, open_input
    from jobs.storage import StorageError

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        t0 = time.monotonic()
        while True:
            try:
                boto3.client("s3").create_bucket(Bucket="flaky")
                break
            except Exception:
                assert time.monotonic() - t0 < 30 and proc.poll() is None, "moto server did not start"
                time.sleep(0.2)
        fs = pafs.FileSystem.from_uri("s3://flaky")[0]
        pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(400)]}), "flaky/in.parquet", filesystem=fs,
                       row_group_size=100)
        rows = iter_rows(open_input("s3://flaky/in.parquet"), 50)
        first = [next(rows) for _ in range(50)]
        assert all(r.error is None for r in first)
        proc.kill()
        proc.wait(10)
        with pytest.raises(StorageError, match="row group 1 cannot be read from the store"):
            for row in rows:
                assert row.error is None, row.error              # no error rows on the way
    finally:
        proc.kill()
        proc.wait(10)


def test_a_read_the_stores_client_failed_is_the_stores_fault_even_when_it_answers_again(s3_env):
    """A one-off network error (the object's listing answers again at once) is still no row's fault;
    corrupt data (the decoder's error, the object listed fine) is."""
    from jobs.input_reader import InputFile, InputPlan, _store_failed

    fs = _bucket("blip")
    pq.write_table(pa.table({"prompt": ["x"]}), "blip/in.parquet", filesystem=fs)
    plan, f = InputPlan(kind="parquet", files=[], fs=fs), InputFile(path="blip/in.parquet", label="in.parquet", num_rows=1)
    assert _store_failed(f, plan, OSError("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 56"))
    assert not _store_failed(f, plan, OSError("ZSTD decompression failed"))
    assert not _store_failed(f, plan, ValueError("invalid UTF-8"))
    local = InputPlan(kind="parquet", files=[], fs=pafs.LocalFileSystem())
    assert not _store_failed(f, local, OSError("AWS Error NETWORK_CONNECTION"))
