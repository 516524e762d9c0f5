"""Where a job's files live: local paths, or object storage (`s3://`, `gs://`) through `pyarrow.fs`.

Object storage has no rename and no flock, so the output folder's two guarantees are built
differently there (jobs/output_writer.py uses either kind through the same methods):

* **commit** — local: a part is written under a hidden temp name, fsynced and renamed into place.
  Object store: a part is written straight under its final, unique name (`part-<run>-<n>`; an
  object appears whole or not at all when its upload completes) and counts only once its commit
  record `_commits/<part name>` exists, which is written after it. A run lists the records, deletes
  parts that have none (a driver died between the two) and never reads them.
* **one writer** — local: `.lock` (flock, released by the kernel when the driver dies). Object
  store: `_lock.json`, a lease (owner host/pid/run, expiry) renewed while the driver runs; a driver
  refuses a folder whose lease is held by a live driver (same host and the same process space, i.e.
  kernel boot and pid namespace: its process is alive, the pid and that process's start time, as a
  restarted container reuses pids; otherwise, as for containers that share a host name but not
  their pids: the lease has not expired). Object stores have no compare-and-swap here, so two drivers
  started within the same second can both win: one writer per output is the rule, the lease
  catches the usual mistake (the same job submitted twice).

Credentials and endpoint come from the environment, as pyarrow's S3FileSystem reads it:
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_DEFAULT_REGION`/`AWS_REGION`,
`AWS_ENDPOINT_URL` (or `AWS_ENDPOINT_URL_S3`, for MinIO or other S3-compatible servers), then
`~/.aws/config`/`credentials` and the EC2/EKS instance roles; GCS uses Google's default credentials
(`GOOGLE_APPLICATION_CREDENTIALS`, the metadata server).
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
import uuid
from datetime import timedelta
from pathlib import Path

import psutil
import pyarrow.fs as pafs

REMOTE_SCHEMES = ("s3", "gs", "gcs")
COMMITS = "_commits"
LEASE = "_lock.json"
LOCK = ".lock"
LEASE_S = 120.0
GCS_RETRY_S = 60.0   # how long a GCS call retries before the job fails with the provider's error (rerun resumes)


class StorageError(RuntimeError):
    """A storage location cannot be used; the message names it and says why."""


def is_uri(path: str) -> bool:
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.lower() in REMOTE_SCHEMES


def check_uri(path: str) -> None:
    if "://" in path and not is_uri(path):
        raise StorageError(f"{path}: only local paths and {', '.join(s + '://' for s in REMOTE_SCHEMES)} URIs are supported")


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path inside it) for a URI; credentials from the environment. The key is
    taken as written, as the AWS and gcloud CLIs do (spaces, `[`, `?`, `%20` are part of the name):
    only `scheme://bucket` goes through pyarrow's URI parser."""
    check_uri(uri)
    if not is_uri(uri):
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
    scheme, _, rest = uri.partition("://")
    bucket, _, key = rest.partition("/")
    try:
        if scheme in ("gs", "gcs"):    # pyarrow's default retries a call for 15 minutes: without credentials
            fs, root = pafs.GcsFileSystem(retry_time_limit=timedelta(seconds=GCS_RETRY_S)), bucket   # a silent hang
        else:
            fs, root = pafs.FileSystem.from_uri(f"{scheme}://{bucket}")
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError with the provider's message
        raise StorageError(f"{uri}: cannot open ({_first_line(e)})") from None
    key = key.rstrip("/")
    return fs, f"{root}/{key}" if key else root


def join(base: str, *names: str) -> str:
    if is_uri(base):
        return "/".join([base.rstrip("/"), *names])
    return os.path.join(base, *names)


def split(uri: str) -> tuple[str, str]:
    """(parent, name) of a path or URI (`s3://b/x/y` -> `s3://b/x`, `y`)."""
    if is_uri(uri):
        head, _, name = uri.rstrip("/").rpartition("/")
        if head.endswith(":/"):      # s3://bucket: no parent inside the store
            return uri.rstrip("/"), ""
        return head, name
    p = Path(uri)
    return str(p.parent), p.name


def _first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[0][:300] if lines else type(e).__name__


