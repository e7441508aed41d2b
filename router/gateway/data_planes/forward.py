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

from aiohttp import web

from router.contract.errors import ApiError
from router.gateway.data_planes.handoff import ConnectionHandoff
from router.gateway.upstream.lean_http import HttpUpstream
from router.gateway.upstream.transport import UpstreamError

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


#: The outer bound of one relayed call: the control process bounds every route itself, far below this.
RELAY_TIMEOUT_S = 3600.0
CONNECT_TIMEOUT_S = 5.0


class ControlForwarder:
    """Relays requests to the control process over its Unix socket (the router's lean keep-alive client:
    a relayed admin call costs the relay a few tens of microseconds, not aiohttp's client machinery)."""

    def __init__(self, socket_path: str, handoff: ConnectionHandoff | None = None):
        self._upstream = HttpUpstream(limit=0, connect_timeout_s=CONNECT_TIMEOUT_S, unix_path=socket_path)
        self._handoff = handoff

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path.startswith(INTERNAL_PREFIX):
            raise ApiError(404, f"no route {request.path}")
        body = await request.read()
        if self._handoff is not None and self._handoff.hand_over(request, body):
            return web.Response(status=204)  # never sent: the connection is the control process's now
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_RELAYED}
        # HEAD is relayed as a GET whose body is left out (the client cannot frame a HEAD's answer).
        method = "GET" if request.method == "HEAD" else request.method
        try:
            upstream = await self._upstream.request(
                method, "http://control", request.path_qs, body or None, headers, timeout_s=RELAY_TIMEOUT_S
            )
        except (OSError, UpstreamError) as exc:
            raise ApiError(503, f"the router's control process did not answer: {type(exc).__name__}: {exc}") from None
        out = web.StreamResponse(status=upstream.status)
        try:
            for name, value in upstream.headers.items():
                if name not in _NOT_RELAYED:
                    out.headers[name] = value
            if request.method == "HEAD":
                out.headers["Content-Length"] = upstream.header("content-length") or "0"
                await out.prepare(request)
                return out
            await out.prepare(request)
            async for chunk in upstream.chunks():
                await out.write(chunk)
            await out.write_eof()
        except (OSError, UpstreamError) as exc:
            log.warning("relay of %s %s broke mid-answer: %r", request.method, request.path, exc)
        finally:
            upstream.release()
        return out  # an answer cut short reaches the caller cut short

    async def close(self) -> None:
        self._upstream.close()
        if self._handoff is not None:
            self._handoff.close()
