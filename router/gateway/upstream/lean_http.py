"""The router's own HTTP/1.1 client for plain-http workers: pooled keep-alive connections.

:class:`~router.gateway.upstream.client.WorkerClient` keeps two of these pools, each with its own
limits: one for proxied generation (``/generate``, the OpenAI routes: bodies streamed as they
arrive; at most ``--max-connections`` in flight) and one for whole answers (the admin fan-out,
health probes, metadata reads, aborts, ``/v1/models``: no bound in flight, since a broadcast is
one request per worker to up to hundreds of workers at once).

Why not the shared aiohttp ``ClientSession``: every request pays its client-side cost on the event
loop (request and response objects, the connector's bookkeeping, a timeout handle, a payload writer
that sends headers and body apart), and on a small machine that is a large share of what the router
spends per proxied request; an admin broadcast to 256 workers is 256 such requests issued at once,
which at aiohttp's ~150-200 us of CPU each alone blows a 50 ms budget. Neither path needs its
features (cookies, redirects, proxies, compression): one request written in one piece on a pooled
connection, a response head, and the body as it arrives, framed by ``Content-Length``, chunked
transfer coding or the end of the connection (parsed by llhttp:
:mod:`router.gateway.upstream.lean_conn`).

Rules that keep it safe:

- a connection carries one request at a time and returns to the pool only after a complete
  response that did not ask to close, with no byte left over (:mod:`~router.gateway.upstream.lean_conn`);
- a pooled connection idle for ``KEEPALIVE_S`` is closed, never reused: it stays below the
  keep-alive timeout of the servers behind workers (uvicorn, under SGLang and vLLM, closes after
  5 s), so a reused connection is not one the worker is closing at that moment;
- nothing is retried here (:mod:`~router.gateway.upstream.transport`);
- the request's deadline covers the whole exchange, connecting and the body included; when it
  passes, or on any error, or when the caller's handler is cancelled, that connection is closed;
- at most ``limit`` requests are in flight at once per pool (0: no bound); more wait their turn,
  within their own deadline; at most ``max_idle_per_host`` idle connections are kept per worker;
- a whole-body read can be capped (:meth:`HttpUpstream.fetch`: ``MAX_BODY_BYTES`` by default): a
  larger answer fails and closes its connection.

``HEAD`` is not sent (llhttp, through ``httptools``, cannot be told that its answer has no body).
``https`` workers go through aiohttp instead (:mod:`router.gateway.upstream.via_aiohttp`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar
from urllib.parse import urlsplit

from router.gateway.upstream import lean_batch
from router.gateway.upstream.lean_batch import Exchange
from router.gateway.upstream.lean_conn import LeanConnection
from router.gateway.upstream.transport import MAX_BODY_BYTES, NotAdmitted, Transport, UpstreamError

__all__ = ["KEEPALIVE_S", "Exchange", "HttpUpstream", "LeanResponse"]

KEEPALIVE_S = 4.0

T = TypeVar("T")


class LeanResponse:
    """A response on one pooled connection; ``release()`` returns the connection or closes it."""

    __slots__ = ("_conn", "_key", "_pool", "_released", "_timer", "status")

    def __init__(self, pool: HttpUpstream, key: tuple[str, int], conn: LeanConnection, timer: asyncio.TimerHandle):
        self._pool = pool
        self._key = key
        self._conn = conn
        self._timer = timer
        self._released = False
        self.status = conn.status

    def header(self, name: str) -> str | None:
        return self._conn.headers.get(name.lower())

    @property
    def headers(self) -> dict[str, str]:
        """The response's headers, names in lower case (a repeated header keeps its last value)."""
        return self._conn.headers

    @property
    def reading_paused(self) -> bool:
        """The worker's connection is not read from: the caller is ``HIGH_WATER`` body bytes behind."""
        return self._conn.reading_paused

    @property
    def complete(self) -> bool:
        """The whole answer has arrived, whether or not the caller has taken it."""
        return self._conn.complete

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
            self._pool.checkin(self._key, self._conn)


