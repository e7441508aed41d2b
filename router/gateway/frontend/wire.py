"""A generation request as the lean server read it, and its answer as bytes on the caller's connection.

:class:`LeanCaller` is the :class:`~router.gateway.routing.caller.Caller` the proxy reads and answers:
a whole answer is one write (head and body), a stream a head and then chunked transfer coding, one
chunk per piece the worker sent, written as it arrives and held back while the caller reads slower
(the connection's flow control, :class:`Outlet`, for the stream's stall bound at most).

HTTP/1.0 knows no chunked coding (RFC 9112 section 6.1): a stream to an HTTP/1.0 caller is its bytes
as they come, ended by closing the connection, as aiohttp's server sends it. A whole answer says its
length either way, and ``Connection: keep-alive`` when an HTTP/1.0 caller asked to keep the connection.
"""

from __future__ import annotations

import time
from email.utils import formatdate
from http import HTTPStatus
from typing import Protocol

from aiohttp import web

#: Every status's reason phrase, as aiohttp writes them.
_REASONS = {s.value: s.phrase for s in HTTPStatus}


class Outlet(Protocol):
    """The caller's connection, as an answer writes to it."""

    def write(self, data: bytes) -> None:
        """Write now; raises ``ConnectionResetError`` when the caller went away."""
        ...

    async def drain(self, stall_s: float) -> None:
        """Wait while the caller reads slower than the answer is written, ``stall_s`` at most; then the
        connection is cut and :class:`~router.gateway.routing.caller.StreamStalled` raised."""
        ...


_date_second = 0
_date_line = ""


def _date() -> str:
    """The ``Date`` header line (HTTP requires it of a server with a clock), formatted once a second."""
    global _date_second, _date_line
    now = int(time.time())
    if now != _date_second:
        _date_second, _date_line = now, f"Date: {formatdate(now, usegmt=True)}\r\n"
    return _date_line


#: Bytes a header name may not hold (RFC 9110 section 5.6.2: a name is a token).
_NOT_IN_NAMES = frozenset(' \t\r\n:"(),/;<=>?@[\\]{}')


def encode_head(
    status: int, headers: dict[str, str], length: int | None, keep_alive: bool, *, chunked: bool = True
) -> bytes:
    """The answer's status line and headers; ``length=None``: the body follows in chunks, or, when not
    ``chunked`` (an HTTP/1.0 caller), until the connection closes."""
    parts = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n", _date()]
    for name, value in headers.items():
        # A header never splits into two, whatever a worker or caller sent.
        if "\n" in value or "\r" in value or not name or not _NOT_IN_NAMES.isdisjoint(name):
            continue
        parts.append(f"{name}: {value}\r\n")
    if length is not None:
        parts.append(f"Content-Length: {length}\r\n")
    elif chunked:
        parts.append("Transfer-Encoding: chunked\r\n")
    if not keep_alive:
        parts.append("Connection: close\r\n")
    elif not chunked:
        parts.append("Connection: keep-alive\r\n")  # HTTP/1.0 closes unless the answer says otherwise
    parts.append("\r\n")
    return "".join(parts).encode("latin-1", "replace")


def encode_response(response: web.Response, keep_alive: bool, *, chunked: bool = True) -> bytes:
    """A whole answer aiohttp's objects built (an error shape, a gate's answer), as bytes."""
    body = response.body if isinstance(response.body, bytes) else b""
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "connection")}
    return encode_head(response.status, headers, len(body), keep_alive, chunked=chunked) + body


class LeanCaller:
    """One request read by the lean server (see the module docstring); answers return their status."""

    __slots__ = ("_headers", "body", "chunked", "finished", "held", "keep_alive", "method", "outlet", "path", "started")

    def __init__(self, method: str, path: str, headers: dict[str, str], body: bytes, keep_alive: bool, outlet: Outlet):
        self.method = method
        self.path = path
        self._headers = headers
        """Names in lower case; a repeated header keeps its first value (as aiohttp reads it)."""
        self.body = body
        self.keep_alive = keep_alive
        self.outlet = outlet
        self.chunked = True
        """The caller reads chunked coding (HTTP/1.1); an HTTP/1.0 caller does not."""
        self.held = 0
        """Bytes of the body counted against the server's body budget, given back once answered."""
        self.started = False
        """The answer's head has been written: no other answer may be."""
        self.finished = False
        """The whole answer has been written: the connection may carry the next request."""

    def header(self, name: str) -> str | None:
        return self._headers.get(name.lower())

    async def read(self) -> bytes:
        return self.body

    def answer(self, status: int, body: bytes, headers: dict[str, str]) -> int:
        self.started = True
        self.outlet.write(encode_head(status, headers, len(body), self.keep_alive, chunked=self.chunked) + body)
        self.finished = True
        return status

    async def stream(self, status: int, headers: dict[str, str], stall_s: float) -> LeanStream:
        self.started = True
        if not self.chunked:
            self.keep_alive = False  # the stream ends where the connection does
        self.outlet.write(encode_head(status, headers, None, self.keep_alive, chunked=self.chunked))
        return LeanStream(self, status, stall_s)

    def end_stream(self) -> None:
        """End a streamed answer (its last, empty chunk), unless it is whole already."""
        if self.started and not self.finished:
            if self.chunked:
                self.outlet.write(b"0\r\n\r\n")
            self.finished = True

    def answer_with(self, response: web.Response) -> int:
        """An answer aiohttp's objects built (an error shape or a gate's answer, shared with aiohttp's server)."""
        self.started = True
        self.outlet.write(encode_response(response, self.keep_alive, chunked=self.chunked))
        self.finished = True
        return response.status


class LeanStream:
    """A chunked answer (:class:`~router.gateway.routing.caller.Stream`). One the handler left without
    :meth:`end` is ended by the server after it (as aiohttp's server ends a prepared response)."""

    __slots__ = ("_caller", "_stall_s", "answer")

    def __init__(self, caller: LeanCaller, status: int, stall_s: float):
        self._caller = caller
        self._stall_s = stall_s
        self.answer = status

    async def write(self, chunk: bytes) -> None:
        if chunk:  # an empty chunk would end the answer
            caller = self._caller
            outlet = caller.outlet
            outlet.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if caller.chunked else chunk)
            await outlet.drain(self._stall_s)

    async def end(self) -> None:
        self._caller.end_stream()
