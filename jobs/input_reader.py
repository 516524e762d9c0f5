"""Job input: a Parquet file, a folder or glob of them, or OpenAI Batch JSONL, streamed row by row.

`open_input` resolves the files and checks them *before* any model is loaded: Parquet schemas come
from the file footers (no data read), JSONL files get one streaming validation pass (OpenAI checks
a batch file up front too). A missing or mistyped column, or one naming a sampling setting a row
cannot take (`n`, `logprobs`: never silently ignored), stops the job with the file and the column.
Problems of one *row* (null or empty prompt, both `prompt` and `messages`, bad parameter value) do
not: the row comes out of `iter_rows` with `error` set and the job writes it as an error row.

Memory: `iter_rows` holds one record batch (`batch_rows` rows) at a time, never a whole file.
Row ids: the `id` column (Parquet) or `custom_id` (JSONL); without them, `<file>:<row index>`
with the file relative to the input root, so re-running the same command derives the same ids. A
file with ids needs one in every row: a null never falls back to a derived id (another row's id).
OpenAI Batch request lines are checked and parsed in jobs/openai_requests.py.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Iterator

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from cluster.openai_body import loads_strict
from cluster.openai_requests import MAX_TOKEN_LIST
from eagle_worker.engine_api import normalize_messages as engine_messages
from jobs.id_set import IdSet
from jobs.input_files import MIXED, InputError, file_identity, kind_of, label_of, resolve_files
from jobs.output_writer import BASE_SCHEMA
from jobs.parquet_footer import check_chunks, ids_fit_int64, no_null_ids, rows_text
from jobs.storage import StorageError, is_uri

__all__ = ["InputError", "InputPlan", "Row", "iter_rows", "open_input"]

# per-row SamplingParams columns (eagle_worker/sampling_params.py checks their values on the replica: a bad
# one is an error row naming it, as the flags' own fields are)
OVERRIDES = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "min_p", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "stop_token_ids", "logit_bias", "ignore_eos",
             "include_stop_str_in_output", "min_tokens", "allowed_token_ids", "bad_words", "structured_outputs",
             "truncate_prompt_tokens")
# sampling settings a Parquet row cannot take: refused up front by name, never read and silently ignored
NOT_PER_ROW = {"n": "one completion per row", "best_of": "one completion per row",
               "logprobs": "the Parquet output has no logprobs; OpenAI Batch JSONL input returns them",
               "top_logprobs": "the Parquet output has no logprobs; OpenAI Batch JSONL input returns them",
               "prompt_logprobs": "the Parquet output has no logprobs",
               "max_completion_tokens": "the per-row column is `max_tokens`",
               "use_beam_search": "the engine has no beam search",
               "length_penalty": "the engine has no beam search"}
_READ = ("id", "prompt", "messages", *OVERRIDES)                 # the columns a Parquet job reads
OUTPUT_COLUMNS = tuple(BASE_SCHEMA.names)
CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"


@dataclass
class Row:
    id: str | int                                # the input's type (one type per job)
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    params: dict = field(default_factory=dict)   # per-row overrides that were set
    extra: dict = field(default_factory=dict)    # carried-through input columns (--keep-columns)
    error: str | None = None                     # a bad row: becomes an error row, not a request
    error_param: str | None = None               # the request field the error is about (OpenAI `param`)
    chat: bool = False                           # OpenAI output: chat.completion vs text_completion
    model: str | None = None                     # OpenAI body.model, echoed back
    attempts: int = 0                            # sends lost to a dying replica so far
    free_losses: int = 0                         # sends lost with a node taken away or to an unreachable
                                                 # replica (death_cause.free_loss; free up to FREE_NODE_LOSSES)
    strict_max_tokens: bool = False              # OpenAI request: prompt + max_tokens over the context is a 400
    format_field: str = "structured_outputs"     # the field the row asked for a format with (error rows name it)


@dataclass
class InputFile:
    path: str                                   # inside the plan's filesystem
    label: str                                  # relative to the input root (derived ids)
    num_rows: int
    display: str = ""                           # what messages call it (a local path or a URI)


@dataclass
class InputPlan:
    kind: str                                   # "parquet" | "jsonl"
    files: list[InputFile]
    kept: pa.Schema | None = None               # output schema of carried columns
    kept_names: dict[str, str] = field(default_factory=dict)   # input column -> output column
    fs: pafs.FileSystem | None = None
    id_type: pa.DataType = field(default_factory=pa.string)
    id_source: str = ""                         # the file that set id_type (for the mixed-types message)
    identity: dict = field(default_factory=dict)   # {"id_type", "files": [[path, size, digest]]} (resume check)
    unreadable: list[dict] = field(default_factory=list)   # row groups skipped at run time, ids unknown

    @property
    def total_rows(self) -> int:
        return sum(f.num_rows for f in self.files)


# ---- resolving and checking ---------------------------------------------------------------------
def open_input(spec: str, keep_columns: bool = False, exclude: str | None = None) -> InputPlan:
    from jobs.openai_requests import check_jsonl as _check_jsonl  # (it builds on this module's Row)

    fs, files, root = resolve_files(spec, exclude)
    kinds = {kind_of(p) for p in files}
    if len(kinds) > 1:
        raise InputError(f"{spec}: {MIXED}")
    kind = kinds.pop()
    plan = InputPlan(kind=kind, files=[], fs=fs)
    seen_ids = IdSet() if kind == "jsonl" else None
    scheme = spec.split("://", 1)[0] + "://" if is_uri(spec) else ""
    identities = []
    for path in files:
        f = InputFile(path, label_of(path, root), 0, scheme + path)
        f.num_rows = _check_parquet(f, plan, keep_columns) if kind == "parquet" else _check_jsonl(f, plan, seen_ids)
        identities.append(file_identity(fs, path, f.display))
        plan.files.append(f)
    plan.identity = {"id_type": str(plan.id_type), "files": identities}
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


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_floating(t) or pa.types.is_integer(t)


_EXPECTED = {  # column -> (check, expected type in words)
    "prompt": (_is_str, "string"),
    "messages": (_is_messages, "list<struct<role: string, content: string>>"),
    "id": (lambda t: _is_str(t) or pa.types.is_integer(t), "string or integer"),
    "max_tokens": (pa.types.is_integer, "integer"),
    "top_k": (pa.types.is_integer, "integer"),
    "min_tokens": (pa.types.is_integer, "integer"),
    "truncate_prompt_tokens": (pa.types.is_integer, "integer"),
    "seed": (pa.types.is_integer, "integer"),
    **{c: (_is_number, "float") for c in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                          "repetition_penalty")},
    "stop": (lambda t: _is_str(t) or (_is_list(t) and _is_str(t.value_type)), "string or list<string>"),
    "stop_token_ids": (lambda t: _is_list(t) and pa.types.is_integer(t.value_type), "list<integer>"),
    "allowed_token_ids": (lambda t: _is_list(t) and pa.types.is_integer(t.value_type), "list<integer>"),
    "bad_words": (lambda t: _is_list(t) and _is_str(t.value_type), "list<string>"),
    "logit_bias": (lambda t: pa.types.is_map(t) and pa.types.is_integer(t.key_type) and _is_number(t.item_type),
                   "map<integer, float> (token id -> bias)"),
    "ignore_eos": (pa.types.is_boolean, "bool"),
    "include_stop_str_in_output": (pa.types.is_boolean, "bool"),
    "structured_outputs": (_is_str, "string (a JSON object: vLLM's structured_outputs)"),
}


def _check_parquet(f: InputFile, plan: InputPlan, keep_columns: bool) -> int:
    path = f.display
    try:
        with plan.fs.open_input_file(f.path) as fh:
            meta = pq.read_metadata(fh)
        schema = meta.schema.to_arrow_schema()
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{path}: not a readable Parquet file ({e})") from None
    check_chunks(path, meta, plan.fs.get_file_info(f.path).size)
    names = schema.names
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:       # which of the two would a row's prompt (or id) be?
        raise InputError(f"{path}: column name(s) {', '.join(f'`{n}`' for n in twice)} appear more than once; "
                         "a Parquet job needs each column once")
    if "prompt" not in names and "messages" not in names:
        raise InputError(f"{path}: needs a `prompt` column (string) or a `messages` column "
                         f"(list<struct<role: string, content: string>>); its columns are: {', '.join(names) or 'none'}")
    for col, (ok, expected) in _EXPECTED.items():
        if col in names:
            t = schema.field(col).type
            if not (ok(t) or pa.types.is_null(t)):
                raise InputError(f"{path}: column `{col}` has type {t}; expected {expected}")
    for col in names:
        if col in NOT_PER_ROW:
            raise InputError(f"{path}: column `{col}` is not a per-row setting of a Parquet job ({NOT_PER_ROW[col]}); "
                             "drop or rename it (other columns are not read, or carried with --keep-columns)")
        meant = None if keep_columns else _near_miss(col)
        if meant:
            raise InputError(f"{path}: column `{col}` is not read; did you mean `{meant}`? Rename it, or pass "
                             "--keep-columns to carry it into the output as data")
    _set_id_type(plan, path, schema.field("id").type if "id" in names else None, meta.num_rows)
    if _has_ids(schema):
        no_null_ids(f, plan.fs, meta, "integer" if pa.types.is_integer(schema.field("id").type) else "string")
        if pa.types.is_uint64(schema.field("id").type):
            ids_fit_int64(f, plan.fs, meta)
    if keep_columns:
        kept = pa.schema([schema.field(n) for n in names if n != "id"])
        if plan.kept is None:
            plan.kept_names = _kept_names(path, kept.names)
            plan.kept = pa.schema([pa.field(plan.kept_names[f.name], f.type) for f in kept])
        elif kept.names != list(plan.kept_names) or [f.type for f in kept] != list(plan.kept.types):
            raise InputError(f"{path}: --keep-columns needs every input file to have the same columns and types; "
                             f"this file has {kept}, the first had {plan.kept}")
    return meta.num_rows


def _kept_names(path: str, names: list[str]) -> dict[str, str]:
    """Input column -> its output column (`input_<name>` where the output has a column of that name, and
    no output column is named `input_*`), refused up front where two kept columns would share a name
    (`text` carried as `input_text` beside an `input_text`): duplicate names make the output unreadable."""
    owner: dict[str, str] = {}      # output column -> the input column in it
    for n in names:
        out = f"input_{n}" if n in OUTPUT_COLUMNS else n
        if out in owner:
            renamed = owner[out] if n == out else n
            raise InputError(f"{path}: --keep-columns would carry columns `{owner[out]}` and `{n}` both as `{out}` "
                             f"(`{renamed}` is renamed: the output has its own `{renamed}`); rename one of them")
        owner[out] = n
    return {n: out for out, n in owner.items()}


def _near_miss(col: str) -> str | None:
    """The column a name that no job reads was likely meant to be (`temprature`, `Max-Tokens`,
    `message`): a typo of a setting would otherwise be dropped without a word."""
    if col in _READ:
        return None
    key = col.lower().replace("-", "_")
    if key in _READ:
        return key
    close = difflib.get_close_matches(key, _READ, n=1, cutoff=0.85)
    return close[0] if close else None


def _set_id_type(plan: InputPlan, path: str, t: pa.DataType | None, num_rows: int) -> None:
    """One id type per job: integers stay integers in the output, and 1 and "1" never collide."""
    if t is None or pa.types.is_null(t):
        t, what = pa.string(), "derived string ids (`<file>:<row>`, no `id` column)"
    elif pa.types.is_integer(t):
        t, what = pa.int64(), f"integer ids ({t})"
    else:
        t, what = pa.string(), f"string ids ({t})"
    if num_rows == 0:
        return
    if not plan.id_source:
        plan.id_type, plan.id_source = t, f"{path} has {what}"
    elif t != plan.id_type:
        raise InputError(f"{path} has {what} but {plan.id_source}; ids must have one type across the input "
                         "(cast the `id` column, or give every file one)")


def _has_ids(schema: pa.Schema) -> bool:
    """Whether the file's rows have their own ids (an `id` column of nulls only is no ids: derived ones)."""
    return "id" in schema.names and not pa.types.is_null(schema.field("id").type)


