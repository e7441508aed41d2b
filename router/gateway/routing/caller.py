"""A generation request as :class:`~router.gateway.routing.proxy.GenerateProxy` reads and answers it.

The proxy serves callers of two HTTP servers: aiohttp's (the single process, and every route of a
control process) and a data plane's own server for the generation routes
(:mod:`router.gateway.frontend`). Each hands the proxy a :class:`Caller`: the request's headers and
body, and the two ways to answer it (a whole body, or a stream written as the worker's answer
arrives). ``A`` is what the server expects back from its handler: aiohttp's response object, or
the status the data plane's server has written.

A stream waits while its caller reads slower than the worker answers, for the stall bound at most
(``--stream-stall-timeout-s``): a caller that stops reading is cut off (:class:`StreamStalled`) and
its request aborted on the worker, rather than holding the worker's slot until the connection closes.
"""

from __future__ import annotations

import asyncio
from typing import Protocol, TypeVar

from aiohttp import web

A_co = TypeVar("A_co", covariant=True)


class StreamStalled(ConnectionResetError):
    """The caller read nothing of its answer for the stall bound: its connection was cut (a caller gone)."""


class Stream(Protocol[A_co]):
    """An answer being streamed: its head is sent; chunks follow; :meth:`end` sends the last one."""

    async def write(self, chunk: bytes) -> None:
        """Send ``chunk``, waiting while the caller reads slower than the worker answers (the stall bound
        at most). Raises ``ConnectionResetError`` when the caller went away, :class:`StreamStalled` when
        it stopped reading."""
        ...

    async def end(self) -> None: ...

    @property
    def answer(self) -> A_co:
        """What the handler returns once the stream is done (or broken off)."""
        ...


class Caller(Protocol[A_co]):
    """One caller's request, and its answer (see the module docstring)."""

    def header(self, name: str) -> str | None:
        """The request header ``name`` (any case), or ``None``."""
        ...

    async def read(self) -> bytes: ...

    def answer(self, status: int, body: bytes, headers: dict[str, str]) -> A_co:
        """The whole answer (``headers`` name its ``Content-Type``)."""
        ...

    async def stream(self, status: int, headers: dict[str, str], stall_s: float) -> Stream[A_co]:
        """Send the answer's head now; its body follows through the returned stream, whose every write
        waits ``stall_s`` at most for the caller to read."""
        ...


class AiohttpCaller:
    """A request aiohttp's server took: answered with aiohttp's response objects."""

    __slots__ = ("request",)

    def __init__(self, request: web.Request):
        self.request = request

    def header(self, name: str) -> str | None:
        return self.request.headers.get(name)

    async def read(self) -> bytes:
        return await self.request.read()

    def answer(self, status: int, body: bytes, headers: dict[str, str]) -> web.StreamResponse:
        return web.Response(status=status, body=body, headers=headers)

    async def stream(self, status: int, headers: dict[str, str], stall_s: float) -> _AiohttpStream:
        response = web.StreamResponse(status=status, headers=headers)
        await response.prepare(self.request)
        return _AiohttpStream(self.request, response, stall_s)


class _AiohttpStream:
    __slots__ = ("_request", "_stall_s", "answer")

    def __init__(self, request: web.Request, response: web.StreamResponse, stall_s: float):
        self._request = request
        self._stall_s = stall_s
        self.answer = response

    async def write(self, chunk: bytes) -> None:
        try:  # aiohttp's write waits on the connection's flow control inside: the bound goes around it
            async with asyncio.timeout(self._stall_s):
                await self.answer.write(chunk)
        except TimeoutError:
            transport = self._request.transport
            if transport is not None:
                transport.abort()  # what waits for the caller is dropped with the connection
            raise StreamStalled(f"the caller read nothing for {self._stall_s:g}s") from None

    async def end(self) -> None:
        await self.answer.write_eof()
