"""A caller's connection handed from a data plane to the control process, so that its admin calls skip the relay.

Admin calls run in the control process (:mod:`.forward`). Relayed, each one crosses a second HTTP exchange
(data plane → control process → data plane), which on a small machine is a fifth of what a broadcast to 64
workers costs the caller. A trainer sends its admin calls on one keep-alive connection, so the first relayed
call hands the connection itself over instead: the data plane passes the socket (``SCM_RIGHTS``) with the
request it read, re-framed, and the control process serves that connection from then on, as the single
process does (it serves every route, generation included). Its later calls reach the control process directly.

Rules that keep it safe (else the call is relayed as before, and nothing is lost):

- only a plain-TCP HTTP/1.1 keep-alive connection with no second request read behind the first, whose body
  came whole and not content-coded, and at most :data:`MAX_HANDED_BYTES` re-framed;
- the data plane stops reading the socket before handing it over and never reads it again: every byte after
  the request is the control process's to read (the kernel keeps them for whoever reads the socket);
- the hand-over is one datagram on a ``SOCK_SEQPACKET`` Unix socket: it arrives whole or not at all; when it
  cannot be sent now (the control process is busy or gone) the request is relayed instead;
- the data plane then closes its own descriptor without a word on the connection (the control process holds
  the other, so the connection stays open), and its HTTP server drops the connection quietly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)

#: The request as re-framed for the control process, at most (a larger one is relayed).
MAX_HANDED_BYTES = 60 * 1024
#: Headers that the re-framed request sets itself or that concern the hop to the data plane only.
_REFRAMED = frozenset(("content-length", "transfer-encoding", "connection", "keep-alive", "expect"))
#: How many hand-overs the control process takes at once from one data plane before the rest wait in the socket.
_RECEIVE_BATCH = 16


def handoff_path(control_socket: str) -> str:
    """The control process's hand-over socket, beside its HTTP socket (same private directory)."""
    return os.path.join(os.path.dirname(control_socket), "handoff.sock")


# ----------------------------------------------------------------------------- the data plane's side


class ConnectionHandoff:
    """A data plane's sender: hands a caller's connection and its first request to the control process.

    ``paths``: the routes whose ``POST`` hands its connection over (the admin operations a trainer sends);
    any other relayed call (a read, a probe, a scrape) is relayed and its connection stays here."""

    def __init__(self, path: str, paths: frozenset[str], on_handed: Callable[[], None] = lambda: None):
        self._path = path
        self._paths = paths
        self._on_handed = on_handed
        self._sock: socket.socket | None = None

    def hand_over(self, request: web.Request, body: bytes) -> bool:
        """Hand ``request``'s connection to the control process; False (nothing done) when it cannot be."""
        if request.method != "POST" or request.path not in self._paths:
            return False
        raw = _reframed(request, body)
        if raw is None:
            return False
        transport = request.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if transport is None or sock is None or transport.is_closing():
            return False
        channel = self._channel()
        if channel is None:
            return False
        # No await from here on: nothing can read the socket between the pause and the close.
        transport.pause_reading()
        fd = os.dup(sock.fileno())
        try:
            socket.send_fds(channel, [raw], [fd])
        except OSError as exc:  # BlockingIOError: the control process is behind; others: it is gone
            transport.resume_reading()
            if not isinstance(exc, BlockingIOError):
                log.info("handing a connection to the control process failed (%s); relaying instead", exc)
                self._close_channel()
            return False
        finally:
            os.close(fd)
        self._on_handed()
        # The control process holds the connection now: drop ours without a byte (aiohttp's write of the
        # handler's answer then finds the transport closing and ends the connection quietly).
        request.protocol.force_close()
        transport.close()
        return True

    def _channel(self) -> socket.socket | None:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                sock.connect(self._path)
            except OSError:
                sock.close()
                return None
            sock.setblocking(False)
            self._sock = sock
        return self._sock

    def _close_channel(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        self._close_channel()


def _reframed(request: web.Request, body: bytes) -> bytes | None:
    """The request as the control process's HTTP server reads it, or None when it must be relayed."""
    if request.version != (1, 1) or not request.keep_alive or request.transport is None:
        return None
    if request.transport.get_extra_info("sslcontext") is not None or "Content-Encoding" in request.headers:
        return None
    if not request.content.is_eof() or _pipelined(request):
        return None
    lines = [f"{request.method} {request.raw_path} HTTP/1.1\r\n".encode("latin-1")]
    for name, value in request.raw_headers:
        if name.decode("latin-1").lower() not in _REFRAMED:
            lines.append(name + b": " + value + b"\r\n")
    if body or request.method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
        lines.append(b"Content-Length: %d\r\n" % len(body))
    lines.append(b"\r\n")
    lines.append(body)
    raw = b"".join(lines)
    return raw if len(raw) <= MAX_HANDED_BYTES else None


def _pipelined(request: web.Request) -> bool:
    """A further request of the caller's was already read behind this one (HTTP pipelining)."""
    queued: Any = getattr(request.protocol, "_messages", None)
    return queued is None or len(queued) > 0


# ----------------------------------------------------------------------------- the control process's side


class HandoffSite(web.BaseSite):
    """The control process's hand-over socket, an aiohttp site of its runner: each connection handed over is
    served by the runner's HTTP server from its first request on, as if it had been accepted here."""

    __slots__ = ("_adopting", "_listener", "_path", "_readers")

    def __init__(self, runner: web.BaseRunner, path: str):
        super().__init__(runner)
        self._path = path
        self._listener: socket.socket | None = None
        self._readers: dict[int, socket.socket] = {}
        self._adopting: set[asyncio.Task[None]] = set()

    @property
    def name(self) -> str:
        return f"handoff:{self._path}"

    async def start(self) -> None:
        await super().start()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        listener.bind(self._path)
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        asyncio.get_running_loop().add_reader(listener.fileno(), self._accept)

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._listener is not None:
            loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
        for fd, reader in list(self._readers.items()):
            loop.remove_reader(fd)
            reader.close()
        self._readers.clear()
        await super().stop()

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            channel, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        channel.setblocking(False)
        self._readers[channel.fileno()] = channel
        asyncio.get_running_loop().add_reader(channel.fileno(), self._receive, channel)

    def _receive(self, channel: socket.socket) -> None:
        for _ in range(_RECEIVE_BATCH):
            try:
                raw, fds, _flags, _ = socket.recv_fds(channel, MAX_HANDED_BYTES, 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("a data plane's hand-over socket failed: %s", exc)
                raw, fds = b"", []
            if not raw and not fds:  # the data plane closed its end (it exited)
                asyncio.get_running_loop().remove_reader(channel.fileno())
                self._readers.pop(channel.fileno(), None)
                channel.close()
                return
            for fd in fds[1:]:
                os.close(fd)
            if fds:
                self._adopt(fds[0], raw)

    def _adopt(self, fd: int, raw: bytes) -> None:
        server = self._runner.server
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)
            return
        if server is None:  # the runner is stopping: the caller sees the connection close
            sock.close()
            return
        task = asyncio.get_running_loop().create_task(_serve(server, sock, raw), name="handed-connection")
        self._adopting.add(task)
        task.add_done_callback(self._adopted)

    def _adopted(self, task: asyncio.Task[None]) -> None:
        self._adopting.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("serving a handed-over connection failed: %r", task.exception())


async def _serve(server: Any, sock: socket.socket, raw: bytes) -> None:
    sock.setblocking(False)
    try:
        _, protocol = await asyncio.get_running_loop().connect_accepted_socket(server, sock)
    except Exception:
        sock.close()
        raise
    protocol.data_received(raw)
