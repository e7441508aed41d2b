"""The proxy's clients to workers: one interface over the lean client and aiohttp.

``http://`` workers go over the router's own keep-alive HTTP/1.1 client
(:class:`~router.gateway.upstream_http.HttpUpstream`, shared with the admin fan-out but with its
own pool: at most ``--max-connections`` requests in flight; its docstring has the rules that keep
a pooled connection safe); ``https`` workers go through aiohttp (:class:`AiohttpUpstream`), behind
the same interface. A proxied ``/generate`` or OpenAI request is one POST written in one piece, a
response head, and the body as it arrives; nothing is retried here: the proxy's policy decides
(another worker, before any byte reached the caller).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import aiohttp

from router.gateway.upstream_http import HttpUpstream, UpstreamError

__all__ = ["AiohttpUpstream", "UpstreamError", "UpstreamResponse", "Upstreams", "mime_type"]

STREAM_CHUNK = 64 * 1024


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
