"""One caller's connection to a data plane's lean server: parse, answer generation, hand the rest to aiohttp.

Requests are parsed by llhttp (through ``httptools``, as the router's worker client parses answers).
A request for a generation route (:data:`~router.gateway.api.proxied.PROXIED`, by method and path) is
served here, one at a time in the order they came (HTTP/1.1 answers in order; pipelined requests wait
their turn). The first request for any other route hands the connection to aiohttp's server in this
process: the protocol object of the connection is replaced by aiohttp's, which is given every byte
from that request's first on, so from then on aiohttp serves the connection as if it had accepted it
(relays, probes, readiness: :mod:`router.gateway.data_planes.data_plane`).

The bytes of that request are known when it began a read from the socket, as every request of a
caller that waits for each answer does. A request for another route pipelined behind a generation
request in one read cannot be handed over; it is refused (400, the connection closed) and the caller
told to send it on its own. Requests the server cannot parse are a 400, a body over the router's
bound a 413, and the connection is closed after either.

A caller that goes away cancels its request, which aborts it on its worker (as aiohttp's server does
for the router with ``handler_cancellation``). A connection with nothing in flight is closed after
:data:`IDLE_S` without a byte, and, once the server stops, after its answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from typing import Protocol

import httptools

from router.contract.web.parsing import MAX_BODY_BYTES
from router.gateway.api.proxied import Proxied
from router.gateway.frontend.wire import LeanCaller, encode_head

log = logging.getLogger(__name__)

#: A connection with nothing in flight is closed after this long without a byte (aiohttp's own keep-alive bound).
IDLE_S = 3630.0
#: A request's line and headers, at most (aiohttp's bound is 8190 bytes per line; this one is for them all).
MAX_HEAD_BYTES = 64 * 1024


class Server(Protocol):
    """What a connection needs of its server (:class:`~router.gateway.frontend.site.LeanServer`)."""

    routes: dict[tuple[str, str], Proxied]
    connections: set[CallerConnection]
    stopping: bool

    def fallback(self) -> asyncio.Protocol | None:
        """aiohttp's protocol for a connection handed over, or ``None`` once it stopped."""
        ...

    async def serve(self, caller: LeanCaller, route: Proxied) -> None: ...


class _Stop(Exception):
    """Raised in a parser callback to stop reading this connection; ``data_received`` acts on ``reason``."""

    def __init__(self, reason: str):
        self.reason = reason


_HAND_OVER = "hand over"
_TOO_LARGE = "too large"
_HEAD_TOO_LARGE = "head too large"


