"""OpenAI's error object and the HTTP status of each kind of refusal.

    raise APIError(400, "top_p must be in (0, 1], got 1.5.", param="top_p")
    -> 400 {"error": {"message": "top_p must be in (0, 1], got 1.5.", "type": "invalid_request_error",
                      "param": "top_p", "code": null}}

The messages are the library's own (`SamplingParams`, the input processor) and the
gRPC service's (admission, draining), word for word: only the status differs by
protocol. Nothing a client sends may become a 500: every refusal is one of the
statuses below, and an engine failure is a 500 with a one-line message, no
traceback.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

# OpenAI's `type` per status (the `openai` SDK maps the status to its exception class:
# BadRequestError, AuthenticationError, NotFoundError, RateLimitError, InternalServerError).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """A refusal with its HTTP status, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = " ".join(str(message).split())  # one line
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


_LEADING_NAME = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)")


def bad_request(err: Exception, fields: Iterable[str] = ()) -> APIError:
    """A library ValueError as a 400, with ``param`` set when its message starts with a request field's name.

    The library's messages name the field first (``top_p must be in (0, 1], got 1.5.``).
    """
    message = str(err)
    m = _LEADING_NAME.match(message)
    param = m.group(1) if m and m.group(1) in set(fields) else None
    if param is None:
        param = next((field for start, field in _MESSAGE_FIELDS if message.startswith(start)), None)
    return APIError(400, message, param=param)


# The library's messages that do not start with their field's name (vLLM's wording), and the field.
_MESSAGE_FIELDS = (
    ("Requested logprobs", "logprobs"),
    ("This model's maximum context length", "max_tokens"),
    ("each stop string", "stop"),
    ("the prompt is", "prompt"),
    ("the conversation", "messages"),
)


def unsupported(field: str, why: str) -> APIError:
    """A known field whose value this server does not support yet: a 400 naming it (never silently dropped)."""
    return APIError(400, f"{field} {why}", param=field.split(".")[0].split("[")[0])
