"""The ``/generate`` path's HTTP client: keep-alive HTTP/1.1 connections to plain-http workers.

Why not the shared aiohttp ``ClientSession``: every generation request pays its client-side cost
on the event loop (request and response objects, the connector's bookkeeping, a timeout handle,
a payload writer that sends headers and body apart), and on a small machine that is a large share
of what the router spends per request. A proxied ``/generate`` needs none of its features
(cookies, redirects, proxies, compression): one POST written in one piece on a pooled connection,
a response head, and the body as it arrives, framed by ``Content-Length``, chunked transfer
coding or the end of the connection.

Rules that keep it safe:

- a connection carries one request at a time and returns to the pool only after a complete
  response that did not ask to close, with no byte left over;
- a pooled connection idle for ``KEEPALIVE_S`` is closed, never reused: it stays below the
  keep-alive timeout of the servers behind workers (uvicorn, under SGLang and vLLM, closes after
  5 s), so a reused connection is not one the worker is closing at that moment;
- nothing is retried here: the proxy's policy decides (another worker, before any byte reached
  the caller);
- the request's deadline covers the whole exchange, body included; when it passes, or on any
  error, or when the caller's handler is cancelled, that connection is closed;
- at most ``limit`` requests are in flight at once (``--max-connections``); more wait their turn.

``https`` workers go through aiohttp (:class:`AiohttpUpstream`), behind the same interface.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Protocol
from urllib.parse import urlsplit

import aiohttp

MAX_HEAD_BYTES = 64 * 1024
#: Body bytes buffered ahead of a slow caller before the router stops reading from the worker.
HIGH_WATER = 1024 * 1024
KEEPALIVE_S = 4.0
STREAM_CHUNK = 64 * 1024


class UpstreamError(Exception):
    """The worker's connection failed after its answer began, or it did not speak HTTP/1.1."""


class UpstreamResponse(Protocol):
    """A worker's answer: the head at once, the body as it arrives; ``release()`` when done with it."""

    status: int

    def header(self, name: str) -> str | None:
        """A response header (case-insensitive name)."""
        ...

    async def read(self) -> bytes:
        """The whole body. Raises :class:`UpstreamError` or ``TimeoutError``."""
        ...

    def chunks(self) -> AsyncIterator[bytes]:
        """The body piece by piece as it arrives. Raises :class:`UpstreamError` or ``TimeoutError``."""
        ...

    def release(self) -> None: ...


def mime_type(content_type: str | None) -> str:
    """``application/json; charset=utf-8`` → ``application/json`` (aiohttp's default when absent)."""
    if not content_type:
        return "application/octet-stream"
    return content_type.partition(";")[0].strip().lower()


# ----------------------------------------------------------------------------- the lean client

_LENGTH, _CHUNKED, _UNTIL_CLOSE, _NONE = range(4)
_SIZE, _DATA, _DATA_END, _TRAILER = range(4)


