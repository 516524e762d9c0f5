"""Job input: a Parquet file, a folder or glob of them, or OpenAI Batch JSONL, streamed row by row.

`open_input` resolves the files and checks them *before* any model is loaded: Parquet schemas come
from the file footers (no data read), JSONL files get one streaming validation pass (OpenAI checks
a batch file up front too). A missing or mistyped column stops the job with the file, the column
and the expected type. Problems of one *row* (null or empty prompt, bad parameter value) do not:
the row comes out of `iter_rows` with `error` set and the job writes it as an error row.

Memory: `iter_rows` holds one record batch (`batch_rows` rows) at a time, never a whole file.
Row ids: the `id` column (Parquet) or `custom_id` (JSONL); without them, `<file>:<row index>`
with the file relative to the input root, so re-running the same command derives the same ids.
"""
from __future__ import annotations

import glob
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.id_set import IdSet
from jobs.job_config import JSONL_SUFFIXES, glob_base

OVERRIDES = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
OUTPUT_COLUMNS = ("id", "text", "finish_reason", "prompt_tokens", "completion_tokens",
                  "accepted_tokens_per_step", "latency_s", "error")
CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"


class InputError(ValueError):
    """The input cannot be used (missing, unreadable, wrong schema); nothing was generated."""


@dataclass
class Row:
    id: str
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    params: dict = field(default_factory=dict)   # per-row overrides that were set
    extra: dict = field(default_factory=dict)    # carried-through input columns (--keep-columns)
    error: str | None = None                     # a bad row: becomes an error row, not a request
    chat: bool = False                           # OpenAI output: chat.completion vs text_completion
    model: str | None = None                     # OpenAI body.model, echoed back
    attempts: int = 0                            # sends lost to a dying replica so far


@dataclass
class InputFile:
    path: Path
    label: str
    num_rows: int


@dataclass
class InputPlan:
    kind: str                                   # "parquet" | "jsonl"
    files: list[InputFile]
    kept: pa.Schema | None = None               # output schema of carried columns
    kept_names: dict[str, str] = field(default_factory=dict)   # input column -> output column

    @property
    def total_rows(self) -> int:
        return sum(f.num_rows for f in self.files)


# ---- resolving and checking ---------------------------------------------------------------------
def resolve_files(spec: str, exclude: str | None = None) -> tuple[list[Path], Path]:
    """(files, root) for a file, a folder (its *.parquet, else *.jsonl) or a glob."""
    ex = Path(exclude).resolve() if exclude else None

    def keep(p: Path) -> bool:
        hidden = any(part.startswith((".", "_")) for part in p.parts[-1:])
        return p.is_file() and not hidden and not (ex and (p.resolve() == ex or ex in p.resolve().parents))

    if glob.has_magic(spec):
        root = glob_base(spec)
        files = sorted(Path(p) for p in glob.glob(spec, recursive=True) if keep(Path(p)))
        if not files:
            raise InputError(f"{spec}: the pattern matches no files")
    elif Path(spec).is_dir():
        root = Path(spec)
        files = []
        for suffixes in ((".parquet",), JSONL_SUFFIXES):
            files = sorted(p for p in root.rglob("*") if p.suffix.lower() in suffixes and keep(p)
                           and not any(part.startswith((".", "_")) for part in p.relative_to(root).parts))
            if files:
                break
        if not files:
            raise InputError(f"{spec}: the folder holds no .parquet or .jsonl files")
    elif Path(spec).is_file():
        root, files = Path(spec).parent, [Path(spec)]
    else:
        raise InputError(f"{spec}: no such file or folder")
    kinds = {_kind(p) for p in files}
    if len(kinds) > 1:
        raise InputError(f"{spec}: mixes Parquet and JSONL files; use one format per job")
    return files, root


def _kind(p: Path) -> str:
    return "jsonl" if p.name.lower().endswith(JSONL_SUFFIXES) else "parquet"


def open_input(spec: str, keep_columns: bool = False, exclude: str | None = None) -> InputPlan:
    files, root = resolve_files(spec, exclude)
    kind = _kind(files[0])
    plan = InputPlan(kind=kind, files=[])
    seen_ids = IdSet() if kind == "jsonl" else None
    for path in files:
        label = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.name
        if kind == "parquet":
            n = _check_parquet(path, plan, keep_columns)
        else:
            n = _check_jsonl(path, seen_ids)
        plan.files.append(InputFile(path, label, n))
    return plan


