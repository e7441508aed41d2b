"""The one error shape of every omni HTTP route, and the exceptions that produce it.

Every refusal answers ``{"error": {"message": ...}}`` (extra fields may sit beside
``error``). Code raises an :class:`ApiError`, or one of the status classes below,
anywhere below a handler; the error middleware (:mod:`router.contract.web.middleware`)
turns it into that body. Status codes:

- 400 :class:`BadRequest`: the caller's mistake; nothing changed.
- 404 :class:`NotFound`: no such resource (worker, group).
- 409 :class:`Conflict`: the current state forbids the call (an update in progress,
  an unresolved failed update, mixed weight versions, a duplicate worker).
- 503 :class:`Unavailable`: nothing to serve with right now, or a lock was not
  acquired in time; ``Retry-After`` says when to try again.
- 502 is not an exception: a broadcast answers it with per-worker results.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class ErrorDetail(BaseModel):
    message: str
    type: str | None = None


class ErrorBody(BaseModel):
    """``{"error": {"message"}}``; fields beside ``error`` (``expected_world_size``, ``journal``) are kept."""

    model_config = ConfigDict(extra="allow")

    error: ErrorDetail


def error_body(message: str, type_: str | None = None, **extra: Any) -> dict[str, Any]:
    """Build the JSON error body; ``extra`` fields sit beside ``error``."""
    body: dict[str, Any] = {"error": ErrorDetail(message=message, type=type_).model_dump(exclude_none=True)}
    body.update(extra)
    return body


class ApiError(Exception):
    """An error with an HTTP status, reported to the caller as :class:`ErrorBody`."""

    def __init__(self, status: int, message: str, *, headers: dict[str, str] | None = None, **extra: Any):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return error_body(self.message, **self.extra)


class BadRequest(ApiError):
    def __init__(self, message: str, **extra: Any):
        super().__init__(400, message, **extra)


class NotFound(ApiError):
    def __init__(self, message: str, **extra: Any):
        super().__init__(404, message, **extra)


class Conflict(ApiError):
    def __init__(self, message: str, **extra: Any):
        super().__init__(409, message, **extra)


class Unavailable(ApiError):
    def __init__(self, message: str, **extra: Any):
        super().__init__(503, message, headers={"Retry-After": "1"}, **extra)