# ---- streaming rows -------------------------------------------------------------------------------
def iter_rows(plan: InputPlan, batch_rows: int = 256) -> Iterator[Row]:
    from jobs.openai_requests import jsonl_rows  # (it builds on this module's Row)

    for f in plan.files:
        yield from (_parquet_rows(f, plan, batch_rows) if plan.kind == "parquet" else jsonl_rows(f, plan))


def _parquet_rows(f: InputFile, plan: InputPlan, batch_rows: int) -> Iterator[Row]:
    """The file's rows, one row group at a time. A row group that cannot be read or decoded (corrupt
    pages behind an intact footer) does not stop the job: its rows that were not yielded become error
    rows naming the file and row group, or, when their ids cannot be read either, are skipped and
    listed in `plan.unreadable` (the job then ends as completed with errors)."""
    try:
        handle = plan.fs.open_input_file(f.path)
        pf = pq.ParquetFile(handle, page_checksum_verification=True)
    except Exception as e:   # gone or changed since the check
        yield from _unreadable(f, plan, None, -1, 0, f.num_rows, e)
        return
    try:
        yield from _row_groups(f, plan, pf, batch_rows)
    finally:
        handle.close()       # one open file at a time, however many files the input has


def _row_groups(f: InputFile, plan: InputPlan, pf: pq.ParquetFile, batch_rows: int) -> Iterator[Row]:
    wanted = ("id", "prompt", "messages") + OVERRIDES
    columns = [c for c in pf.schema_arrow.names if c in wanted or plan.kept is not None]
    derive = not _has_ids(pf.schema_arrow)
    offset = 0
    for rg in range(pf.metadata.num_row_groups):
        size, done = pf.metadata.row_group(rg).num_rows, 0
        batches = pf.iter_batches(batch_size=batch_rows, row_groups=[rg], columns=columns)
        while True:
            try:
                batch = next(batches, None)
                if batch is None:
                    break
                cols = batch.to_pydict()
                rows, no_id = [], []
                for i in range(batch.num_rows):
                    rec = {k: v[i] for k, v in cols.items()}
                    if not derive and rec.get("id") is None:    # a null the footer statistics did not show
                        no_id.append(offset + done + i)
                    else:
                        rows.append(_parquet_row(rec, f"{f.label}:{offset + done + i}" if derive else None, plan))
            except Exception as e:
                yield from _unreadable(f, plan, pf, rg, offset + done, offset + size, e)
                break
            del cols
            if no_id:
                _null_ids(f, plan, rg, no_id)
            yield from rows
            done += batch.num_rows
        offset += size


