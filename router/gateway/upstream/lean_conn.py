"""One keep-alive HTTP/1.1 connection to a worker, its responses parsed by llhttp.

llhttp (through ``httptools``, the parser under uvicorn) fills the head and hands over the body;
what it does not do is bound the head's size (:data:`MAX_HEAD_BYTES` here) and end a body framed
by the connection's end (llhttp's EOF call is not exposed: ``connection_lost`` completes it).

Invariants:

- one request at a time: :meth:`LeanConnection.send` resets the parser state of the previous
  exchange, and the pool (:mod:`router.gateway.upstream.lean_http`) hands a connection out only
  after a complete response that did not ask to close (llhttp's ``should_keep_alive``);
- any byte after a complete response, then or while pooled, is a second message llhttp begins or
  refuses, and closes the connection (empty lines aside, which HTTP/1.1 lets a parser skip between
  messages);
- flow control: more than :data:`HIGH_WATER` body bytes buffered ahead of the reader pauses
  reading from the socket; taking them (:meth:`LeanConnection.take`) resumes it;
- a failure (malformed answer, closed connection, the deadline) is stored once and raised to
  whoever waits for the head or the body.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httptools

from router.gateway.upstream.transport import UpstreamError

MAX_HEAD_BYTES = 64 * 1024
#: ``Content-Length`` and ``Transfer-Encoding``: a whole answer keeps only headers of these name lengths,
#: which :meth:`LeanConnection.connection_lost` needs to tell a body framed by the connection's end.
FRAMING_NAME_LENGTHS = frozenset((len("content-length"), len("transfer-encoding")))
#: Body bytes buffered ahead of a slow caller before the router stops reading from the worker.
HIGH_WATER = 1024 * 1024


class LeanConnection(asyncio.Protocol):
    """One TCP connection to a worker; llhttp (``httptools``) parses one response per request."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._head_waiter: asyncio.Future[None] | None = None
        self._body_waiter: asyncio.Future[None] | None = None
        self._on_end: Callable[[], None] | None = None
        """Set by :meth:`send_whole`: called once, when the whole answer is in or failed; the body is not
        read before then, so it is bounded here rather than by the reader's pace."""
        self._whole_limit = 0
        """A whole answer's bound (:meth:`send_whole`); 0 while the body is read as it comes (:meth:`send`)."""
        self.ended_at = 0.0
        """When the answer awaited by :meth:`send_whole` was in (or failed), on ``time.monotonic()``."""
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
            if self._head_waiter is not None or self._on_end is not None:
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
        if self.status:  # trailers
            return
        if self._whole_limit and len(name) not in FRAMING_NAME_LENGTHS:
            return  # a whole answer's reader wants its status and body: only the framing headers are kept
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1").rstrip()  # llhttp keeps trailing blanks

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
        if self._whole_limit:
            if self._buffered > self._whole_limit:
                self._broken(UpstreamError(f"the worker's answer is larger than {self._whole_limit} bytes"))
            return
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake_body()

    def on_message_complete(self) -> None:
        if self.status:  # not an interim answer's end
            self.complete = True
            self._wake_body()
            self._ended()

    # -- one exchange
    @property
    def reading_paused(self) -> bool:
        """Reading from the socket is paused: the reader is :data:`HIGH_WATER` body bytes behind."""
        return self._paused

    @property
    def reusable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def send(self, payload: bytes) -> asyncio.Future[None]:
        assert self.transport is not None
        self._reset()
        self._on_end = None
        self._whole_limit = 0
        self._head_waiter = asyncio.get_running_loop().create_future()
        self.transport.write(payload)
        return self._head_waiter

    def send_whole(self, payload: bytes, max_bytes: int, on_end: Callable[[], None]) -> None:
        """Send a request whose answer is wanted whole: ``on_end()`` is called once, from the event loop's
        callbacks, when all of it is in (``status``, the body then :meth:`take`) or it failed (``error``); a
        body over ``max_bytes`` fails it and closes the connection. Of the headers only the framing ones
        are kept. No future and no task: a broadcast sends hundreds of these at once."""
        assert self.transport is not None
        self._reset()
        self._head_waiter = None
        self._on_end = on_end
        self._whole_limit = max(1, max_bytes)
        self.transport.write(payload)

    @property
    def awaiting_whole(self) -> bool:
        """A :meth:`send_whole` answer is still awaited (its ``on_end`` not yet called)."""
        return self._on_end is not None

    def abandon(self) -> None:
        """The caller of :meth:`send_whole` no longer waits (cancelled): ``on_end`` is never called, and the
        connection, mid-exchange, is closed."""
        self._on_end = None
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def cut(self, message: str) -> None:
        """The router gave up on this worker (its health checks say it is dead): fail whatever waits, and close."""
        self._broken(UpstreamError(message))

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
        self._ended()

    def _ended(self) -> None:
        end = self._on_end
        if end is not None:
            self._on_end = None
            self.ended_at = time.monotonic()
            end()

    def _wake_body(self) -> None:
        waiter = self._body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
