"""Reading a request body: the size cap, the arrival deadline, JSON only (an APIError otherwise)."""
from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import ClientDisconnect

from cluster.metrics import CLIENT_CLOSED
from cluster.openai_errors import APIError
from eagle_worker.engine_api import loads_strict


async def read_json_object(request, max_bytes: int, timeout_s: float = 30.0) -> dict[str, Any]:
    """The request body as a JSON object, or the APIError to answer: 415 for a body that says it
    is not JSON or is compressed, 413 over `max_bytes` (checked on Content-Length, then while reading, so an
    oversized body is never held whole), 408 when it has not all arrived within `timeout_s`, 400
    for bad or too deeply nested JSON, a non-object or a key given twice in one object (one value
    would be dropped unseen)."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        raise APIError(415, f"Content-Type must be application/json, got {media!r}", code="unsupported_media_type")
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise APIError(415, f"Content-Encoding {encoding!r} is not supported; send the JSON body uncompressed",
                       code="unsupported_media_type")
    too_large = APIError(413, f"request body is larger than this server's limit of {max_bytes} bytes",
                         code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks = []

    async def read() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s",
                       code="request_timeout") from None
    except ClientDisconnect:   # hung up mid-body: nobody to answer, and not the server's error
        raise APIError(CLIENT_CLOSED, "client closed the request", code="client_closed") from None
    try:
        body = loads_strict(b"".join(chunks))
    except RecursionError:
        raise APIError(400, "request body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body