class Folder:
    """An output folder: named files (flat), atomic small writes, part sinks, one-writer lock."""

    def __init__(self, location: str):
        self.location = location
        self.remote = is_uri(location)
        self.fs, self.root = filesystem(location)
        self._lock_fd: int | None = None
        self._made_lock = False      # `.lock` was not there before this driver's lock()
        self._lease: dict | None = None
        self._lease_at = 0.0

    def __str__(self) -> str:
        return self.location

    def path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def uri(self, name: str) -> str:
        return join(self.location, name)

    # ---- plain files ---------------------------------------------------------------------------
    def names(self, sub: str | None = None) -> list[str]:
        base = self.path(sub) if sub else self.root
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
        except OSError as e:
            raise StorageError(f"{self.location}: cannot list ({_first_line(e)})") from None
        return sorted(i.base_name for i in infos)

    def read_bytes(self, name: str) -> bytes | None:
        try:
            with self.fs.open_input_stream(self.path(name)) as f:
                return f.read()
        except FileNotFoundError:
            return None

    def write_bytes_atomic(self, name: str, data: bytes) -> None:
        """Readers see the old content or the new, never a half-written file."""
        if self.remote:      # one PUT: the object appears whole
            with self.fs.open_output_stream(self.path(name)) as f:
                f.write(data)
            return
        tmp = self.path(f".{name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(name))
        except BaseException:    # e.g. the disk is full: no half-written temp file left behind
            Path(tmp).unlink(missing_ok=True)
            raise

    def delete(self, name: str) -> None:
        try:
            self.fs.delete_file(self.path(name))
        except FileNotFoundError:
            pass

    def mkdir(self) -> bool:
        """Create the local folder; True when it was not there (a refused job then leaves nothing behind).
        A bucket has no folders to make, but an object at the output's key or above it is refused as a
        file is: the job's files would sit behind an object that readers of that key still get."""
        if self.remote:
            key = self.root.rstrip("/")
            while "/" in key:          # the key and its parents, not the bucket
                try:
                    is_object = self.fs.get_file_info(key).type == pafs.FileType.File
                except OSError:        # e.g. credentials scoped to a prefix: HEAD above it is denied
                    break
                if is_object:
                    scheme = self.location.split("://", 1)[0]
                    raise StorageError(f"{self.location}: the output must be a folder, and {scheme}://{key} is an "
                                       "existing object; choose another --output")
                key = key.rsplit("/", 1)[0]
            return False
        if os.path.isdir(self.root):
            return False
        try:
            os.makedirs(self.root)
        except (FileExistsError, NotADirectoryError):
            if os.path.isdir(self.root):     # made meanwhile by another driver (the lock decides which runs)
                return False
            raise StorageError(f"{self.location}: the output must be a folder, and this path is an existing file "
                               "(or lies inside one); choose another --output") from None
        return True

    def rmdir(self) -> None:
        """Remove the local folder if it is empty (what `mkdir` created for a job that was refused)."""
        if not self.remote:
            try:
                os.rmdir(self.root)
            except OSError:
                pass

    # ---- parts ---------------------------------------------------------------------------------
    def committed_parts(self) -> list[str]:
        """Names of the committed part files."""
        parts = [n for n in self.names() if n.startswith("part-")]
        if not self.remote:
            return parts
        records = set(self.names(COMMITS))
        return [n for n in parts if n in records]

    def drop_uncommitted(self, orphan_records: bool = False) -> list[str]:
        """Delete what a driver that died left behind (call with the lock held); returns the names.
        A commit record whose part is gone is refused (the folder was edited by hand), or deleted
        with `orphan_records` (--overwrite: the output starts over)."""
        names = self.names()
        if self.remote:
            records = set(self.names(COMMITS))
            gone = [n for n in names if n.startswith("part-") and n not in records]
            for r in sorted(records - set(names)):
                if orphan_records:
                    self.delete(f"{COMMITS}/{r}")
                    continue
                raise StorageError(f"{self.location}: commit record {COMMITS}/{r} names a part that does not exist; "
                                   "the output was modified by hand: choose another --output or pass --overwrite")
        else:
            gone = [n for n in names if n.startswith(".") and n.endswith(".tmp")]
        for n in gone:
            self.delete(n)
        return gone

    def open_part(self, name: str) -> "PartSink":
        return PartSink(self, name)

    def delete_part(self, name: str) -> None:
        """The commit record first: a driver dying between the two leaves an uncommitted part, which the
        next run deletes, never a record naming a part that is gone."""
        if self.remote:
            self.delete(f"{COMMITS}/{name}")
        self.delete(name)

    # ---- one writer ----------------------------------------------------------------------------
    def lock(self) -> None:
        if not self.remote:
            self._made_lock = not os.path.exists(self.path(LOCK))
            self._lock_fd = os.open(self.path(LOCK), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(self._lock_fd)
                self._lock_fd = None
                raise StorageError(f"{self.location}: another job is writing to this output folder right now") from None
            return
        held = self.lease_holder()
        if held is not None:
            raise StorageError(f"{self.location}: another job is writing to this output ({held}); "
                               f"if that driver is gone, wait for its lease to expire or delete {self.uri(LEASE)}")
        self._lease = {"host": socket.gethostname(), "pid": os.getpid(), "started": _started(os.getpid()),
                       "pid_space": _pid_space(), "token": uuid.uuid4().hex}
        self.renew(force=True)

    def renew(self, force: bool = False) -> None:
        """Extend the lease (object stores); cheap to call often. A lease another driver took over (this
        one let it expire: a stalled driver, a paused VM) stops this driver before it writes again."""
        if self._lease is None or (not force and time.monotonic() - self._lease_at < LEASE_S / 4):
            return
        if not force:
            held = self.lease_holder()
            if held is not None:
                raise StorageError(f"{self.location}: this job's lease on the output expired and another job took "
                                   f"it over ({held}); this driver stops writing")
        self._lease["expires_at"] = time.time() + LEASE_S
        self.write_bytes_atomic(LEASE, json.dumps(self._lease).encode())
        self._lease_at = time.monotonic()

    def lease_holder(self) -> str | None:
        """Who holds the lease of a remote folder (None: nobody alive)."""
        raw = self.read_bytes(LEASE)
        if raw is None:
            return None
        try:
            lease = json.loads(raw)
        except ValueError:
            return None
        if self._lease is not None and lease.get("token") == self._lease.get("token"):
            return None
        mine = _pid_space()              # a lease from before pid spaces were recorded: its host decides
        if lease.get("host") == socket.gethostname() and lease.get("pid_space", mine) == mine:
            pid = int(lease.get("pid", 0))              # here a dead driver is seen at once, a busy one kept
            if lease.get("started") is not None:        # a restarted container reuses pids: which process
                alive = _pid_alive(pid) and _started(pid) == lease["started"]
            else:
                alive = _pid_alive(pid) and time.time() < float(lease.get("expires_at", 0))
        else:
            alive = time.time() < float(lease.get("expires_at", 0))
        return f"host {lease.get('host')} pid {lease.get('pid')}" if alive else None

    def is_locked(self) -> bool:
        if self.remote:
            return self.lease_holder() is not None
        try:     # read-only: `job status` works on a read-only mount or snapshot of the output too
            fd = os.open(self.path(LOCK), os.O_RDONLY)
        except OSError:       # none there (or unreadable: nothing shows a driver)
            return False
        try:     # shared: two status probes do not contend with each other
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def unlock(self, leave_nothing: bool = False) -> None:
        """Release the lock; `leave_nothing`: also remove a `.lock` this driver created (the job was refused:
        the folder stays as it was found)."""
        if self._lock_fd is not None:
            if leave_nothing and self._made_lock:
                Path(self.path(LOCK)).unlink(missing_ok=True)   # while still held: no other driver is on it
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
        if self._lease is not None:
            try:
                raw = self.read_bytes(LEASE)
                if raw is not None and json.loads(raw).get("token") == self._lease["token"]:   # still ours
                    self.delete(LEASE)
            except (OSError, ValueError):
                pass
            self._lease = None


def _pid_space() -> str | None:
    """Where this process's pids mean something: the kernel's boot and the pid namespace. Two containers
    with one host name (a pod's sidecars, `--hostname`) differ here, so neither judges the other's
    lease by a pid it cannot see. None where Linux's /proc does not say."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def _started(pid: int) -> float | None:
    """When process `pid` started (seconds, rounded: it names one process among those that had the pid)."""
    try:
        return round(psutil.Process(pid).create_time(), 2)
    except (psutil.Error, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PartSink:
    """A part being written: `stream` takes bytes; `commit` makes it count, `abort` drops it."""

    def __init__(self, folder: Folder, name: str):
        self.folder, self.name = folder, name
        if folder.remote:
            self.stream = folder.fs.open_output_stream(folder.path(name))
        else:
            self._tmp = folder.path(f".{name}.tmp")
            self.stream = open(self._tmp, "wb")

    def commit(self, record: dict | None = None) -> None:
        f = self.folder
        if f.remote:
            self.stream.close()                    # completes the upload: the object exists, whole
            f.renew()                              # still ours? (else the part stays uncommitted: it never counts)
            f.write_bytes_atomic(f"{COMMITS}/{self.name}", json.dumps(record or {}).encode())   # now it counts
            return
        self.stream.flush()
        os.fsync(self.stream.fileno())
        self.stream.close()
        os.replace(self._tmp, f.path(self.name))
        fd = os.open(f.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def replace_in_place(self) -> None:
        """Finish a rewrite of an already committed part (its record stays valid)."""
        f = self.folder
        if f.remote:
            self.stream.close()
            return
        self.commit()

    def abort(self) -> None:
        try:
            self.stream.close()
        except Exception:
            pass
        if self.folder.remote:
            self.folder.delete(self.name)
        else:
            Path(self._tmp).unlink(missing_ok=True)
