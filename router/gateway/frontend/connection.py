"""One caller's connection to a data plane's lean server: parse, answer generation, hand the rest to aiohttp.

Requests are parsed by llhttp (through ``httptools``, as the router's worker client parses answers).
A request for a generation route (:data:`~router.gateway.routing.proxied.PROXIED`, by method and path) is
served here, one at a time in the order they came (HTTP/1.1 answers in order; pipelined requests wait
their turn). The first request for any other route hands the connection to aiohttp's server in this
process: the protocol object of the connection is replaced by aiohttp's, which is given every byte
from that request's first on, so from then on aiohttp serves the connection as if it had accepted it
(relays, probes, readiness: :mod:`router.gateway.processes.data_plane`).

The bytes of that request are known when it began a read from the socket, as every request of a
caller that waits for each answer does. A request for another route pipelined behind a generation
request in one read cannot be handed over; it is refused (400, the connection closed) and the caller
told to send it on its own.

What a caller costs is bounded before it is served (:mod:`.rules`, docs/router.md "The front door"):

- A request is admitted at its head, before any body byte is read: the leader gate, the key, a
  repeated header, a declared length over the bound and the process's body budget
  (:mod:`.budget`) are each answered there, and the connection closed after the answer.
- While a request is being served, the connection is read only until a later request is complete or
  its body passes :data:`HOLD_BYTES`; then reading pauses (as aiohttp's payload reader and uvicorn's
  httptools protocol do), and the caller's bytes wait in the socket. A request is not started while
  the caller has not read the answers before it (they wait as long as a stream may,
  ``--stream-stall-timeout-s``, then the connection is cut).
- Requests the server cannot parse are a 400, a head over :data:`MAX_HEAD_BYTES` a 431, a body over
  the router's bound a 413; each answered after the answers owed before it, then the connection closes.

A caller that goes away cancels its request, which aborts it on its worker (as aiohttp's server does
for the router with ``handler_cancellation``). A connection with nothing in flight is closed after
:data:`IDLE_S` without a byte, and, once the server stops, after its answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Protocol

import httptools
from aiohttp import web

from router.contract.web.middleware import error_answer, json_error
from router.contract.web.parsing import MAX_BODY_BYTES
from router.gateway.edge import UNMATCHED
from router.gateway.frontend.budget import BodyBudget
from router.gateway.frontend.wire import LeanCaller, encode_response
from router.gateway.head_rules import SINGLE_HEADERS, over_budget, repeated, too_large
from router.gateway.routing.caller import StreamStalled
from router.gateway.routing.proxied import Proxied

log = logging.getLogger(__name__)

#: A connection with nothing in flight is closed after this long without a byte (aiohttp's own keep-alive bound).
IDLE_S = 3630.0
#: A request's line and headers, at most (aiohttp's bound is 8190 bytes per line; this one is for them all).
MAX_HEAD_BYTES = 64 * 1024
#: While a request is served, the body of the next one is read up to this much before reading pauses.
HOLD_BYTES = 64 * 1024


class Server(Protocol):
    """What a connection needs of its server (:class:`~router.gateway.frontend.site.LeanServer`)."""

    routes: dict[tuple[str, str], Proxied]
    connections: set[CallerConnection]
    stopping: bool
    budget: BodyBudget
    stall_s: float

    def fallback(self) -> asyncio.Protocol | None:
        """aiohttp's protocol for a connection handed over, or ``None`` once it stopped."""
        ...

    def admit(self, path: str, headers: dict[str, str]) -> web.Response | None:
        """The leader gate's or the key check's answer refusing a request at its head, or ``None``."""
        ...

    def refused(self, method: str, path: str, status: int) -> None:
        """Count an answer the connection gave without serving the request."""
        ...

    def stalled(self) -> None:
        """Count a connection cut because its caller did not read its answers."""
        ...

    async def serve(self, caller: LeanCaller, route: Proxied) -> None: ...


class _Stop(Exception):
    """Raised in a parser callback to stop reading this connection; ``data_received`` acts on it."""

    def __init__(self, refusal: web.Response | None = None):
        self.refusal = refusal
        """The answer to send, or ``None``: the request is aiohttp's (hand the connection over)."""


