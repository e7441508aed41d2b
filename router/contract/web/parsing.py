"""Turn a request body into a wire model, or a clear 400."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from router.contract.errors import ApiError

M = TypeVar("M", bound=BaseModel)

MAX_BODY_BYTES = 64 * 1024 * 1024


async def read_json(request: web.Request, *, allow_empty: bool = True) -> dict[str, Any]:
    """Read the body as a JSON object; an empty body (or GET) is ``{}`` when allowed."""
    raw = await request.read() if request.can_read_body else b""
    if not raw.strip():
        if allow_empty:
            return {}
        raise ApiError(400, "request body is required")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"malformed JSON body: {exc}") from None
    if data is None and allow_empty:
        return {}
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
    return data


def validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ())) or "body"
        parts.append(f"{where}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts)


def parse_model(model: type[M], data: Any) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ApiError(400, validation_message(exc)) from None
    except (ValueError, TypeError) as exc:
        raise ApiError(400, f"invalid request: {exc}") from None


async def parse_body(request: web.Request, model: type[M], *, allow_empty: bool = True) -> M:
    """Parse and validate a JSON body (query parameters fill in missing fields)."""
    data = await read_json(request, allow_empty=allow_empty)
    for key, value in request.query.items():
        data.setdefault(key, value)
    return parse_model(model, data)
