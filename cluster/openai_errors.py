"""OpenAI's error body and the 4xx that name a bad field.

Requests are validated at the edge, so a bad body or field becomes a 4xx that names it before any
replica sees the request.
"""
from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ValidationError


def context_error(prompt_tokens: int, max_tokens: int, max_model_len: int) -> str:
    """OpenAI's 400 message for a request whose prompt plus max_tokens exceed the context."""
    return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion.")


def prompt_context_error(prompt_tokens: int, max_model_len: int) -> str:
    """vLLM's 400 message for a prompt that leaves no room for a generated token."""
    return (f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_tokens} input tokens. Please reduce the length of the input messages.")


def chars_context_error(chars: int, limit: int, max_model_len: int, field: str) -> str:
    """The same, for a prompt refused by its length in characters before tokenizing it."""
    return (f"This model's maximum context length is {max_model_len} tokens. However, your {field} ({chars} "
            f"characters) cannot fit in that many tokens (at most {limit} characters). Please reduce the length "
            "of the input messages.")


class APIError(Exception):
    """An error to send as `{"error": {...}}` with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        message, param = _printable(message), _printable(param)   # may quote a client's lone surrogates
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()


def _printable(text: str | None) -> str | None:
    """`text` as valid UTF-8 (lone surrogates escaped), so the error body can always be sent."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|(list|dict|tuple)\[.*\]|function-(after|before|wrap|plain)\[.*)$")


def validation_error(e: ValidationError) -> APIError:
    """A request model's first validation error as a 400 naming the field."""
    err = e.errors()[0]
    loc = [str(p) for p in err["loc"] if not _UNION_TAG.match(str(p))]   # ("prompt", "str") -> "prompt"
    param = ".".join(loc) or None
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "is not supported by this server (unknown field)"
    elif param is None and ":" in msg and msg.split(":")[0].isidentifier():  # a model-level check names its field
        param, msg = msg.split(":")[0], msg.split(":", 1)[1].strip()
    more = f" (and {len(e.errors()) - 1} more errors)" if len(e.errors()) > 1 else ""
    return APIError(400, f"{param}: {msg}{more}" if param else msg + more, param=param)
