"""Router status-code table, as exceptions the plain policy classes raise.

Each is an :class:`~router.web.errors.ApiError`, so the one error middleware
turns it into ``{"error": {"message": ...}}`` with the right status:

- 400 ``BadRequest``: the caller's mistake (bad URL, wrong world size); nothing changed.
- 404 ``NotFound``: no such worker.
- 409 ``Conflict``: the registry or fleet is in a state that forbids the call
  (update in progress, unresolved failed update, mixed weight versions, duplicate worker).
- 503 ``Unavailable``: nothing to route to, or the update lock was not acquired in time.
- 502 is not an exception: a broadcast answers it with per-worker results.
"""

from __future__ import annotations

from typing import Any

from router.web.errors import ApiError


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
