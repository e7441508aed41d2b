"""A lean keep-alive HTTP/1.1 client for admin fan-out to plain-http workers.

Why not the shared aiohttp ``ClientSession``: a broadcast to 256 workers is
256 small request/response pairs issued at once, and aiohttp's client costs
~150-200 us of CPU per request on the event loop, which alone blows a 50 ms
budget on a small machine. Admin calls need none of its features (cookies,
redirects, proxies, compression, streaming), so this client writes one
request on a pooled connection and parses one response: status line,
headers, and a ``Content-Length``, chunked or read-until-close body.

Rules that keep it safe:
- a connection carries one request at a time and returns to the pool only
  after a complete response that did not ask to close;
- pooled connections idle longer than ``max_idle_s`` (well under servers'
  keep-alive timeouts) are discarded, never reused;
- no request is ever retried here (admin POSTs are not idempotent);
- a timeout or any error closes that connection.

``https`` workers go through aiohttp instead (see :class:`~router.gateway.admin.fanout.FanOut`).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024


class HttpProtocolError(Exception):
    """The peer did not speak HTTP/1.1 as expected."""


class _Response:
    __slots__ = ("body", "headers", "keep_alive", "status")

    def __init__(self, status: int, headers: dict[str, str], body: bytes, keep_alive: bool):
        self.status = status
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive


class _Connection(asyncio.Protocol):
    """One TCP connection; parses exactly one response per request."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = time.monotonic()
        self._buf = bytearray()
        self._waiter: asyncio.Future[_Response] | None = None
        self._head: tuple[int, dict[str, str]] | None = None
        self._body_start = 0

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if self._waiter is None or self._waiter.done():
            return
        try:
            response = self._parse(eof=False)
        except HttpProtocolError as exc:
            self._fail(exc)
            return
        if response is not None:
            self._waiter.set_result(response)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is not None and not self._waiter.done():
            try:
                response = self._parse(eof=True)
            except HttpProtocolError as err:
                response, exc = None, err
            if response is not None:
                self._waiter.set_result(response)
            else:
                self._waiter.set_exception(exc or ConnectionResetError("connection closed before a complete response"))

    # request/response
    def send(self, payload: bytes) -> asyncio.Future[_Response]:
        assert self.transport is not None
        self._buf.clear()
        self._head = None
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(payload)
        return self._waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _fail(self, exc: Exception) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)
        self.close()

    def _parse(self, *, eof: bool) -> _Response | None:
        buf = self._buf
        if self._head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEADER_BYTES:
                    raise HttpProtocolError("response headers too large")
                return None
            lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
            parts = lines[0].split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
                raise HttpProtocolError(f"bad status line {lines[0][:80]!r}")
            headers: dict[str, str] = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            self._head = (int(parts[1]), headers)
            self._body_start = end + 4
        status, headers = self._head
        keep_alive = headers.get("connection", "").lower() != "close"
        body_view = memoryview(buf)[self._body_start :]
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = _dechunk(body_view)
            return None if body is None else _Response(status, headers, body, keep_alive)
        length = headers.get("content-length")
        if length is not None:
            n = int(length)
            if n > MAX_BODY_BYTES:
                raise HttpProtocolError("response body too large")
            if len(body_view) < n:
                return None
            return _Response(status, headers, bytes(body_view[:n]), keep_alive)
        if status in (204, 304) or 100 <= status < 200:
            return _Response(status, headers, b"", keep_alive)
        # No framing: the body runs to the end of the connection.
        return _Response(status, headers, bytes(body_view), False) if eof else None


def _dechunk(view: memoryview) -> bytes | None:
    """Decode a complete chunked body, or None if more bytes are needed."""
    out = bytearray()
    pos = 0
    data = view.tobytes()
    while True:
        line_end = data.find(b"\r\n", pos)
        if line_end < 0:
            return None
        size = int(data[pos:line_end].split(b";", 1)[0].strip() or b"0", 16)
        pos = line_end + 2
        if size == 0:
            # Trailers (usually none) end with an empty line.
            end = data.find(b"\r\n", pos)
            return bytes(out) if end >= 0 else None
        if len(data) < pos + size + 2:
            return None
        out += data[pos : pos + size]
        if len(out) > MAX_BODY_BYTES:
            raise HttpProtocolError("response body too large")
        pos += size + 2


class AdminHttpClient:
    """Pooled keep-alive connections per ``host:port``; one request per connection at a time."""

    def __init__(self, *, max_idle_s: float = 15.0, max_idle_per_host: int = 8):
        self._idle: dict[tuple[str, int], list[_Connection]] = defaultdict(list)
        self._max_idle_s = max_idle_s
        self._max_idle_per_host = max_idle_per_host

    async def request(
        self,
        method: str,
        base_url: str,
        path: str,
        *,
        body: bytes | None,
        headers: dict[str, str],
        timeout_s: float,
        connect_timeout_s: float,
    ) -> tuple[int, bytes]:
        parts = urlsplit(base_url)
        host = parts.hostname or ""
        port = parts.port or 80
        key = (host, port)
        async with asyncio.timeout(timeout_s):
            conn = await self._checkout(key, connect_timeout_s)
            try:
                response = await conn.send(_encode(method, path, parts.netloc, body, headers))
            except BaseException:
                conn.close()
                raise
        self._checkin(key, conn, response.keep_alive)
        return response.status, response.body

    async def _checkout(self, key: tuple[str, int], connect_timeout_s: float) -> _Connection:
        idle = self._idle[key]
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self._max_idle_s:
                return conn
            conn.close()
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(connect_timeout_s):
            _, conn = await loop.create_connection(_Connection, key[0], key[1])
        return conn

    def _checkin(self, key: tuple[str, int], conn: _Connection, keep_alive: bool) -> None:
        idle = self._idle[key]
        if keep_alive and not conn.closed and len(idle) < self._max_idle_per_host:
            conn.idle_since = time.monotonic()
            idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()


def _encode(method: str, path: str, netloc: str, body: bytes | None, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {netloc}"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} contains a line break")
        lines.append(f"{name}: {value}")
    payload = body or b""
    lines.append(f"Content-Length: {len(payload)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload
