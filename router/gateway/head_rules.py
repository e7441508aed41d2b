"""The front door's rules read from a request's head, the same in the lean server and aiohttp's.

Both servers apply them once the head is complete and before any body byte is read, in this order:
a repeated header that must appear once (400), the leader gate (503), the key (401), a declared
body over the bound (413), and, in the lean server, the body budget (503 with ``Retry-After``).
Each refusal closes the connection: the body the caller may still be sending is never read.

A header that may appear once and came twice is refused rather than read one way or the other,
since a proxy in front of the router and the router itself could each take a different one (a
second ``Authorization`` smuggled past a front proxy, two lengths framing two requests, two
``Host``\\ s naming two tenants). Any other repeated header is read as its first value, as aiohttp's
``headers.get`` reads it.
"""

from __future__ import annotations

from aiohttp.http_parser import SINGLETON_HEADERS

from router.contract.errors import ApiError
from router.contract.web.parsing import MAX_BODY_BYTES

#: Headers a request may carry at most once (names in lower case): those aiohttp's parser refuses twice
#: (its ``SINGLETON_HEADERS``: ``Content-Length``, ``Host``, ``Content-Type``, ``Transfer-Encoding``, ...), and
#: ``Authorization``.
SINGLE_HEADERS = frozenset(name.lower() for name in SINGLETON_HEADERS) | {"authorization"}

#: Seconds a caller refused for the budget is asked to wait (``Retry-After``).
RETRY_AFTER_S = 1


def repeated(name: str) -> ApiError:
    return ApiError(400, f"the request repeats its {name} header, which may appear once")


def too_large() -> ApiError:
    return ApiError(413, f"the request body is over the router's bound of {MAX_BODY_BYTES} bytes")


def over_budget() -> ApiError:
    return ApiError(
        503,
        "the router holds as many request bodies as its memory budget allows; retry shortly",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )
