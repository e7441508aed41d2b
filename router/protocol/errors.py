"""The one error body every route returns: ``{"error": {"message": ...}}``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


def error_body(message: str, type_: str | None = None, **extra: Any) -> dict[str, Any]:
    """Build the JSON error body; ``extra`` fields sit beside ``error``."""
    body: dict[str, Any] = {"error": ErrorDetail(message=message, type=type_).model_dump(exclude_none=True)}
    body.update(extra)
    return body