# What the object store's own client says when a request failed on the way (not the data's decoder)
_TRANSPORT = ("AWS Error", "curlCode", "google::cloud", "UNAVAILABLE", "DEADLINE_EXCEEDED")


def _store_failed(f: InputFile, plan: InputPlan, err: Exception) -> bool:
    """A bucket read that failed on the way (the store's client says so, or the object's own listing
    fails too), not because the data is bad. Such rows are not the input's fault (no error rows):
    the job fails and a plain rerun goes on."""
    if isinstance(plan.fs, pafs.LocalFileSystem) or not isinstance(err, OSError):
        return False
    if any(marker in str(err) for marker in _TRANSPORT):
        return True
    try:
        plan.fs.get_file_info(f.path)
    except OSError:
        return True
    return False


def _unreadable(f: InputFile, plan: InputPlan, pf, rg: int, start: int, end: int, err: Exception) -> Iterator[Row]:
    where = f"{f.display}: " + (f"row group {rg}" if rg >= 0 else "the file")
    if _store_failed(f, plan, err):
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise StorageError(f"{where} cannot be read from the store ({first}); committed rows are kept: run the "
                           "same command again to go on")
    msg = f"{where} cannot be read ({type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''})"
    if not _has_ids(pf.schema_arrow if pf is not None else _schema(f, plan)):
        ids = [f"{f.label}:{i}" for i in range(start, end)]
    else:
        try:
            group_start = _group_offset(pf, rg)
            ids = pf.read_row_group(rg, columns=["id"]).column("id").to_pylist()[start - group_start:end - group_start]
        except Exception:
            ids = [None] * (end - start)
    nulls = sum(i is None for i in ids)
    if nulls:       # rows without a readable id cannot be written under one: skipped, listed in the manifest
        plan.unreadable.append({"file": f.display, "row_group": rg, "rows": nulls, "error": msg})
    yield from (Row(id=rid, error=msg) for rid in ids if rid is not None)


