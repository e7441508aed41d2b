"""The router's one middleware: who may call the route, how errors answer, what is counted.

Every request passes one layer instead of three (the access check of
:func:`~router.contract.web.auth.access_check`, the error shape of
:func:`~router.contract.web.middleware.error_response`, the request metrics): on the
proxy path each middleware layer is a coroutine frame and an await per request, and
fusing them saves about a tenth of the CPU a proxied request costs (docs/benchmarks.md).
The order is the one three layers had: the metrics see the status of the error answer,
and a 401 is counted like any other answer.

What is refused at the head (:mod:`router.gateway.head_rules`, the same rules as the lean
server's) is refused before the handler reads a body byte, and the answer closes the connection.
aiohttp's parser already refuses a repeated ``Host`` or ``Content-Length``; a repeated
``Authorization`` is refused here, and a declared length over the bound too (aiohttp's own bound,
``client_max_size``, is applied only as the body is read).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11
from aiohttp.typedefs import Middleware

from router.contract.web.auth import AccessCheck
from router.contract.web.middleware import Handler, error_response
from router.contract.web.openapi import ExpectHandler
from router.contract.web.parsing import MAX_BODY_BYTES
from router.gateway.head_rules import repeated, too_large
from router.gateway.metrics import RouterMetrics

#: The route label of a request that matched no route.
UNMATCHED = "unmatched"


def route_label(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else UNMATCHED


#: Answers a request before the access check, or ``None`` to let it through (a standby's leader gate).
Gate = Callable[[web.Request], web.StreamResponse | None]


def edge_middleware(
    check: AccessCheck,
    metrics: RouterMetrics,
    *,
    counted: Callable[[web.Request], bool] | None = None,
    gate: Gate | None = None,
) -> Middleware:
    """The fused middleware; ``counted`` says which requests this process's metrics count (all by
    default); ``gate`` may answer first (:meth:`~router.gateway.leader.gate.LeaderGate.answer`)."""

    @web.middleware
    async def edge(request: web.Request, handler: Handler) -> web.StreamResponse:
        start = time.perf_counter()
        status = 500
        try:
            try:
                refused = _refused_at_head(request, check, gate)
                if refused is not None:
                    refused.force_close()  # the body, if any, is never read
                    response = refused
                else:
                    response = await handler(request)
            except asyncio.CancelledError:
                status = 499  # the caller went away
                raise
            except web.HTTPException as exc:
                if exc.status < 400:
                    status = exc.status
                    raise
                response = error_response(request, exc)
            except Exception as exc:
                response = error_response(request, exc)
            status = response.status
            if not request.content.is_eof():
                # aiohttp closes a connection whose request body was not read to its end (lingering_time=0,
                # router/gateway/serving.py): the answer says so, or a client would send its next request
                # down a connection about to close (a race a loaded machine loses).
                response.force_close()
            return response
        finally:
            if counted is None or counted(request):
                metrics.observe_request(route_label(request), request.method, status, time.perf_counter() - start)

    return edge


def expect_after_head(check: AccessCheck, gate: Gate | None = None) -> ExpectHandler:
    """aiohttp's ``Expect`` handler for every route: aiohttp runs it before any middleware, so it sends
    ``100 Continue`` only to a request the edge will admit (the others are refused by the edge without
    their body being sent); otherwise as aiohttp's default (HTTP/1.1 only; 417 for another expectation)."""

    async def expect(request: web.Request) -> None:
        if _refused_at_head(request, check, gate) is not None:
            return
        if request.version != HttpVersion11:
            return  # an HTTP/1.0 expectation is ignored (RFC 9110 section 10.1.1)
        expectation = request.headers.get(hdrs.EXPECT, "")
        if expectation.lower() != "100-continue":
            raise web.HTTPExpectationFailed(text=f"Unknown Expect: {expectation}")
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer's own bytes are counted from here

    return expect


def _refused_at_head(request: web.Request, check: AccessCheck, gate: Gate | None) -> web.StreamResponse | None:
    """The answer refusing ``request`` from its head alone, or ``None`` to run its handler."""
    if len(request.headers.getall("Authorization", ())) > 1:
        return error_response(request, repeated("authorization"))
    gated = gate(request) if gate is not None else None
    if gated is not None:
        return gated
    try:
        check(request)
    except Exception as exc:  # the access check's 401
        return error_response(request, exc)
    length = request.content_length
    if length is not None and length > MAX_BODY_BYTES:
        return error_response(request, too_large())
    return None
