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


def bearer_of(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header's value, or ``None``."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return None
    return token.strip()


def token_matches(presented: str | None, expected: str) -> bool:
    if presented is None:
        return False
    return hmac.compare_digest(presented.encode(), expected.encode())


AccessCheck = Callable[[web.Request], None]
#: The same check from a request's path and ``Authorization`` header (a server other than aiohttp's).
TokenCheck = Callable[[str, str | None], None]


def token_check(
    *,
    admin_key: str | None,
    api_key: str | None,
    open_paths: Iterable[str],
    generation_paths: Iterable[str],
) -> TokenCheck:
    """Build the check every request passes before its handler: open paths pass, generation paths
    need ``api_key`` (the admin key is accepted too), every other route needs ``admin_key``.
    It raises :class:`~router.contract.errors.ApiError` (401) and returns nothing otherwise."""
    open_set = frozenset(open_paths)
    gen_set = frozenset(generation_paths)

    def check(path: str, authorization: str | None) -> None:
        if path in open_set:
            return
        token = bearer_of(authorization)
        if path in gen_set:
            if (
                api_key is None
                or token_matches(token, api_key)
                or (admin_key is not None and token_matches(token, admin_key))
            ):
                return
            raise ApiError(
                401, "generation requires 'Authorization: Bearer <api key>'", headers={"WWW-Authenticate": "Bearer"}
            )
        if admin_key is not None and not token_matches(token, admin_key):
            raise ApiError(
                401, "admin route requires 'Authorization: Bearer <key>'", headers={"WWW-Authenticate": "Bearer"}
            )

    return check


def access_check(
    *,
    admin_key: str | None,
    api_key: str | None,
    open_paths: Iterable[str],
    generation_paths: Iterable[str],
) -> AccessCheck:
    """:func:`token_check` of an aiohttp request."""
    return of_requests(
        token_check(admin_key=admin_key, api_key=api_key, open_paths=open_paths, generation_paths=generation_paths)
    )


def of_requests(check: TokenCheck) -> AccessCheck:
    """``check`` of an aiohttp request."""
    return lambda request: check(request.path, request.headers.get("Authorization"))


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