class _Connection(asyncio.Protocol):
    """One TCP connection to a worker; parses one response per request."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._buf = bytearray()
        self._head_waiter: asyncio.Future[None] | None = None
        self._body_waiter: asyncio.Future[None] | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = True
        self.complete = False
        self.error: BaseException | None = None
        self.leftover = False
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._framing = _NONE
        self._remaining = 0
        self._chunk_state = _SIZE
        self._in_head = True

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._buf += data
            try:
                if not self._parse_head():
                    return
            except UpstreamError as exc:
                self._fail(exc)
                self.close()
                return
            rest = bytes(self._buf)
            self._buf.clear()
            self._wake_head()
            if rest:
                self._feed(rest)
        elif self.complete or self.error is not None:
            self.leftover = True  # bytes after a complete answer: this connection is not reused
        else:
            self._feed(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._in_head:
            if self._head_waiter is not None:
                self._fail(exc or ConnectionResetError("the worker closed the connection before answering"))
            return
        if self.complete or self.error is not None:
            return
        if self._framing == _UNTIL_CLOSE and exc is None:
            self._finish()
        else:
            self._fail(UpstreamError(f"the worker's connection closed mid-answer: {exc or 'end of stream'}"))

    # -- one exchange
    @property
    def reusable(self) -> bool:
        return not self.closed and not self.leftover and self.transport is not None and not self.transport.is_closing()

    def send(self, payload: bytes) -> asyncio.Future[None]:
        assert self.transport is not None
        self._reset()
        self._buf.clear()
        self._head_waiter = asyncio.get_running_loop().create_future()
        self.transport.write(payload)
        return self._head_waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def expire(self, message: str) -> None:
        """The request's deadline passed: fail whatever waits, and close."""
        self._fail(TimeoutError(message))
        self.close()

    def take(self) -> bytes:
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()
        return data

    def has_data(self) -> bool:
        return bool(self._chunks)

    def wait_body(self) -> asyncio.Future[None]:
        self._body_waiter = asyncio.get_running_loop().create_future()
        return self._body_waiter

    # -- parsing
    def _parse_head(self) -> bool:
        buf = self._buf
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    raise UpstreamError("the worker's response head is too large")
                return False
            lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
            del buf[: end + 4]
            version, _, rest = lines[0].partition(" ")
            code = rest[:3]
            if not version.startswith("HTTP/1.") or not code.isdigit():
                raise UpstreamError(f"bad status line from the worker: {lines[0][:80]!r}")
            status = int(code)
            if 100 <= status < 200:
                continue  # an interim answer (100 Continue): the real one follows
            headers: dict[str, str] = {}
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if not sep:
                    raise UpstreamError(f"bad header line from the worker: {line[:80]!r}")
                headers[name.strip().lower()] = value.strip()
            break
        self.status = status
        self.headers = headers
        connection = headers.get("connection", "").lower()
        self.keep_alive = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
        self._in_head = False
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._framing = _CHUNKED
        elif "content-length" in headers:
            try:
                self._remaining = int(headers["content-length"])
            except ValueError:
                raise UpstreamError(f"bad Content-Length from the worker: {headers['content-length'][:40]!r}") from None
            if self._remaining < 0:
                raise UpstreamError("negative Content-Length from the worker")
            self._framing = _LENGTH
            if self._remaining == 0:
                self._finish()
        elif status in (204, 304):
            self._finish()
        else:
            self._framing = _UNTIL_CLOSE
            self.keep_alive = False
        return True

    def _feed(self, data: bytes) -> None:
        if self._framing == _LENGTH:
            if len(data) >= self._remaining:
                if len(data) > self._remaining:
                    self.leftover = True
                self._deliver(data[: self._remaining] if self.leftover else data)
                self._remaining = 0
                self._finish()
            else:
                self._remaining -= len(data)
                self._deliver(data)
        elif self._framing == _CHUNKED:
            self._buf += data
            try:
                self._dechunk()
            except UpstreamError as exc:
                self._fail(exc)
                self.close()
        else:  # until the connection closes
            self._deliver(data)

    def _dechunk(self) -> None:
        buf = self._buf
        while buf and not self.complete:
            if self._chunk_state == _SIZE:
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > 4096:
                        raise UpstreamError("bad chunk size line from the worker")
                    return
                field = bytes(buf[:end]).split(b";", 1)[0].strip()
                try:
                    size = int(field, 16)
                except ValueError:
                    raise UpstreamError(f"bad chunk size from the worker: {field[:20]!r}") from None
                del buf[: end + 2]
                if size == 0:
                    self._chunk_state = _TRAILER
                else:
                    self._remaining = size
                    self._chunk_state = _DATA
            elif self._chunk_state == _DATA:
                take = min(self._remaining, len(buf))
                self._deliver(bytes(buf[:take]))
                del buf[:take]
                self._remaining -= take
                if self._remaining == 0:
                    self._chunk_state = _DATA_END
            elif self._chunk_state == _DATA_END:
                if len(buf) < 2:
                    return
                if buf[:2] != b"\r\n":
                    raise UpstreamError("a chunk from the worker does not end with CRLF")
                del buf[:2]
                self._chunk_state = _SIZE
            else:  # trailers, each a line, ended by an empty line
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD_BYTES:
                        raise UpstreamError("the worker's trailers are too large")
                    return
                del buf[: end + 2]
                if end == 0:
                    if buf:
                        self.leftover = True
                    buf.clear()
                    self._finish()

    def _deliver(self, data: bytes) -> None:
        if not data:
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake_body()

    def _finish(self) -> None:
        self.complete = True
        self._wake_body()

    def _fail(self, exc: BaseException) -> None:
        if self.error is None and not self.complete:
            self.error = exc
        for waiter in (self._head_waiter, self._body_waiter):
            if waiter is not None and not waiter.done():
                waiter.set_exception(exc)

    def _wake_head(self) -> None:
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake_body(self) -> None:
        waiter = self._body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _LeanResponse:
    """A response on one pooled connection; ``release()`` returns the connection or closes it."""

    __slots__ = ("_conn", "_key", "_pool", "_released", "_timer", "status")

    def __init__(self, pool: HttpUpstream, key: tuple[str, int], conn: _Connection, timer: asyncio.TimerHandle):
        self._pool = pool
        self._key = key
        self._conn = conn
        self._timer = timer
        self._released = False
        self.status = conn.status

    def header(self, name: str) -> str | None:
        return self._conn.headers.get(name.lower())

    async def read(self) -> bytes:
        conn = self._conn
        parts: list[bytes] = []
        while True:
            if conn.has_data():
                parts.append(conn.take())  # taken as it comes, so a large body never stalls on the high water
            if conn.complete:
                break
            if conn.error is not None:
                raise conn.error
            await conn.wait_body()
        if len(parts) == 1:
            return parts[0]
        return b"".join(parts)

    async def chunks(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            if conn.has_data():
                yield conn.take()
            elif conn.complete:
                return
            elif conn.error is not None:
                raise conn.error
            else:
                await conn.wait_body()

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._timer.cancel()
            self._pool._checkin(self._key, self._conn)


class HttpUpstream:
    """Pooled keep-alive connections per worker ``host:port``, for plain-http workers."""

    def __init__(self, *, limit: int, connect_timeout_s: float):
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._slots = asyncio.Semaphore(limit) if limit > 0 else None
        self._connect_timeout_s = connect_timeout_s
        self._targets: dict[str, tuple[tuple[str, int], str]] = {}
        self._closed = False
        self._swept = time.monotonic()

    def _target(self, base_url: str) -> tuple[tuple[str, int], str]:
        target = self._targets.get(base_url)
        if target is None:
            parts = urlsplit(base_url)
            host = parts.hostname or ""
            target = self._targets[base_url] = ((host, parts.port or 80), parts.netloc)
            if len(self._targets) > 4096:  # workers come and go: never grow without bound
                self._targets.clear()
        return target

    async def post(
        self, base_url: str, path: str, body: bytes, headers: dict[str, str], *, timeout_s: float
    ) -> UpstreamResponse:
        """Send the request and wait for the response head (not the body).

        Raises ``OSError`` (``TimeoutError`` and ``ConnectionError`` included) or :class:`UpstreamError`
        when no answer began; nothing is retried.
        """
        key, netloc = self._target(base_url)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        slots = self._slots
        if slots is not None:
            if slots.locked():  # every slot is taken: wait for one, within this request's deadline
                async with asyncio.timeout_at(deadline):
                    await slots.acquire()
            else:
                await slots.acquire()
        try:
            conn = await self._checkout(key)
            timer = loop.call_at(deadline, conn.expire, f"no complete answer within {timeout_s:g}s")
            try:
                await conn.send(_encode(path, netloc, body, headers))
            except BaseException:
                timer.cancel()
                conn.close()
                raise
        except BaseException:
            if self._slots is not None:
                self._slots.release()
            raise
        return _LeanResponse(self, key, conn, timer)

    async def _checkout(self, key: tuple[str, int]) -> _Connection:
        idle = self._idle.get(key)
        if idle:
            now = time.monotonic()
            while idle:
                conn = idle.pop()
                if conn.reusable and now - conn.idle_since < KEEPALIVE_S:
                    return conn
                conn.close()
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self._connect_timeout_s):
            _, conn = await loop.create_connection(_Connection, key[0], key[1])
        return conn

    def _checkin(self, key: tuple[str, int], conn: _Connection) -> None:
        if self._slots is not None:
            self._slots.release()
        now = time.monotonic()
        if conn.complete and conn.keep_alive and conn.error is None and conn.reusable and not self._closed:
            conn.idle_since = now
            self._idle.setdefault(key, []).append(conn)
        else:
            conn.close()
        if now - self._swept > KEEPALIVE_S:
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Close what idled out, here and for workers that get no more requests (removed ones)."""
        self._swept = now
        for key, idle in list(self._idle.items()):
            keep = [c for c in idle if c.reusable and now - c.idle_since < KEEPALIVE_S]
            for conn in idle:
                if conn not in keep:
                    conn.close()
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]

    def close(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()


def _encode(path: str, netloc: str, body: bytes, headers: dict[str, str]) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: {netloc}\r\nContent-Length: {len(body)}\r\n"
    for name, value in headers.items():
        if "\r" in value or "\n" in value:
            raise UpstreamError(f"header {name!r} contains a line break")
        head += f"{name}: {value}\r\n"
    return (head + "\r\n").encode("latin-1") + body


# ----------------------------------------------------------------------------- https workers


class _AiohttpResponse:
    __slots__ = ("_resp", "status")

    def __init__(self, resp: aiohttp.ClientResponse):
        self._resp = resp
        self.status = resp.status

    def header(self, name: str) -> str | None:
        return self._resp.headers.get(name)

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from None

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_chunked(STREAM_CHUNK):
                yield chunk
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from None

    def release(self) -> None:
        self._resp.release()


class AiohttpUpstream:
    """The same interface over the shared aiohttp session (``https`` workers)."""

    def __init__(self, session: aiohttp.ClientSession, *, connect_timeout_s: float):
        self._session = session
        self._connect_timeout_s = connect_timeout_s

    async def post(
        self, base_url: str, path: str, body: bytes, headers: dict[str, str], *, timeout_s: float
    ) -> UpstreamResponse:
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self._connect_timeout_s)
        try:
            resp = await self._session.post(base_url + path, data=body, headers=headers, timeout=timeout)
        except aiohttp.ClientConnectionError as exc:
            raise ConnectionError(f"{type(exc).__name__}: {exc}") from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from None
        return _AiohttpResponse(resp)


class Upstreams:
    """The lean client for ``http://`` workers, aiohttp for the rest."""

    def __init__(self, session: aiohttp.ClientSession, *, limit: int, connect_timeout_s: float):
        self.http = HttpUpstream(limit=limit, connect_timeout_s=connect_timeout_s)
        self.other = AiohttpUpstream(session, connect_timeout_s=connect_timeout_s)

    async def post(
        self, base_url: str, path: str, body: bytes, headers: dict[str, str], *, timeout_s: float
    ) -> UpstreamResponse:
        client = self.http if base_url.startswith("http://") else self.other
        return await client.post(base_url, path, body, headers, timeout_s=timeout_s)

    def close(self) -> None:
        self.http.close()
