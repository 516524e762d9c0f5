"""Which files an input names (a file, a folder, a glob; local or `s3://`/`gs://`) and their identity.

The identity (each file's path, size and a content digest) goes into the output's manifest, so a
resume into the same output with a different input is refused instead of mixing the two. The
digest covers a whole file up to 4 MiB, else its first and last 64 KiB (the Parquet footer, with
its row counts, every column chunk's compressed size and statistics, lies in the last part): at
most two reads per file, whatever its size. An edit that keeps the size, the head, the tail and
(Parquet) every compressed chunk size of a big file escapes it.
"""
from __future__ import annotations

import fnmatch
import glob
import hashlib
import logging
from pathlib import Path

import pyarrow.fs as pafs

from jobs.job_config import JSONL_SUFFIXES, glob_base
from jobs.storage import StorageError, filesystem, is_uri

DIGEST_SPAN = 64 * 1024
WHOLE_FILE = 4 * 2**20      # smaller files are digested whole
MIXED = "mixes Parquet and JSONL files; use one format per job"
logger = logging.getLogger(__name__)


class InputError(ValueError):
    """The input cannot be used (missing, unreadable, wrong schema); nothing was generated."""


def _hidden(name: str) -> bool:
    return name.startswith((".", "_"))


def kind_of(path: str) -> str:
    return "jsonl" if path.lower().endswith(JSONL_SUFFIXES) else "parquet"


def _in_folder(paths: list[str], root: str, spec: str) -> list[str]:
    """A folder's *.parquet or its *.jsonl files, never both (refused, as a glob mixing them is);
    other files are skipped with a warning naming them, hidden and `_` names (`_SUCCESS`) silently."""
    kinds: dict[str, list[str]] = {"parquet": [], "jsonl": [], "other": []}
    for p in sorted(paths):
        rel = p[len(root):].strip("/")
        if not any(_hidden(part) for part in rel.split("/")):
            name = p.lower()
            kinds["parquet" if name.endswith(".parquet") else "jsonl" if name.endswith(JSONL_SUFFIXES)
                  else "other"].append(p)
    parquet, jsonl, other = kinds.values()
    if parquet and jsonl:
        raise InputError(f"{spec}: {MIXED} (e.g. {label_of(parquet[0], root)} and {label_of(jsonl[0], root)})")
    if other and (parquet or jsonl):
        names = [label_of(p, root) for p in other]
        logger.warning("%s: skipping %d file(s) that are neither .parquet nor .jsonl/.ndjson: %s%s", spec, len(names),
                       ", ".join(names[:5]), f" and {len(names) - 5} more" if len(names) > 5 else "")
    return parquet or jsonl


def resolve_files(spec: str, exclude: str | None = None) -> tuple[pafs.FileSystem, list[str], str]:
    """(filesystem, files, root) for a file, a folder (its *.parquet or *.jsonl files) or a glob."""
    try:
        fs, path = filesystem(spec)
    except StorageError as e:
        raise InputError(str(e)) from None
    if not is_uri(spec):
        return (fs, *_resolve_local(path, exclude))
    ex = filesystem(exclude)[1].rstrip("/") if exclude and is_uri(exclude) else None

    def keep(p: str) -> bool:
        return not _hidden(p.rsplit("/", 1)[-1]) and not (ex and (p == ex or p.startswith(ex + "/")))

    try:
        if glob.has_magic(path):
            root = str(glob_base(path))
            infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
            files = sorted(i.path for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatchcase(i.path, path)
                           and keep(i.path))
            if not files:
                raise InputError(f"{spec}: the pattern matches no files")
        else:
            info = fs.get_file_info(path)
            if info.type == pafs.FileType.File:
                root, files = path.rsplit("/", 1)[0], [path]
            elif info.type == pafs.FileType.Directory:
                root = path.rstrip("/")
                infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
                files = _in_folder([i.path for i in infos if i.type == pafs.FileType.File and keep(i.path)], root, spec)
                if not files:
                    raise InputError(f"{spec}: the folder holds no .parquet or .jsonl files")
            else:
                raise InputError(f"{spec}: no such file or folder")
    except OSError as e:
        raise InputError(f"{spec}: cannot list ({str(e).splitlines()[0]})") from None
    return fs, files, root


def _resolve_local(spec: str, exclude: str | None) -> tuple[list[str], str]:
    ex = Path(exclude).resolve() if exclude and not is_uri(exclude) else None

    def keep(p: Path) -> bool:
        return p.is_file() and not _hidden(p.name) and not (ex and (p.resolve() == ex or ex in p.resolve().parents))

    if glob.has_magic(spec):
        root = glob_base(spec)
        files = sorted(Path(p) for p in glob.glob(spec, recursive=True) if keep(Path(p)))
        if not files:
            raise InputError(f"{spec}: the pattern matches no files")
    elif Path(spec).is_dir():
        root = Path(spec)
        files = [Path(p) for p in _in_folder([str(p) for p in root.rglob("*") if keep(p)], str(root), spec)]
        if not files:
            raise InputError(f"{spec}: the folder holds no .parquet or .jsonl files")
    elif Path(spec).is_file():
        root, files = Path(spec).parent, [Path(spec)]
    else:
        raise InputError(f"{spec}: no such file or folder")
    return [str(p) for p in files], str(root)


def label_of(path: str, root: str) -> str:
    """The file relative to the input root (derived ids use it, so they survive moving the data)."""
    root = root.rstrip("/")
    return path[len(root) + 1:] if path.startswith(root + "/") else path.rsplit("/", 1)[-1]


def file_identity(fs: pafs.FileSystem, path: str, display: str) -> list:
    """[path, size, digest of the content (whole, or first and last 64 KiB)]."""
    try:
        with fs.open_input_file(path) as f:
            size = f.size()
            h = hashlib.blake2b(digest_size=16)
            if size <= WHOLE_FILE:
                h.update(f.read_at(size, 0))
            else:
                h.update(f.read_at(DIGEST_SPAN, 0))
                h.update(f.read_at(DIGEST_SPAN, size - DIGEST_SPAN))
    except OSError as e:
        raise InputError(f"{display}: cannot read ({str(e).splitlines()[0]})") from None
    return [display, size, h.hexdigest()]
