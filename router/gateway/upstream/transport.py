"""What every transport to a worker offers: a response head at once, its body as it arrives.

Two transports implement it: the lean keep-alive HTTP/1.1 client for ``http://`` workers
(:mod:`router.gateway.upstream.lean_http`) and aiohttp for ``https://`` ones
(:mod:`router.gateway.upstream.via_aiohttp`); :class:`~router.gateway.upstream.client.WorkerClient`
picks one by the worker's scheme. Both raise the same errors, so a caller classifies a failure
once, whichever transport carried it:

- ``OSError`` (``TimeoutError`` and ``ConnectionError`` included): no answer began: nothing
  reached the worker's answer yet, so the proxy may still retry elsewhere;
- :class:`UpstreamError`: the answer was malformed or broke off after it began, or the request
  could not be written (a line break in a header, ``HEAD``);
- ``TimeoutError`` while reading: the request's deadline passed; it covers the whole exchange.

Nothing is retried by a transport: the proxy's policy decides (another worker, before any byte
reached the caller), and admin calls are never retried at all (a second ``update_weights_*``
could apply twice).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from router.contract.web import parsing

#: The cap of a whole-body read (``fetch``) is the router's one body cap: a larger answer fails and closes its
#: connection, as a larger request is refused.
MAX_BODY_BYTES = parsing.MAX_BODY_BYTES


class NotAdmitted(Exception):
    """The request was not sent: its ``admit`` check said no right before the first byte."""


class UpstreamError(Exception):
    """The worker's answer broke off or was not HTTP/1.1, or the request could not be written."""


class UpstreamResponse(Protocol):
    """A worker's answer: the head at once, the body as it arrives; ``release()`` when done with it."""

    status: int

    def header(self, name: str) -> str | None:
        """A response header (case-insensitive name)."""
        ...

    async def read(self, max_bytes: int | None = None) -> bytes:
        """The whole body, at most ``max_bytes``. Raises :class:`UpstreamError` or ``TimeoutError``."""
        ...

    def chunks(self) -> AsyncIterator[bytes]:
        """The body piece by piece as it arrives. Raises :class:`UpstreamError` or ``TimeoutError``."""
        ...

    def release(self) -> None:
        """Return the connection to its pool (after a complete answer) or close it."""
        ...


class Transport(Protocol):
    """One way to reach workers: a request whose answer streams, or a whole exchange.

    Each transport subclasses it, so mypy checks its methods against these signatures, and inherits
    :meth:`fetch`, which only needs :meth:`request`."""

    def request(
        self,
        method: str,
        base_url: str,
        path: str,
        body: bytes | None,
        headers: dict[str, str],
        *,
        timeout_s: float,
        admit: Callable[[], bool] | None = None,
    ) -> Awaitable[UpstreamResponse]:
        """Send the request and wait for the answer's head; ``body=None`` sends none (a plain GET).

        ``admit``, when given, is asked right before the first byte is written; if it says no,
        nothing is sent and :class:`NotAdmitted` is raised."""
        ...

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
        Written once, here: each transport subclasses this protocol and inherits it."""
        resp = await self.request(method, base_url, path, body, headers, timeout_s=timeout_s)
        try:
            return resp.status, await resp.read(max_bytes)
        finally:
            resp.release()

    def cut(self, base_url: str, message: str, *, unanswered_only: bool = False) -> int:
        """End the requests in flight to one worker: their waits raise :class:`UpstreamError` (``message``).
        ``unanswered_only``: only those whose answer has not begun (the rest run on)."""
        ...


def mime_type(content_type: str | None) -> str:
    """``application/json; charset=utf-8`` → ``application/json`` (aiohttp's default when absent)."""
    if not content_type:
        return "application/octet-stream"
    return content_type.partition(";")[0].strip().lower()
