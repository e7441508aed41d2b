"""Bearer-token checks for admin and generation routes (constant-time compare)."""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Iterable

from aiohttp import web
from aiohttp.typedefs import Middleware

from router.contract.errors import ApiError

ADMIN_KEY_ENV = "SGLANG_OMNI_ADMIN_KEY"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def resolve_admin_key(cli_value: str | None) -> str | None:
    """The admin key from the command line, else from ``SGLANG_OMNI_ADMIN_KEY``."""
    if cli_value is not None and cli_value != "":
        return cli_value
    env = os.environ.get(ADMIN_KEY_ENV)
    return env if env else None


def bearer_token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return None
    return token.strip()


def token_matches(presented: str | None, expected: str) -> bool:
    if presented is None:
        return False
    return hmac.compare_digest(presented.encode(), expected.encode())


def require_bearer(request: web.Request, expected: str | None, what: str) -> None:
    """Raise 401 unless ``expected`` is unset or the request carries it."""
    if expected is None:
        return
    if not token_matches(bearer_token(request), expected):
        raise ApiError(401, f"{what} requires 'Authorization: Bearer <key>'", headers={"WWW-Authenticate": "Bearer"})


AccessCheck = Callable[[web.Request], None]


def access_check(
    *,
    admin_key: str | None,
    api_key: str | None,
    open_paths: Iterable[str],
    generation_paths: Iterable[str],
) -> AccessCheck:
    """Build the check every request passes before its handler: open paths pass, generation paths
    need ``api_key`` (the admin key is accepted too), every other route needs ``admin_key``.
    It raises :class:`~router.contract.errors.ApiError` (401) and returns nothing otherwise."""
    open_set = frozenset(open_paths)
    gen_set = frozenset(generation_paths)

    def check(request: web.Request) -> None:
        path = request.path
        if path in open_set:
            return
        if path in gen_set:
            if api_key is not None:
                token = bearer_token(request)
                if not (token_matches(token, api_key) or (admin_key is not None and token_matches(token, admin_key))):
                    raise ApiError(
                        401,
                        "generation requires 'Authorization: Bearer <api key>'",
                        headers={"WWW-Authenticate": "Bearer"},
                    )
            return
        require_bearer(request, admin_key, "admin route")

    return check


def auth_middleware(
    *,
    admin_key: str | None,
    api_key: str | None,
    open_paths: Iterable[str],
    generation_paths: Iterable[str],
) -> Middleware:
    """:func:`access_check` as a middleware of its own."""
    check = access_check(admin_key=admin_key, api_key=api_key, open_paths=open_paths, generation_paths=generation_paths)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        check(request)
        return await handler(request)

    return middleware
