"""The router's one HTTP/1.1 client for plain-http workers: pooled keep-alive connections.

Both layers that talk to workers use it, each with its own pool and limits: the proxy
(``routing/upstream.py``: ``/generate`` and the OpenAI routes, bodies streamed as they arrive) and
the admin fan-out (``admin/fanout.py``: one small request and whole answer per worker, to up to
hundreds of workers at once).

Why not the shared aiohttp ``ClientSession``: every request pays its client-side cost on the event
loop (request and response objects, the connector's bookkeeping, a timeout handle, a payload writer
that sends headers and body apart), and on a small machine that is a large share of what the router
spends per proxied request; an admin broadcast to 256 workers is 256 such requests issued at once,
which at aiohttp's ~150-200 us of CPU each alone blows a 50 ms budget. Neither path needs its
features (cookies, redirects, proxies, compression): one request written in one piece on a pooled
connection, a response head, and the body as it arrives, framed by ``Content-Length``, chunked
transfer coding or the end of the connection. Responses are parsed by llhttp, through ``httptools``
(the parser under uvicorn): its callbacks fill the head and hand over the body; what it does not do
is bound the head's size (``MAX_HEAD_BYTES`` here) and end a body framed by the connection's end
(llhttp's EOF call is not exposed: ``connection_lost`` completes it).

Rules that keep it safe:

- a connection carries one request at a time and returns to the pool only after a complete
  response that did not ask to close (llhttp's ``should_keep_alive``), with no byte left over:
  any byte after a complete response, then or while pooled, is a second message llhttp begins or
  refuses, and closes the connection (empty lines aside, which HTTP/1.1 lets a parser skip between
  messages);
- a pooled connection idle for ``KEEPALIVE_S`` is closed, never reused: it stays below the
  keep-alive timeout of the servers behind workers (uvicorn, under SGLang and vLLM, closes after
  5 s), so a reused connection is not one the worker is closing at that moment;
- nothing is retried here: the proxy's policy decides (another worker, before any byte reached
  the caller), and admin calls are never retried at all (a second ``update_weights_*`` could apply
  twice);
- the request's deadline covers the whole exchange, connecting and the body included; when it
  passes, or on any error, or when the caller's handler is cancelled, that connection is closed;
- at most ``limit`` requests are in flight at once per client (``--max-connections`` for the
  proxy; unbounded for the fan-out, whose broadcast is one request per worker); more wait their turn;
  at most ``max_idle_per_host`` idle connections are kept per worker;
- a whole-body read can be capped (:meth:`HttpUpstream.fetch`: ``MAX_BODY_BYTES`` by default): a
  larger answer fails and closes its connection.

``HEAD`` is not sent (llhttp, through ``httptools``, cannot be told that its answer has no body).
``https`` workers go through aiohttp instead (``routing/upstream.py``'s ``AiohttpUpstream``; the
fan-out's own aiohttp call).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from urllib.parse import urlsplit

import httptools

MAX_HEAD_BYTES = 64 * 1024
#: The default cap of a whole-body read (:meth:`HttpUpstream.fetch`).
MAX_BODY_BYTES = 64 * 1024 * 1024
#: Body bytes buffered ahead of a slow caller before the router stops reading from the worker.
HIGH_WATER = 1024 * 1024
KEEPALIVE_S = 4.0


class UpstreamError(Exception):
    """The worker's connection failed after its answer began, or it did not speak HTTP/1.1."""


