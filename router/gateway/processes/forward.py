"""A data plane's routes that it does not serve itself go to the control process, as they came.

Admin, registry, journal, health and metrics routes run in the control process, which owns the
state they read or change; a data plane relays the request (method, path and query, headers,
body) over the control process's Unix socket and relays the answer back. The caller's
``Authorization`` is passed on: the control process checks it, as the single process does.
A relayed call lasts as long as the control process takes (it bounds every route); a data plane
whose control process goes away stops serving, which ends the relays too.
"""

from __future__ import annotations

import logging

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from router.contract.errors import ApiError

log = logging.getLogger(__name__)

#: Hop-by-hop headers (RFC 9110 §7.6.1) and those the relay sets itself.
_NOT_RELAYED = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Connection",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)
#: Paths of the control process that no caller reaches through a data plane.
INTERNAL_PREFIX = "/_omni/"


class ControlForwarder:
    """Relays requests to the control process over its Unix socket (one pooled session)."""

    def __init__(self, socket_path: str):
        self._socket_path = socket_path
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.UnixConnector(path=self._socket_path, limit=0)
            self._session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None)
            )
        return self._session

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path.startswith(INTERNAL_PREFIX):
            raise ApiError(404, f"no route {request.path}")
        headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in _NOT_RELAYED)
        body = await request.read()
        out: web.StreamResponse | None = None
        try:
            async with self._client().request(
                request.method,
                "http://control" + request.path_qs,
                headers=headers,
                data=body if body else None,
                allow_redirects=False,
            ) as upstream:
                out = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                for name, value in upstream.headers.items():
                    if name.lower() not in _NOT_RELAYED:
                        out.headers.add(name, value)
                await out.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except aiohttp.ClientError as exc:
            if out is None:
                raise ApiError(
                    503, f"the router's control process did not answer: {type(exc).__name__}: {exc}"
                ) from None
            log.warning("relay of %s %s broke mid-answer: %r", request.method, request.path, exc)
            return out  # the answer had begun: the caller sees it cut short

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
