"""One error middleware and one way to raise an HTTP error.

Handlers raise :class:`ApiError` (or let a pydantic ``ValidationError`` escape
from :func:`router.web.parsing.parse_body`); the middleware turns it into the
``{"error": {"message": ...}}`` body. Anything else becomes a 500 whose body
names the exception type but never carries a traceback.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

from aiohttp import web

from router.protocol.errors import error_body

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(Exception):
    """An error with an HTTP status, reported to the caller as a JSON body."""

    def __init__(self, status: int, message: str, *, headers: dict[str, str] | None = None, **extra: Any):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}
        self.extra = extra

    def to_response(self) -> web.Response:
        return web.json_response(error_body(self.message, **self.extra), status=self.status, headers=self.headers)


def json_error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response(error_body(message, **extra), status=status)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.to_response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # Router-level errors (404 unknown route, 405 wrong method) get the same body shape.
        return web.json_response(
            error_body(exc.reason or "error"), status=exc.status, headers={k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        )
    except Exception as exc:  # noqa: BLE001 - the last line of defence for the caller
        log.exception("unhandled error on %s %s", request.method, request.path)
        return json_error(500, f"internal error: {type(exc).__name__}")
