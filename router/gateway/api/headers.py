"""What the router sends its workers on an admin call: its own worker key, never the caller's, and the
operation's id (:data:`~router.contract.admin.OPERATION_HEADER`): the caller's ``X-Request-Id`` when it
sent a usable one, so a trainer's own id follows its call into every worker's log."""

from __future__ import annotations

import re

from aiohttp import web

from router.contract.admin import OPERATION_HEADER
from router.contract.vllm_tokens import REQUEST_ID_HEADER
from router.gateway import keys

#: An id is logged as it came: only characters that cannot forge or break a log line.
_USABLE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def forward_headers(request: web.Request) -> dict[str, str]:
    headers = request.app[keys.SERVICE_HEADERS]
    given = request.headers.get(REQUEST_ID_HEADER)
    if given is None or not _USABLE_ID.fullmatch(given):
        return headers
    return {**headers, OPERATION_HEADER: given}