class CallerConnection(asyncio.Protocol):
    """See the module docstring."""

    def __init__(self, server: Server):
        self._server = server
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._in_message = False
        self._first_in_read = True
        self._reads: list[bytes] | None = None
        """Every read since the current request began, when it began a read (else ``None``: not known)."""
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._size = 0
        self._route: Proxied | None = None
        self._method = ""
        self._path = ""
        self._queue: deque[tuple[LeanCaller, Proxied]] = deque()
        self._task: asyncio.Task[None] | None = None
        self._handover: bytes | None = None
        self._paused = False
        self._writable: asyncio.Future[None] | None = None
        self.last_read = self._loop.time()

    # -- asyncio's protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a TCP transport (uvloop's do not subclass asyncio's)
        self._server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        self._queue.clear()
        if self._task is not None:
            self._task.cancel()  # the caller went away: the proxy aborts its request on the worker
        self._wake_writer(ConnectionResetError("the caller closed the connection"))

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_writer(None)

    def data_received(self, data: bytes) -> None:
        self.last_read = self._loop.time()
        if not self._in_message:
            self._reads = [data]  # this read begins at a request's first byte
        elif self._reads is not None:
            self._reads.append(data)
        self._first_in_read = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            stop = exc.__context__
            if not isinstance(stop, _Stop):
                raise
            if stop.reason == _TOO_LARGE:
                self._refuse(413, f"the request body is over the router's bound of {MAX_BODY_BYTES} bytes")
            elif stop.reason == _HEAD_TOO_LARGE:
                self._refuse(431, f"the request line and headers are over the router's bound of {MAX_HEAD_BYTES} bytes")
            else:
                self._hand_over_when_answered()
        except httptools.HttpParserUpgrade:
            self._hand_over_when_answered()  # an upgrade is aiohttp's to refuse or serve
        except httptools.HttpParserError as exc:
            self._refuse(400, f"the request could not be parsed: {exc}")

    # -- llhttp's callbacks
    def on_message_begin(self) -> None:
        self._in_message = True
        if not self._first_in_read:
            self._reads = None  # pipelined behind another request in one read: where it begins is not known
        self._first_in_read = False
        self._url = b""
        self._headers = {}
        self._body = []
        self._size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")
        self._count_head(len(name) + len(value))

    def _count_head(self, size: int) -> None:
        self._size += size
        if self._size > MAX_HEAD_BYTES:
            raise _Stop(_HEAD_TOO_LARGE)

    def on_headers_complete(self) -> None:
        method = self._parser.get_method().decode("latin-1")
        path = self._url.decode("latin-1").partition("?")[0]
        route = self._server.routes.get((method, path))
        if route is None or self._parser.should_upgrade():
            raise _Stop(_HAND_OVER)
        self._route, self._method, self._path = route, method, path
        self._size = 0  # from here: the body's size
        length = self._headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise _Stop(_TOO_LARGE)
        expects = self._headers.get("expect", "").lower() == "100-continue"
        if expects and self.transport is not None and self._task is None and not self._queue:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > MAX_BODY_BYTES:
            raise _Stop(_TOO_LARGE)
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_message = False
        assert self._route is not None
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        caller = LeanCaller(self._method, self._path, self._headers, body, self._parser.should_keep_alive(), self)
        self._queue.append((caller, self._route))
        if self._task is None:
            self._next()

    # -- serving, in order
    def _next(self) -> None:
        caller, route = self._queue.popleft()
        self._task = self._loop.create_task(self._serve(caller, route))

    async def _serve(self, caller: LeanCaller, route: Proxied) -> None:
        try:
            await self._server.serve(caller, route)
        finally:
            self._task = None
            self.last_read = self._loop.time()
            transport = self.transport
            if transport is not None and not transport.is_closing():
                if not caller.keep_alive or self._server.stopping or not caller.finished:
                    transport.close()  # what was written goes out first
                elif self._queue:
                    self._next()
                elif self._handover is not None:
                    self._hand_over(self._handover)

    # -- the caller's connection, as answers write to it (:class:`~router.gateway.frontend.wire.Outlet`)
    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the caller closed the connection")
        transport.write(data)

    async def drain(self) -> None:
        if self._paused:
            self._writable = self._loop.create_future()
            await self._writable

    def _wake_writer(self, exc: Exception | None) -> None:
        waiter, self._writable = self._writable, None
        if waiter is not None and not waiter.done():
            if exc is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(exc)

    # -- what this server does not serve
    def _hand_over_when_answered(self) -> None:
        reads = self._reads
        if reads is None:
            self._refuse(
                400,
                "a request for this route was pipelined behind a generation request; send it on its own "
                "(after the answers before it) or on another connection",
            )
            return
        raw = b"".join(reads)
        if self._task is not None or self._queue:
            assert self.transport is not None
            self.transport.pause_reading()  # the caller's bytes wait in the socket for aiohttp
            self._handover = raw
        else:
            self._hand_over(raw)

    def _hand_over(self, raw: bytes) -> None:
        transport = self.transport
        handler = self._server.fallback()
        if transport is None or handler is None:  # stopping: the caller sees the connection close
            if transport is not None:
                transport.close()
            return
        self._server.connections.discard(self)
        self.transport = None
        transport.set_protocol(handler)
        handler.connection_made(transport)
        handler.data_received(raw)
        if self._handover is not None:
            transport.resume_reading()

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request this server could not read, after the answers owed before it, and close."""
        self._queue.clear()
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        body = json.dumps({"error": {"message": message}}).encode()
        answer = encode_head(status, {"Content-Type": "application/json; charset=utf-8"}, len(body), False) + body

        def send() -> None:
            if not transport.is_closing():
                transport.write(answer)
                transport.close()

        if self._task is None:
            send()
        else:
            transport.pause_reading()
            self._task.add_done_callback(lambda _task: send())

    @property
    def idle(self) -> bool:
        """Nothing in flight or owed (a request half sent is not owed an answer)."""
        return self._task is None and not self._queue

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