class _Connection(asyncio.Protocol):
    """One TCP connection to a worker; llhttp (``httptools``) parses one response per request."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._head_waiter: asyncio.Future[None] | None = None
        self._body_waiter: asyncio.Future[None] | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = False
        self.complete = False
        self.error: BaseException | None = None
        self._head_bytes = 0
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._broken(UpstreamError("the worker switched protocols"))
        except httptools.HttpParserError as exc:
            # Before the answer is complete it is malformed; after it, these are bytes left over
            # (on_message_begin refused a second answer): either way the connection is done.
            self._broken(UpstreamError(f"the worker's answer is not valid HTTP/1.1: {exc}"))
        else:
            if not self.status:  # still in the head: llhttp sets no bound on its size
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES:
                    self._broken(UpstreamError("the worker's response head is too large"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.complete or self.error is not None:
            return
        if not self.status:
            if self._head_waiter is not None:
                self._fail(exc or ConnectionResetError("the worker closed the connection before answering"))
        elif exc is None and "content-length" not in self.headers and "transfer-encoding" not in self.headers:
            self.on_message_complete()  # a body framed by the end of the connection ends here (llhttp has no EOF call)
        else:
            self._fail(UpstreamError(f"the worker's connection closed mid-answer: {exc or 'end of stream'}"))

    # -- llhttp's callbacks
    def on_message_begin(self) -> None:
        if self.complete:
            raise UpstreamError("bytes after a complete answer")

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.status:  # not trailers
            self.headers[name.decode("latin-1").lower()] = value.decode(
                "latin-1"
            ).rstrip()  # llhttp keeps trailing blanks

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:  # an interim answer (100 Continue): the real one follows
            self.headers = {}
            return
        self.status = status
        self.keep_alive = self._parser.should_keep_alive()
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def on_body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake_body()

    def on_message_complete(self) -> None:
        if self.status:  # not an interim answer's end
            self.complete = True
            self._wake_body()

    # -- one exchange
    @property
    def reusable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def send(self, payload: bytes) -> asyncio.Future[None]:
        assert self.transport is not None
        self._reset()
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

    def _broken(self, exc: UpstreamError) -> None:
        self._fail(exc)
        self.close()

    def _fail(self, exc: BaseException) -> None:
        if self.error is None and not self.complete:
            self.error = exc
        for waiter in (self._head_waiter, self._body_waiter):
            if waiter is not None and not waiter.done():
                waiter.set_exception(exc)

    def _wake_body(self) -> None:
        waiter = self._body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class LeanResponse:
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

    async def read(self, max_bytes: int | None = None) -> bytes:
        """The whole body; past ``max_bytes`` it raises :class:`UpstreamError` and the connection closes."""
        conn = self._conn
        declared = conn.headers.get("content-length")
        if max_bytes is not None and declared is not None and declared.isdigit() and int(declared) > max_bytes:
            conn.close()
            raise UpstreamError(f"the worker's answer is larger than {max_bytes} bytes")
        parts: list[bytes] = []
        size = 0
        while True:
            if conn.has_data():
                part = conn.take()  # taken as it comes, so a large body never stalls on the high water
                size += len(part)
                if max_bytes is not None and size > max_bytes:
                    conn.close()
                    raise UpstreamError(f"the worker's answer is larger than {max_bytes} bytes")
                parts.append(part)
            if conn.complete:
                break
            if conn.error is not None:
                raise conn.error
            await conn.wait_body()
        return parts[0] if len(parts) == 1 else b"".join(parts)

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
    """Pooled keep-alive connections per worker ``host:port``, for plain-http workers.

    ``limit``: requests in flight at once (0: no bound); ``max_idle_per_host``: idle connections
    kept per worker (None: no bound beyond what ``limit`` lets open).
    """

    def __init__(self, *, limit: int, connect_timeout_s: float, max_idle_per_host: int | None = None):
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._slots = asyncio.Semaphore(limit) if limit > 0 else None
        self._connect_timeout_s = connect_timeout_s
        self._max_idle_per_host = max_idle_per_host
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

    def post(
        self, base_url: str, path: str, body: bytes, headers: dict[str, str], *, timeout_s: float
    ) -> Awaitable[LeanResponse]:
        """``request("POST", ...)``."""
        return self.request("POST", base_url, path, body, headers, timeout_s=timeout_s)

    async def fetch(
        self,
        method: str,
        base_url: str,
        path: str,
        body: bytes | None,
        headers: dict[str, str],
        *,
        timeout_s: float,
        max_bytes: int = MAX_BODY_BYTES,
    ) -> tuple[int, bytes]:
        """One whole exchange: ``(status, body)``, the body at most ``max_bytes``; the deadline covers it all.

        Raises as :meth:`request` does, and :class:`UpstreamError` or ``TimeoutError`` while reading.
        """
        resp = await self.request(method, base_url, path, body, headers, timeout_s=timeout_s)
        try:
            return resp.status, await resp.read(max_bytes)
        finally:
            resp.release()

    async def request(
        self,
        method: str,
        base_url: str,
        path: str,
        body: bytes | None,
        headers: dict[str, str],
        *,
        timeout_s: float,
    ) -> LeanResponse:
        """Send the request and wait for the response head (not the body).

        ``body=None`` sends no body and no ``Content-Length`` (a plain GET). Raises ``OSError``
        (``TimeoutError`` and ``ConnectionError`` included) or :class:`UpstreamError` when no answer
        began; nothing is retried.
        """
        if method == "HEAD":
            raise UpstreamError("HEAD is not supported: its answer's framing cannot be told to the parser")
        key, netloc = self._target(base_url)
        payload = _encode(method, path, netloc, body, headers)
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
            conn = await self._checkout(key, deadline)
            timer = loop.call_at(deadline, conn.expire, f"no complete answer within {timeout_s:g}s")
            try:
                await conn.send(payload)
            except BaseException:
                timer.cancel()
                conn.close()
                raise
        except BaseException:
            if self._slots is not None:
                self._slots.release()
            raise
        return LeanResponse(self, key, conn, timer)

    async def _checkout(self, key: tuple[str, int], deadline: float) -> _Connection:
        idle = self._idle.get(key)
        if idle:
            now = time.monotonic()
            while idle:
                conn = idle.pop()
                if conn.reusable and now - conn.idle_since < KEEPALIVE_S:
                    return conn
                conn.close()
        loop = asyncio.get_running_loop()
        async with asyncio.timeout_at(min(loop.time() + self._connect_timeout_s, deadline)):
            _, conn = await loop.create_connection(_Connection, key[0], key[1])
        return conn

    def _checkin(self, key: tuple[str, int], conn: _Connection) -> None:
        if self._slots is not None:
            self._slots.release()
        now = time.monotonic()
        if conn.complete and conn.keep_alive and conn.error is None and conn.reusable and not self._closed:
            idle = self._idle.get(key)
            if idle is None:
                idle = self._idle[key] = []
            if self._max_idle_per_host is None or len(idle) < self._max_idle_per_host:
                conn.idle_since = now
                idle.append(conn)
            else:
                conn.close()
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


def _encode(method: str, path: str, netloc: str, body: bytes | None, headers: dict[str, str]) -> bytes:
    if "\r" in path or "\n" in path:
        raise UpstreamError("the request path contains a line break")
    head = f"{method} {path} HTTP/1.1\r\nHost: {netloc}\r\n"
    if body is not None:
        head += f"Content-Length: {len(body)}\r\n"
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise UpstreamError(f"header {name!r} contains a line break")
        head += f"{name}: {value}\r\n"
    raw = (head + "\r\n").encode("latin-1")
    return raw + body if body else raw
