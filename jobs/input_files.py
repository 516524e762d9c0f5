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
import os
from pathlib import Path

import pyarrow.fs as pafs

from jobs.job_config import JSONL_SUFFIXES, encodable, glob_base, is_local_glob
from jobs.storage import StorageError, filesystem, is_uri

DIGEST_SPAN = 64 * 1024
WHOLE_FILE = 4 * 2**20      # smaller files are digested whole
MIXED = "mixes Parquet and JSONL files; use one format per job"
logger = logging.getLogger(__name__)


class InputError(ValueError):
    """The input cannot be used (missing, unreadable, wrong schema); nothing was generated."""


def _hidden(name: str) -> bool:
    return name.startswith((".", "_"))


def _hidden_below(rel: str) -> bool:
    """Whether a path relative to the input root has a hidden or `_` part (`.staging/`, `_temporary/`,
    `_SUCCESS`): what writers leave beside their data, skipped as dataset readers skip it."""
    return any(_hidden(part) for part in rel.split("/"))


def _glob_match(parts: list[str], pattern: list[str]) -> bool:
    """Path parts against pattern parts as glob.glob(recursive=True) matches them: `*`, `?`, `[...]`
    within one part, `**` any number of parts (fnmatch on the whole path lets `*` match `/`)."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_glob_match(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _glob_match(parts[1:], pattern[1:])


def _path_text(path: str) -> str:
    """A local path as text that can be printed: the bytes of a name that is not UTF-8 as `\\xNN`."""
    try:
        return os.fsencode(path).decode("utf-8", "backslashreplace")
    except UnicodeError:
        return ascii(path)


def kind_of(path: str) -> str:
    return "jsonl" if path.lower().endswith(JSONL_SUFFIXES) else "parquet"


def _in_folder(paths: list[str], root: str, spec: str) -> list[str]:
    """A folder's *.parquet or its *.jsonl files, never both (refused, as a glob mixing them is);
    other files are skipped with a warning naming them, hidden and `_` names (`_SUCCESS`) silently."""
    kinds: dict[str, list[str]] = {"parquet": [], "jsonl": [], "other": []}
    for p in sorted(paths):
        if not _hidden_below(p[len(root):].strip("/")):
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


def is_bucket_glob(fs: pafs.FileSystem, path: str) -> bool:
    """A pattern in a bucket: wildcards (`*`, `?`, `[`) and no object or folder of that very name (as
    `is_local_glob` on disk). The one rule for reading such an input and for naming its default output."""
    return glob.has_magic(path) and fs.get_file_info(path).type == pafs.FileType.NotFound


def resolve_files(spec: str, exclude: str | None = None) -> tuple[pafs.FileSystem, list[str], str]:
    """(filesystem, files, root) for a file, a folder (its *.parquet or *.jsonl files) or a glob."""
    try:
        fs, path = filesystem(spec)
    except StorageError as e:
        raise InputError(str(e)) from None
    if not is_uri(spec):
        return (fs, *_resolve_local(path, exclude))
    ex = filesystem(exclude)[1].rstrip("/") if exclude and is_uri(exclude) else None
    if ex and (str(glob_base(path)) if glob.has_magic(path) else path).startswith(ex + "/"):
        raise InputError(_inside_output(spec, exclude))

    def keep(p: str) -> bool:
        return not (ex and (p == ex or p.startswith(ex + "/")))

    try:
        if is_bucket_glob(fs, path):
            root = str(glob_base(path))
            pattern = path[len(root):].strip("/").split("/")
            infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
            files = sorted(i.path for i in infos if i.type == pafs.FileType.File and keep(i.path)
                           and not _hidden_below(rel := i.path[len(root):].strip("/"))
                           and _glob_match(rel.split("/"), pattern))
            if not files:
                raise InputError(_inside_output(spec, exclude) if ex == root.rstrip("/")
                                 else f"{spec}: the pattern matches no files")
        elif (info := fs.get_file_info(path)).type == pafs.FileType.File:
            root, files = path.rsplit("/", 1)[0], [path]
        elif info.type == pafs.FileType.Directory:
            root = path.rstrip("/")
            infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
            files = _in_folder([i.path for i in infos if i.type == pafs.FileType.File and keep(i.path)], root, spec)
            if not files:
                raise InputError(_inside_output(spec, exclude) if ex == root
                                 else f"{spec}: the folder holds no .parquet or .jsonl files")
        else:
            raise InputError(f"{spec}: no such file or folder")
    except OSError as e:
        raise InputError(f"{spec}: cannot list ({str(e).splitlines()[0]})") from None
    return fs, files, root


def _inside_output(spec: str, output: str) -> str:
    """Every input file would be skipped as one of the output's own: say so, not "no files"."""
    return f"{spec}: the input is the output folder {output} or lies inside it; choose an --output that does not hold it"


def _resolve_local(spec: str, exclude: str | None) -> tuple[list[str], str]:
    ex = Path(exclude).resolve() if exclude and not is_uri(exclude) else None
    base = Path(glob_base(spec) if is_local_glob(spec) else spec).resolve()
    if ex and (ex in base.parents or (ex == base and base.is_dir())):
        raise InputError(_inside_output(spec, exclude))

    def keep(p: Path) -> bool:
        return p.is_file() and not _hidden(p.name) and not (ex and (p.resolve() == ex or ex in p.resolve().parents))

    if is_local_glob(spec):
        root = glob_base(spec)
        files = sorted(Path(p) for p in glob.glob(spec, recursive=True)
                       if keep(Path(p)) and not _hidden_below(os.path.relpath(p, root)))
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
    for p in files:        # its derived ids and the output could not be written (UnicodeEncodeError)
        if not encodable(str(p)):
            raise InputError(f"{_path_text(str(p))}: the file name is not valid UTF-8; rename the file")
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