class HttpUpstream(Transport):
    """Pooled keep-alive connections per worker ``host:port``, for plain-http workers.

    ``limit``: requests in flight at once (0: no bound); ``max_idle_per_host``: idle connections
    kept per worker (None: no bound beyond what ``limit`` lets open); ``unix_path``: every
    connection goes to this Unix socket (the URL then only names the ``Host`` header).
    """

    def __init__(
        self,
        *,
        limit: int,
        connect_timeout_s: float,
        max_idle_per_host: int | None = None,
        unix_path: str | None = None,
    ):
        self._idle: dict[tuple[str, int], list[LeanConnection]] = {}
        # Connections carrying a request now, per worker: what :meth:`cut` ends.
        self._busy: dict[tuple[str, int], set[LeanConnection]] = {}
        self._slots = asyncio.Semaphore(limit) if limit > 0 else None
        self._waiting = 0
        self._connect_timeout_s = connect_timeout_s
        self._max_idle_per_host = max_idle_per_host
        self._unix_path = unix_path
        """Connect to this Unix socket whatever the URL names (a data plane's relay to its control process)."""
        self._targets: dict[str, tuple[tuple[str, int], str]] = {}
        self._closed = False
        self._swept = time.monotonic()

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot (every one of ``limit`` is in flight)."""
        return self._waiting

    def idle_connections(self, base_url: str) -> list[LeanConnection]:
        """The idle connections pooled for one worker (a copy), reusable or not yet swept."""
        return list(self._idle.get(self.target(base_url)[0], ()))

    def target(self, base_url: str) -> tuple[tuple[str, int], str]:
        target = self._targets.get(base_url)
        if target is None:
            parts = urlsplit(base_url)
            host = parts.hostname or ""
            target = self._targets[base_url] = ((host, parts.port or 80), parts.netloc)
            if len(self._targets) > 4096:  # workers come and go: never grow without bound
                self._targets.clear()
        return target

    async def fetch_all(
        self,
        method: str,
        calls: Sequence[tuple[str, str, bytes | None]],
        headers: dict[str, str],
        *,
        timeout_s: float,
        convert: Callable[[int, Exchange], T],
        max_bytes: int = MAX_BODY_BYTES,
    ) -> list[T]:
        """:meth:`fetch` of many ``(base_url, path, body)`` at once, as a broadcast sends one request per worker,
        under one deadline: ``convert(i, exchange)`` per call, as each answer lands, in order of ``calls``
        (:func:`router.gateway.upstream.lean_batch.fetch_all`)."""
        return await lean_batch.fetch_all(
            self, method, calls, headers, timeout_s=timeout_s, convert=convert, max_bytes=max_bytes
        )

    # -- the pool's bookkeeping, shared with the batch (lean_batch)
    @property
    def bounded(self) -> bool:
        """Requests in flight are bounded (``limit`` > 0): each takes a slot, so none skips the queue."""
        return self._slots is not None

    def mark_busy(self, key: tuple[str, int], conn: LeanConnection) -> None:
        """``conn`` carries a request now (what :meth:`cut` ends)."""
        busy = self._busy.get(key)
        if busy is None:
            busy = self._busy[key] = set()
        busy.add(conn)

    def unmark_busy(self, key: tuple[str, int], conn: LeanConnection) -> None:
        busy = self._busy.get(key)
        if busy is not None:
            busy.discard(conn)
            if not busy:
                del self._busy[key]

    def idle_connection(self, key: tuple[str, int]) -> LeanConnection | None:
        """A pooled connection to ``key`` ready for a request now, or ``None``."""
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.reusable and now - conn.idle_since < KEEPALIVE_S:
                return conn
            conn.close()
        return None

    async def request(
        self,
        method: str,
        base_url: str,
        path: str,
        body: bytes | None,
        headers: dict[str, str],
        *,
        timeout_s: float,
        admit: Callable[[], bool] | None = None,
    ) -> LeanResponse:
        """Send the request and wait for the response head (not the body).

        ``admit`` is asked after the connection is ready and before the request is written (no
        await in between): when it says no, nothing is sent and :class:`NotAdmitted` is raised.

        ``body=None`` sends no body and no ``Content-Length`` (a plain GET). Raises ``OSError``
        (``TimeoutError`` and ``ConnectionError`` included) or :class:`UpstreamError` when no answer
        began; nothing is retried.
        """
        if method == "HEAD":
            raise UpstreamError("HEAD is not supported: its answer's framing cannot be told to the parser")
        key, netloc = self.target(base_url)
        payload = _encode(method, path, netloc, body, headers)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        slots = self._slots
        if slots is not None:
            if slots.locked():  # every slot is taken: wait for one, within this request's deadline
                self._waiting += 1
                try:
                    async with asyncio.timeout_at(deadline):
                        await slots.acquire()
                finally:
                    self._waiting -= 1
            else:
                await slots.acquire()
        try:
            conn = await self._checkout(key, deadline)
            timer = loop.call_at(deadline, conn.expire, f"no complete answer within {timeout_s:g}s")
            self.mark_busy(key, conn)
            try:
                if admit is not None and not admit():
                    raise NotAdmitted(f"{base_url} left routing before the request was sent")
                await conn.send(payload)
            except BaseException:
                timer.cancel()
                self.unmark_busy(key, conn)
                conn.close()
                raise
        except BaseException:
            if self._slots is not None:
                self._slots.release()
            raise
        return LeanResponse(self, key, conn, timer)

    async def _checkout(self, key: tuple[str, int], deadline: float) -> LeanConnection:
        conn = self.idle_connection(key)
        if conn is not None:
            return conn
        loop = asyncio.get_running_loop()
        async with asyncio.timeout_at(min(loop.time() + self._connect_timeout_s, deadline)):
            if self._unix_path is not None:
                _, conn = await loop.create_unix_connection(LeanConnection, self._unix_path)
            else:
                _, conn = await loop.create_connection(LeanConnection, key[0], key[1])
        return conn

    def cut(self, base_url: str, message: str, *, unanswered_only: bool = False) -> int:
        """End every request in flight to one worker now (``unanswered_only``: those whose response head has
        not arrived): whoever waits for its head or body gets :class:`UpstreamError` (``message``). Returns how
        many were cut."""
        key = self.target(base_url)[0]
        busy = self._busy.get(key, set())
        chosen = {conn for conn in busy if not conn.status} if unanswered_only else set(busy)
        busy -= chosen
        if not busy:
            self._busy.pop(key, None)
        for conn in chosen:
            conn.cut(message)
        return len(chosen)

    def checkin(self, key: tuple[str, int], conn: LeanConnection) -> None:
        """``conn``'s exchange is over: pooled again when it can carry another, else closed."""
        self.unmark_busy(key, conn)
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
    return lean_batch.encode_request(method, path, netloc, body, lean_batch.encode_fields(headers))