def _is_str(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", lambda _: False)(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _is_messages(t: pa.DataType) -> bool:
    if not _is_list(t) or not pa.types.is_struct(t.value_type):
        return False
    names = {f.name: f.type for f in t.value_type}
    return "role" in names and "content" in names and _is_str(names["role"]) and (
        _is_str(names["content"]) or pa.types.is_null(names["content"]))


_EXPECTED = {  # column -> (check, expected type in words)
    "prompt": (_is_str, "string"),
    "messages": (_is_messages, "list<struct<role: string, content: string>>"),
    "id": (lambda t: _is_str(t) or pa.types.is_integer(t), "string or integer"),
    "max_tokens": (pa.types.is_integer, "integer"),
    "top_k": (pa.types.is_integer, "integer"),
    "seed": (pa.types.is_integer, "integer"),
    "temperature": (lambda t: pa.types.is_floating(t) or pa.types.is_integer(t), "float"),
    "top_p": (lambda t: pa.types.is_floating(t) or pa.types.is_integer(t), "float"),
    "stop": (lambda t: _is_str(t) or (_is_list(t) and _is_str(t.value_type)), "string or list<string>"),
}


def _check_parquet(path: Path, plan: InputPlan, keep_columns: bool) -> int:
    try:
        meta = pq.read_metadata(path)
        schema = meta.schema.to_arrow_schema()
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{path}: not a readable Parquet file ({e})") from None
    names = schema.names
    if "prompt" not in names and "messages" not in names:
        raise InputError(f"{path}: needs a `prompt` column (string) or a `messages` column "
                         f"(list<struct<role: string, content: string>>); its columns are: {', '.join(names) or 'none'}")
    for col, (ok, expected) in _EXPECTED.items():
        if col in names:
            t = schema.field(col).type
            if not (ok(t) or pa.types.is_null(t)):
                raise InputError(f"{path}: column `{col}` has type {t}; expected {expected}")
    if keep_columns:
        kept = pa.schema([schema.field(n) for n in names if n != "id"])
        if plan.kept is None:
            plan.kept_names = {n: (f"input_{n}" if n in OUTPUT_COLUMNS else n) for n in kept.names}
            plan.kept = pa.schema([pa.field(plan.kept_names[f.name], f.type) for f in kept])
        elif kept.names != list(plan.kept_names) or [f.type for f in kept] != list(plan.kept.types):
            raise InputError(f"{path}: --keep-columns needs every input file to have the same columns and types; "
                             f"this file has {kept}, the first had {plan.kept}")
    return meta.num_rows


def _check_jsonl(path: Path, seen: IdSet) -> int:
    n = 0
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}: line {lineno}"
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(f"{where}: not valid JSON ({e.msg})") from None
                if not isinstance(rec, dict):
                    raise InputError(f"{where}: expected a JSON object (OpenAI Batch request)")
                cid = rec.get("custom_id")
                if not isinstance(cid, str) or not cid:
                    raise InputError(f"{where}: `custom_id` must be a non-empty string")
                body = rec.get("body")
                if not isinstance(body, dict) or ("messages" not in body and "prompt" not in body):
                    raise InputError(f"{where}: `body` must be an object with `messages` or `prompt`")
                url = rec.get("url", CHAT_URL if "messages" in body else COMPLETIONS_URL)
                if url not in (CHAT_URL, COMPLETIONS_URL):
                    raise InputError(f"{where}: `url` {url!r} is not supported; use {CHAT_URL} or {COMPLETIONS_URL}")
                if not seen.add(cid):
                    raise InputError(f"{where}: duplicate custom_id {cid!r}; custom_id must be unique in a batch")
                n += 1
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    return n


# ---- streaming rows -------------------------------------------------------------------------------
def iter_rows(plan: InputPlan, batch_rows: int = 256) -> Iterator[Row]:
    for f in plan.files:
        yield from (_parquet_rows(f, plan, batch_rows) if plan.kind == "parquet" else _jsonl_rows(f))


def _parquet_rows(f: InputFile, plan: InputPlan, batch_rows: int) -> Iterator[Row]:
    pf = pq.ParquetFile(f.path)
    wanted = ("id", "prompt", "messages") + OVERRIDES
    columns = [c for c in pf.schema_arrow.names if c in wanted or plan.kept is not None]
    index = 0
    for batch in pf.iter_batches(batch_size=batch_rows, columns=columns):
        cols = batch.to_pydict()
        for i in range(batch.num_rows):
            rec = {k: v[i] for k, v in cols.items()}
            yield _parquet_row(rec, f"{f.label}:{index}", plan)
            index += 1
        del cols


def _parquet_row(rec: dict, derived_id: str, plan: InputPlan) -> Row:
    rid = rec.get("id")
    row = Row(id=derived_id if rid is None else str(rid))
    if plan.kept is not None:
        row.extra = {plan.kept_names[k]: rec.get(k) for k in plan.kept_names}
    row.params = {k: rec[k] for k in OVERRIDES if rec.get(k) is not None}
    prompt, messages = rec.get("prompt"), rec.get("messages")
    if prompt is not None:
        row.prompt = prompt
        if not prompt.strip():
            row.error = "prompt is empty"
    elif messages is not None:
        row.messages, row.error = _normalize_messages(messages)
        row.chat = True
    else:
        row.error = "prompt is null" if "prompt" in rec else "messages is null"
    return row


def _normalize_messages(msgs) -> tuple[list[dict] | None, str | None]:
    """Messages with plain string content (OpenAI text parts are joined), or an error."""
    if not isinstance(msgs, list) or not msgs:
        return None, "messages must be a non-empty list"
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return None, f"messages[{i}] must be an object with a string `role` and `content`"
        content = m.get("content")
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                return None, f"messages[{i}].content: only text parts are supported"
            content = "".join(str(p.get("text", "")) for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            return None, f"messages[{i}].content must be a string or a list of text parts"
        out.append({"role": m["role"], "content": content})
    return out, None


def _jsonl_rows(f: InputFile) -> Iterator[Row]:
    with open(f.path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield _openai_row(json.loads(line))


def _openai_row(rec: dict) -> Row:
    body = rec["body"]
    row = Row(id=rec["custom_id"], model=body.get("model"))
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    params = {"max_tokens": mt, **{k: body.get(k) for k in OVERRIDES if k != "max_tokens"}}
    row.params = {k: v for k, v in params.items() if v is not None}
    if body.get("n", 1) != 1:
        row.error = "n must be 1 in batch jobs (one completion per request)"
    elif "messages" in body:
        row.chat = True
        row.messages, row.error = _normalize_messages(body["messages"])
    else:
        p = body["prompt"]
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str):
            row.prompt = p
            row.error = None if p.strip() else "prompt is empty"
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            row.prompt = p
        else:
            row.error = "prompt must be a non-empty string or list of token ids (one prompt per request)"
    return row