def _null_ids(f: InputFile, plan: InputPlan, rg: int, rows: list[int]) -> None:
    """Rows whose id is null (found at run time: the file has no statistics) cannot be written under an
    id, not even a derived one (another row's, maybe): they are skipped and listed as unreadable, one
    entry per row group; the other rows run."""
    last = plan.unreadable[-1] if plan.unreadable else {}
    if last.get("null_id_rows") is None or (last["file"], last["row_group"]) != (f.display, rg):
        last = {"file": f.display, "row_group": rg, "rows": 0, "error": "", "null_id_rows": []}
        plan.unreadable.append(last)
    last["rows"] += len(rows)
    last["null_id_rows"] = (last["null_id_rows"] + rows)[:5]
    last["error"] = (f"{f.display}: row group {rg}: a null `id` ({rows_text(last['null_id_rows'], last['rows'])}); "
                     "give every row an id")


def _group_offset(pf, rg: int) -> int:
    return sum(pf.metadata.row_group(i).num_rows for i in range(rg))


def _schema(f: InputFile, plan: InputPlan) -> pa.Schema:
    try:
        with plan.fs.open_input_file(f.path) as fh:
            return pq.read_schema(fh)
    except Exception:
        return pa.schema([("id", pa.string())])     # unknown: treat the ids as unknown


