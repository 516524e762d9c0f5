"""OpenAI Batch input: request lines checked up front (as OpenAI checks a batch file), then turned into rows.

What a request may hold: `custom_id`, `url` (`/v1/chat/completions` or `/v1/completions`), `body`
with `messages` or `prompt` and any field the HTTP server takes, checked by the same request models;
a body the server would refuse, or a field a batch row cannot honour (`_BATCH_ONLY`), is an error
row naming it (never silently ignored). The row asks the replica to refuse prompt + max_tokens
beyond the context, as OpenAI does.
"""
from __future__ import annotations

import io
import json
from typing import Iterator

from pydantic import ValidationError

from cluster.openai_body import loads_strict
from cluster.openai_errors import validation_error
from cluster.openai_requests import ChatCompletionRequest, CompletionRequest
from jobs.id_set import IdSet
from jobs.input_files import InputError
from jobs.input_reader import CHAT_URL, COMPLETIONS_URL, InputFile, InputPlan, Row
from jobs.job_config import encodable


def _lines(f: InputFile, plan: InputPlan) -> io.TextIOWrapper:
    """The file's lines: a UTF-8 BOM skipped, and split at "\\n" only (JSONL's rule; a lone "\\r" between
    tokens is whitespace, not a line break, as in the HTTP server's JSON)."""
    return io.TextIOWrapper(plan.fs.open_input_stream(f.path), encoding="utf-8-sig", newline="\n")


_LINE_FIELDS = {"custom_id", "method", "url", "body"}    # an OpenAI Batch request line's fields


def check_jsonl(f: InputFile, plan: InputPlan, seen: IdSet) -> int:
    n, path = 0, f.display
    try:
        with _lines(f, plan) as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{path}: line {lineno}"
                rec = _parse(line, where)
                if not isinstance(rec, dict):
                    raise InputError(f"{where}: expected a JSON object (OpenAI Batch request)")
                cid = rec.get("custom_id")
                if not isinstance(cid, str) or not cid:
                    raise InputError(f"{where}: `custom_id` must be a non-empty string")
                if not encodable(cid):    # a lone surrogate (`"\\ud800"`): valid JSON, but no output could hold it
                    raise InputError(f"{where}: `custom_id` {ascii(cid)} is not valid Unicode text (a lone "
                                     "surrogate escape); give the request an id of UTF-8 text")
                unknown = sorted(set(rec) - _LINE_FIELDS)
                if unknown:
                    raise InputError(f"{where}: unsupported field(s) {', '.join(map(repr, unknown))}; a request line "
                                     f"has {', '.join(sorted(_LINE_FIELDS))}")
                if rec.get("method", "POST") != "POST":
                    raise InputError(f"{where}: `method` {rec['method']!r} is not supported; batch requests are POST")
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
        raise InputError(f"{path}: cannot read ({e.strerror or str(e).splitlines()[0]})") from None
    return n


def _parse(line: str, where: str):
    """A request line's JSON, or an InputError naming the line (exit 2), never a traceback."""
    try:
        return loads_strict(line)
    except json.JSONDecodeError as e:
        raise InputError(f"{where}: not valid JSON ({e.msg})") from None
    except ValueError as e:   # a key twice
        raise InputError(f"{where}: not valid JSON ({e})") from None
    except RecursionError:    # (also here when the run reads the line a few stack frames deeper than the check)
        raise InputError(f"{where}: JSON nested too deeply to read") from None


def jsonl_rows(f: InputFile, plan: InputPlan) -> Iterator[Row]:
    with _lines(f, plan) as fh:
        for lineno, line in enumerate(fh, 1):
            if line.strip():
                yield openai_row(_parse(line, f"{f.display}: line {lineno}"))


# What the HTTP server takes but a batch row cannot be: one completion per row, written whole,
# without the prompt's own logprobs (the output has no place for them), at offline priority.
# field -> (the one value a batch row may give it, the error otherwise)
_BATCH_ONLY = {"n": (1, "n must be 1 in batch jobs (one completion per request)"),
               "stream": (False, "`stream` is not supported in batch jobs"),
               "stream_options": (None, "`stream_options` is not supported in batch jobs"),
               "echo": (False, "`echo` is not supported in batch jobs"),
               "priority": (1, "priority must be 1 in batch jobs (their rows run at offline priority)")}
# request fields -> the SamplingParams they set, where the names differ
_PARAM_OF = {"max_completion_tokens": "max_tokens", "top_logprobs": "logprobs", "response_format": "structured_outputs"}


def openai_row(rec: dict) -> Row:
    """A request line as a row. Its body is checked by the HTTP server's own request models
    (cluster/openai_requests.py), so a batch refuses what the server refuses, with the same message; a
    body without `model` runs on the job's model (as vLLM's run_batch takes it)."""
    body = rec["body"]
    chat = rec.get("url", CHAT_URL if "messages" in body else COMPLETIONS_URL) == CHAT_URL
    row = Row(id=rec["custom_id"], chat=chat, strict_max_tokens=True)
    try:
        req = (ChatCompletionRequest if chat else CompletionRequest).model_validate({"model": "", **body})
        row.messages = req.template_messages() if chat else None
    except ValidationError as e:
        err = validation_error(e)
        row.error, row.error_param = err.message, err.param
        return row
    except ValueError as e:             # a message part that is not text
        row.error, row.error_param = f"messages: {e}", "messages"
        return row
    row.model = req.model or None
    row.format_field = req.structured_field
    if not chat and len(req.prompts) > 1:      # the server answers a batch of prompts; a row is one request
        row.error, row.error_param = "prompt: a batch line holds one prompt; give each prompt its own line", "prompt"
        return row
    given = req.model_fields_set
    refused = [f for f, (ok, _) in _BATCH_ONLY.items() if f in given and getattr(req, f) != ok]
    if refused:
        row.error, row.error_param = _BATCH_ONLY[refused[0]][1], refused[0]
        return row
    wanted = {_PARAM_OF.get(f, f) for f in given}
    params = req.sampling_params((req.requested_max_tokens if chat else req.max_tokens) or 1)
    row.params = {k: v for k, v in params.items() if k in wanted and v is not None}
    if "stop" in given and "stop" not in row.params:
        row.params["stop"] = []          # `stop: []`: no stop strings, not the job's (null: the job's)
    row.prompt = None if chat else req.prompts[0]
    return row
