"""OpenAI Batch input: request lines checked up front (as OpenAI checks a batch file), then turned into rows.

What a request may hold: `custom_id`, `url` (`/v1/chat/completions` or `/v1/completions`), `body`
with `messages` or `prompt` and the sampling fields below. A body field the job does not honour is
an error row naming it (never silently ignored); `logprobs` become SamplingParams.logprobs, and
the row asks the replica to refuse prompt + max_tokens beyond the context, as OpenAI does.
"""
from __future__ import annotations

import io
import json
from typing import Iterator

from jobs.id_set import IdSet
from jobs.input_files import InputError
from jobs.input_reader import CHAT_URL, COMPLETIONS_URL, OVERRIDES, InputFile, InputPlan, Row, normalize_messages


def check_jsonl(f: InputFile, plan: InputPlan, seen: IdSet) -> int:
    n, path = 0, f.display
    try:
        with io.TextIOWrapper(plan.fs.open_input_stream(f.path), encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
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
        raise InputError(f"{path}: cannot read ({e.strerror or str(e).splitlines()[0]})") from None
    return n


def jsonl_rows(f: InputFile, plan: InputPlan) -> Iterator[Row]:
    with io.TextIOWrapper(plan.fs.open_input_stream(f.path), encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield openai_row(json.loads(line))


# OpenAI request body fields a batch job honours, and the ones it accepts without effect on the output
_BODY_FIELDS = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "n", "logprobs", "top_logprobs",
                "presence_penalty", "frequency_penalty"} | set(OVERRIDES)
_BODY_NO_EFFECT = {"user", "metadata", "store", "stream"}
MAX_LOGPROBS = 20


def openai_row(rec: dict) -> Row:
    body = rec["body"]
    row = Row(id=rec["custom_id"], model=body.get("model"), strict_max_tokens=True)
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    params = {"max_tokens": mt, **{k: body.get(k) for k in OVERRIDES if k != "max_tokens"},
              **{k: body.get(k) for k in ("presence_penalty", "frequency_penalty")}}
    row.params = {k: v for k, v in params.items() if v is not None}
    unknown = sorted(k for k in body if k not in _BODY_FIELDS | _BODY_NO_EFFECT)
    if unknown or body.get("stream"):
        name = unknown[0] if unknown else "stream"
        row.error, row.error_param = f"`{name}` is not supported in batch jobs", name
        return row
    if body.get("n", 1) != 1:
        row.error, row.error_param = "n must be 1 in batch jobs (one completion per request)", "n"
        return row
    row.error, row.error_param, lp = _logprobs(body, "messages" in body)
    if row.error:
        return row
    if lp is not None:
        row.params["logprobs"] = lp
    if "messages" in body:
        row.chat = True
        row.messages, row.error = normalize_messages(body["messages"])
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
    if row.error:
        row.error_param = "messages" if row.chat else "prompt"
    return row


def _logprobs(body: dict, chat: bool) -> tuple[str | None, str | None, int | None]:
    """(error, param, top-k for SamplingParams.logprobs) from OpenAI's chat (`logprobs: bool` +
    `top_logprobs`) or completions (`logprobs: int`) fields."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if lp is not None and not isinstance(lp, bool):
            return "logprobs must be a boolean in chat completions", "logprobs", None
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_LOGPROBS):
            return f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}", "top_logprobs", None
        if top and not lp:
            return "top_logprobs: needs logprobs set to true", "top_logprobs", None
        return None, None, (top or 0) if lp else None
    if top is not None:
        return "top_logprobs is a chat completions field; completions take `logprobs: <int>`", "top_logprobs", None
    if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= MAX_LOGPROBS):
        return f"logprobs must be an integer from 0 to {MAX_LOGPROBS} in completions", "logprobs", None
    return None, None, lp