class CallerConnection(asyncio.Protocol):
    """See the module docstring."""

    def __init__(self, server: Server):
        self._server = server
        self._budget = server.budget
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._in_message = False
        self._first_in_read = True
        self._reads: list[bytes] | None = None
        """Every read since the current request began, when it began a read (else ``None``: not known)."""
        self._url = b""
        self._headers: dict[str, str] = {}
        self._repeated: str | None = None
        self._body: list[bytes] = []
        self._size = 0
        self._held = 0
        """Bytes of the body being read, taken from the budget."""
        self._route: Proxied | None = None
        self._method = ""
        self._path = ""
        self._queue: deque[tuple[LeanCaller, Proxied] | bytes] = deque()
        """Complete requests waiting their turn, and at most one refusal (an answer to write, then close)."""
        self._task: asyncio.Task[None] | None = None
        self._handover: bytes | None = None
        self._done = False
        """Nothing more is read: a refusal is owed or was sent."""
        self._reading = True
        self._paused = False
        self._writable: asyncio.Future[None] | None = None
        self.last_read = self._loop.time()

    # -- asyncio's protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a TCP transport (uvloop's do not subclass asyncio's)
        self._server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        self._done = True
        for pending in self._queue:
            if not isinstance(pending, bytes):
                self._budget.give(pending[0].held)
        self._queue.clear()
        self._give_back()
        if self._task is not None:
            self._task.cancel()  # the caller went away: the proxy aborts its request on the worker
        self._wake_writer(ConnectionResetError("the caller closed the connection"))

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_writer(None)

    def data_received(self, data: bytes) -> None:
        if self._done:
            return  # read before the refusal paused the socket: never parsed, never held
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
            if stop.refusal is None:
                self._hand_over_when_answered()
            else:
                self._refuse(stop.refusal)
        except httptools.HttpParserUpgrade:
            self._hand_over_when_answered()  # an upgrade is aiohttp's to refuse or serve
        except httptools.HttpParserError as exc:
            self._refuse(json_error(400, f"the request could not be parsed: {exc}"))

    # -- llhttp's callbacks
    def on_message_begin(self) -> None:
        self._in_message = True
        if not self._first_in_read:
            self._reads = None  # pipelined behind another request in one read: where it begins is not known
        self._first_in_read = False
        self._url = b""
        self._headers = {}
        self._repeated = None
        self._route = None
        self._body = []
        self._size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        if key in self._headers:  # the first value is the one read (as aiohttp's headers.get reads it)
            if key in SINGLE_HEADERS:
                self._repeated = key
        else:
            self._headers[key] = value.decode("latin-1")
        self._count_head(len(name) + len(value))

    def _count_head(self, size: int) -> None:
        self._size += size
        if self._size > MAX_HEAD_BYTES:
            message = f"the request line and headers are over the router's bound of {MAX_HEAD_BYTES} bytes"
            raise _Stop(json_error(431, message))

    def on_headers_complete(self) -> None:
        method = self._parser.get_method().decode("latin-1")
        path = self._url.decode("latin-1").partition("?")[0]
        route = self._server.routes.get((method, path))
        if route is None or self._parser.should_upgrade():
            raise _Stop()  # aiohttp's request: its server applies the same rules
        self._route, self._method, self._path = route, method, path
        self._size = 0  # from here: the body's size
        self._reads = None  # served here: no hand-over, so its reads need not be kept
        headers = self._headers
        if self._repeated is not None:
            refusal: web.Response | None = error_answer(repeated(self._repeated), method, path)
        else:
            refusal = self._server.admit(path, headers)
        if refusal is None:
            length = headers.get("content-length")
            if length is not None:  # llhttp has checked it is digits only, given once
                if int(length) > MAX_BODY_BYTES:
                    refusal = error_answer(too_large(), method, path)
                elif not self._budget.admits(int(length)):
                    refusal = error_answer(over_budget(), method, path)
        if refusal is not None:
            raise _Stop(refusal)
        # An HTTP/1.0 expectation is ignored (RFC 9110 section 10.1.1).
        expects = headers.get("expect", "").lower() == "100-continue" and self._parser.get_http_version() == "1.1"
        if expects and self.transport is not None and self._task is None and not self._queue:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        size = len(body)
        self._size += size
        if self._size > MAX_BODY_BYTES:
            raise _Stop(error_answer(too_large(), self._method, self._path))
        if not self._budget.take(size):
            raise _Stop(error_answer(over_budget(), self._method, self._path))
        self._held += size
        self._body.append(body)
        if self._task is not None and self._held > HOLD_BYTES and self._reading:
            self._set_reading(False)  # the next request's body waits in the socket while this one is served

    def on_message_complete(self) -> None:
        self._in_message = False
        assert self._route is not None
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body = []
        parser = self._parser
        caller = LeanCaller(self._method, self._path, self._headers, body, parser.should_keep_alive(), self)
        caller.held = self._held
        if parser.get_http_version() == "1.0":
            caller.chunked = False  # an HTTP/1.0 caller reads a stream to the connection's close
        self._held = 0
        self._queue.append((caller, self._route))
        if self._task is None:
            self._next()
        elif self._reading:
            self._set_reading(False)  # a complete request waits: read no further until it is served

    # -- serving, in order
    def _next(self) -> None:
        pending = self._queue.popleft()
        if isinstance(pending, bytes):  # a refusal, owed after the answers before it
            self._send_and_close(pending)
            return
        self._task = self._loop.create_task(self._serve(*pending))
        if not self._reading and not self._queue and not self._done and self._handover is None:
            self._set_reading(True)

    async def _serve(self, caller: LeanCaller, route: Proxied) -> None:
        served = False
        try:
            if self._paused:  # the caller has not read the answers before this one
                try:
                    await self.drain(self._server.stall_s)
                except StreamStalled:
                    self._server.stalled()
                    raise
            served = True
            await self._server.serve(caller, route)
        except ConnectionResetError:  # StreamStalled too: the connection is cut
            pass
        finally:
            self._budget.give(caller.held)
            caller.held = 0
            self._task = None
            self.last_read = self._loop.time()
            transport = self.transport
            if transport is not None and not transport.is_closing():
                if not served or not caller.keep_alive or self._server.stopping or not caller.finished:
                    self._close(transport)  # what was written goes out first
                elif self._queue:
                    self._next()
                elif self._handover is not None:
                    self._hand_over(self._handover)
                elif not self._reading and not self._done:
                    self._set_reading(True)

    def _set_reading(self, reading: bool) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self._reading = reading
        if reading:
            transport.resume_reading()
        else:
            transport.pause_reading()

    # -- the caller's connection, as answers write to it (:class:`~router.gateway.frontend.wire.Outlet`)
    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the caller closed the connection")
        transport.write(data)

    async def drain(self, stall_s: float) -> None:
        """Wait while the caller reads slower than its answers are written, ``stall_s`` at most: past it the
        connection is cut (what it buffered dropped) and :class:`StreamStalled` raised."""
        if not self._paused:
            return
        waiter = self._writable = self._loop.create_future()
        try:
            async with asyncio.timeout(stall_s):
                await waiter
        except TimeoutError:
            if self.transport is not None:
                self.transport.abort()
            raise StreamStalled(f"the caller read nothing for {stall_s:g}s") from None

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
            message = (
                "a request for this route was pipelined behind a generation request; send it on its own "
                "(after the answers before it) or on another connection"
            )
            self._refuse(json_error(400, message))
            return
        raw = b"".join(reads)
        if self._task is not None or self._queue:
            self._set_reading(False)  # the caller's bytes wait in the socket for aiohttp
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
        if not self._reading:
            transport.resume_reading()

    def _refuse(self, refusal: web.Response) -> None:
        """Answer a request this server will not read on, after the answers owed before it, and close."""
        self._done = True
        self._give_back()
        self._body = []
        self._set_reading(False)
        if self._route is not None:
            self._server.refused(self._method, self._path, refusal.status)
        else:  # not known to be a generation request: counted as aiohttp counts a route it has not
            self._server.refused("unknown", UNMATCHED, refusal.status)
        answer = encode_response(refusal, keep_alive=False)
        if self._task is None and not self._queue:
            self._send_and_close(answer)
        else:
            self._queue.append(answer)

    def _send_and_close(self, answer: bytes) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(answer)
            self._close(transport)

    def _close(self, transport: asyncio.Transport) -> None:
        """Close once what was written is sent; a caller that reads none of it is cut after the stall bound."""
        transport.close()
        if transport.get_write_buffer_size():
            self._loop.call_later(self._server.stall_s, transport.abort)

    def _give_back(self) -> None:
        self._budget.give(self._held)
        self._held = 0

    @property
    def idle(self) -> bool:
        """Nothing in flight or owed (a request half sent is not owed an answer)."""
        return self._task is None and not self._queue

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