def _parquet_row(rec: dict, derived_id: str | None, plan: InputPlan) -> Row:
    """One input row; `derived_id` None: the file has ids (not null: `_row_groups` took those out)."""
    row = Row(id=rec["id"] if derived_id is None else derived_id)
    if plan.kept is not None:
        row.extra = {plan.kept_names[k]: rec.get(k) for k in plan.kept_names}
    row.params = {k: rec[k] for k in OVERRIDES if rec.get(k) is not None}
    if "logit_bias" in row.params:     # a Parquet map reads as [(key, value), ...]
        bias = row.params["logit_bias"]
        row.params["logit_bias"] = dict(bias)
        if len(row.params["logit_bias"]) < len(bias):
            row.error, row.error_param = "logit_bias: a token id appears more than once", "logit_bias"
            return row
    if "structured_outputs" in row.params:     # JSON text: {"json": {...}}, {"regex": "..."}, {"choice": [...]}, ...
        try:
            spec = loads_strict(row.params["structured_outputs"])
        except ValueError as e:
            spec, why = None, f"not valid JSON ({e})"
        except RecursionError:
            spec, why = None, "nested too deeply"
        else:
            why = f"must be a JSON object, got {type(spec).__name__}"
        if not isinstance(spec, dict):
            row.error, row.error_param = f"structured_outputs: {why}", "structured_outputs"
            return row
        row.params["structured_outputs"] = spec
    for name in ("logit_bias", "stop_token_ids", "allowed_token_ids", "bad_words"):   # the server's cap, for the same reason
        if len(row.params.get(name) or ()) > MAX_TOKEN_LIST:
            what = "words" if name == "bad_words" else "token ids"
            row.error = f"{name}: at most {MAX_TOKEN_LIST} {what} per row, got {len(row.params[name])}"
            row.error_param = name
            return row
    prompt, messages = rec.get("prompt"), rec.get("messages")
    if prompt is not None and messages is not None:
        row.error = "both `prompt` and `messages` are set; give a row one of them"
    elif prompt is not None:
        row.prompt = prompt
        if not prompt:                      # whitespace is a prompt (the engine's and OpenAI's rule)
            row.error = "prompt is empty"
    elif messages is not None:
        row.messages, row.error = normalize_messages(messages)
        row.chat = True
    else:
        row.error = "prompt is null" if "prompt" in rec else "messages is null"
    return row


def normalize_messages(msgs) -> tuple[list[dict] | None, str | None]:
    """Messages with plain string content (the engine's rule: OpenAI text parts joined), or an error."""
    try:
        return engine_messages(msgs), None
    except ValueError as e:
        return None, str(e)
