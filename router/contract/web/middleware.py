"""The one error middleware both servers install.

Handlers raise :class:`~router.contract.errors.ApiError` (or let a pydantic
``ValidationError`` escape from :func:`router.contract.web.parsing.parse_body`);
the middleware turns it into the ``{"error": {"message": ...}}`` body. aiohttp's
own 404/405 get the same shape. Anything else becomes a 500 whose body names the
exception type but never carries a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from router.contract.errors import ApiError, error_body

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_error(status: int, message: str, *, headers: dict[str, str] | None = None, **extra: Any) -> web.Response:
    return web.json_response(error_body(message, **extra), status=status, headers=headers)


def error_response(request: web.Request, exc: Exception) -> web.Response:
    """The answer for an exception a handler raised (see the module docstring); re-raises a
    redirect or other non-error ``HTTPException``."""
    return error_answer(exc, request.method, request.path)


def error_answer(exc: Exception, method: str, path: str) -> web.Response:
    """:func:`error_response` for a request to ``method path``, whichever server took it."""
    if isinstance(exc, ApiError):
        return web.json_response(exc.body(), status=exc.status, headers=exc.headers)
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        # Router-level errors (404 unknown route, 405 wrong method) get the same body shape.
        allow = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        return json_error(exc.status, exc.reason or "error", headers=allow)
    log.error("unhandled error on %s %s", method, path, exc_info=exc)
    return json_error(500, f"internal error: {type(exc).__name__}")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except Exception as exc:
        return error_response(request, exc)
