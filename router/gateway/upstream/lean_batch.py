"""A broadcast on the lean pool: one whole exchange per worker, all written in one pass.

:func:`fetch_all` is what the admin fan-out costs the router per worker, so it keeps that cost to
the exchange itself: each request that finds an idle pooled connection is written at once; its
connection calls back when the whole answer is in (:meth:`LeanConnection.send_whole`), and the
answer is converted there, while the other workers are still answering. There is no task, future
or timer per worker: one deadline timer and one future serve the whole batch. A call with no idle
connection (the first to a worker) goes through :meth:`HttpUpstream.fetch` on a task of its own.

Invariants:

- every call lands exactly once, in order of ``calls`` in the result: its converted answer, or
  why no answer came (the deadline, a transport failure);
- at the deadline every answer still awaited fails with ``TimeoutError`` and its connection is
  closed; a cancelled caller closes every connection still mid-exchange;
- a fault of ``convert`` is raised once every call has landed (never inside the parser's callback).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Protocol, TypeVar

from router.gateway.upstream.lean_conn import LeanConnection
from router.gateway.upstream.transport import MAX_BODY_BYTES, Transport, UpstreamError

__all__ = ["Exchange", "Pool", "fetch_all"]

T = TypeVar("T")
#: One whole exchange of a batch: ``(status, body, seconds to the answer)``, or why no answer came.
Exchange = tuple[int, bytes, float] | BaseException


class Pool(Transport, Protocol):
    """The pooled connections a batch draws on (:class:`~router.gateway.upstream.lean_http.HttpUpstream`): a
    transport whose idle connections it may take, and give back, itself."""

    @property
    def bounded(self) -> bool: ...

    def target(self, base_url: str) -> tuple[tuple[str, int], str]: ...

    def idle_connection(self, key: tuple[str, int]) -> LeanConnection | None: ...

    def mark_busy(self, key: tuple[str, int], conn: LeanConnection) -> None: ...

    def unmark_busy(self, key: tuple[str, int], conn: LeanConnection) -> None: ...

    def checkin(self, key: tuple[str, int], conn: LeanConnection) -> None: ...


async def fetch_all(
    pool: Pool,
    method: str,
    calls: Sequence[tuple[str, str, bytes | None]],
    headers: dict[str, str],
    *,
    timeout_s: float,
    convert: Callable[[int, Exchange], T],
    max_bytes: int = MAX_BODY_BYTES,
) -> list[T]:
    """``pool.fetch`` of many ``(base_url, path, body)`` at once, under one deadline:
    ``convert(i, exchange)`` per call, as each answer lands, returned in order of ``calls``."""
    if not calls:
        return []
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    results: list[T | None] = [None] * len(calls)
    faults: list[BaseException] = []
    left = len(calls)
    all_in: asyncio.Future[None] = loop.create_future()

    def land(i: int, exchange: Exchange) -> None:
        nonlocal left
        try:
            results[i] = convert(i, exchange)
        except Exception as exc:  # a fault of the caller's conversion: raised once all have landed
            faults.append(exc)
        left -= 1
        if not left and not all_in.done():
            all_in.set_result(None)

    def ended(i: int, key: tuple[str, int], conn: LeanConnection) -> None:
        error = conn.error
        exchange: Exchange = error if error is not None else (conn.status, conn.take(), conn.ended_at - started)
        pool.checkin(key, conn)
        land(i, exchange)

    def fetched(i: int, task: asyncio.Task[tuple[int, bytes]]) -> None:
        if not task.cancelled():
            error = task.exception()
            land(i, error if error is not None else (*task.result(), time.monotonic() - started))

    sent: list[tuple[tuple[str, int], LeanConnection]] = []
    tasks: list[asyncio.Task[tuple[int, bytes]]] = []

    def expire() -> None:
        for _, conn in sent:
            if conn.awaiting_whole:
                conn.expire(f"no complete answer within {timeout_s:g}s")

    timer = loop.call_at(loop.time() + timeout_s, expire)
    encode = _Encoder(method, headers)
    try:
        for i, (base_url, path, body) in enumerate(calls):
            key, netloc = pool.target(base_url)
            conn = pool.idle_connection(key) if not pool.bounded else None
            if conn is None:
                task = loop.create_task(
                    pool.fetch(method, base_url, path, body, headers, timeout_s=timeout_s, max_bytes=max_bytes)
                )
                task.add_done_callback(partial(fetched, i))
                tasks.append(task)
                continue
            try:
                payload = encode(path, netloc, body)
            except UpstreamError as exc:
                pool.checkin(key, conn)
                land(i, exc)
                continue
            pool.mark_busy(key, conn)
            sent.append((key, conn))
            conn.send_whole(payload, max_bytes, partial(ended, i, key, conn))
        await all_in  # each call lands by its answer, its failure or the deadline
    except BaseException:
        for key, conn in sent:
            if conn.awaiting_whole:
                pool.unmark_busy(key, conn)
                conn.abandon()
        for task in tasks:
            task.cancel()
        raise
    finally:
        timer.cancel()
    if faults:
        raise faults[0]
    assert all(r is not None for r in results), "every call's answer lands before the wait ends"
    return results  # type: ignore[return-value]


class _Encoder:
    """The batch's requests: one method and one set of headers, checked and encoded once; per worker only
    the request line, ``Host`` and the body's length differ."""

    __slots__ = ("_fields", "_method", "_refused")

    def __init__(self, method: str, headers: dict[str, str]):
        self._method = method
        self._fields = b""
        self._refused: UpstreamError | None = None
        try:
            self._fields = encode_fields(headers)
        except UpstreamError as exc:  # every call of the batch fails with it, as each would alone
            self._refused = exc

    def __call__(self, path: str, netloc: str, body: bytes | None) -> bytes:
        if self._refused is not None:
            raise self._refused
        return encode_request(self._method, path, netloc, body, self._fields)


def encode_fields(headers: dict[str, str]) -> bytes:
    """The header lines of ``headers`` (a line break in a name or value is refused: :class:`UpstreamError`)."""
    lines = ""
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise UpstreamError(f"header {name!r} contains a line break")
        lines += f"{name}: {value}\r\n"
    return lines.encode("latin-1")


def encode_request(method: str, path: str, netloc: str, body: bytes | None, fields: bytes) -> bytes:
    """One HTTP/1.1 request in one piece: its line, ``Host``, ``Content-Length`` when there is a body,
    the header lines ``fields`` (:func:`encode_fields`) and the body."""
    if "\r" in path or "\n" in path:
        raise UpstreamError("the request path contains a line break")
    if body is None:
        return f"{method} {path} HTTP/1.1\r\nHost: {netloc}\r\n".encode("latin-1") + fields + b"\r\n"
    head = f"{method} {path} HTTP/1.1\r\nHost: {netloc}\r\nContent-Length: {len(body)}\r\n".encode("latin-1")
    return head + fields + b"\r\n" + body
