"""``https`` workers through aiohttp, behind the same interface as the lean client.

The session is created on the first call to an ``https`` worker (a fleet of plain-http workers
never opens one) and closed with the client. Its connector keeps at most ``limit`` connections
(``--max-connections``) and does not decompress: a proxied body passes through byte for byte.
aiohttp's own errors are turned into the transport errors of
:mod:`router.gateway.upstream.transport`, so callers classify one set of exceptions:
``aiohttp.ClientConnectionError`` before an answer began is a ``ConnectionError``, any other
``aiohttp.ClientError`` an :class:`~router.gateway.upstream.transport.UpstreamError`, and a
passed deadline stays a ``TimeoutError``.

:meth:`AiohttpUpstream.cut` ends every request in flight to one worker: a request still
waiting for its head stops waiting (its aiohttp request is cancelled), an answer being read is
closed, and both raise :class:`~router.gateway.upstream.transport.UpstreamError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import aiohttp

from router.gateway.upstream.transport import NotAdmitted, Transport, UpstreamError

__all__ = ["AiohttpUpstream"]

STREAM_CHUNK = 64 * 1024


class _AiohttpResponse:
    __slots__ = ("_cut", "_on_release", "_resp", "status")

    def __init__(self, resp: aiohttp.ClientResponse, on_release: set[_AiohttpResponse]):
        self._resp = resp
        self.status = resp.status
        self._cut: str | None = None
        self._on_release = on_release
        on_release.add(self)

    def cut(self, message: str) -> None:
        self._cut = message
        self._resp.close()

    def _error(self, exc: aiohttp.ClientError) -> UpstreamError:
        return UpstreamError(self._cut or f"{type(exc).__name__}: {exc}")

    def header(self, name: str) -> str | None:
        return self._resp.headers.get(name)

    async def read(self, max_bytes: int | None = None) -> bytes:
        resp = self._resp
        try:
            if max_bytes is None:
                return await resp.read()
            if resp.content_length is not None and resp.content_length > max_bytes:
                resp.close()
                raise UpstreamError(f"the worker's answer is larger than {max_bytes} bytes")
            parts: list[bytes] = []
            size = 0
            async for chunk in resp.content.iter_chunked(STREAM_CHUNK):
                size += len(chunk)
                if size > max_bytes:
                    resp.close()
                    raise UpstreamError(f"the worker's answer is larger than {max_bytes} bytes")
                parts.append(chunk)
            return b"".join(parts)
        except TimeoutError:
            raise
        except aiohttp.ClientError as exc:
            raise self._error(exc) from None

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_chunked(STREAM_CHUNK):
                yield chunk
        except TimeoutError:
            raise
        except aiohttp.ClientError as exc:
            raise self._error(exc) from None
        if self._cut is not None:  # closed under the reader: what came is not the whole answer
            raise UpstreamError(self._cut)

    def release(self) -> None:
        self._on_release.discard(self)
        self._resp.release()


class AiohttpUpstream(Transport):
    """Requests to ``https`` workers over one lazily opened aiohttp session."""

    def __init__(self, *, limit: int, connect_timeout_s: float):
        self._limit = limit
        self._connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None
        # Per worker: what :meth:`cut` ends (a signal for requests awaiting their head, the answers being read).
        self._cut_signals: dict[str, asyncio.Future[str]] = {}
        self._answers: dict[str, set[_AiohttpResponse]] = {}

    def _client(self) -> aiohttp.ClientSession:
        session = self._session
        if session is None:
            connector = aiohttp.TCPConnector(limit=self._limit, limit_per_host=0, ttl_dns_cache=300)
            session = self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        return session

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
    ) -> _AiohttpResponse:
        """Send the request and wait for the answer's head (the errors of the module docstring).

        ``admit`` is asked before aiohttp takes the request; aiohttp may still wait for a
        connection after that, so for ``https`` workers the check is a moment early."""
        if admit is not None and not admit():
            raise NotAdmitted(f"{base_url} left routing before the request was sent")
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(self._connect_timeout_s, timeout_s))
        signal = self._cut_signals.get(base_url)
        if signal is None:
            signal = self._cut_signals[base_url] = asyncio.get_running_loop().create_future()
        sent = asyncio.ensure_future(
            self._client().request(method, base_url + path, data=body, headers=headers, timeout=timeout)
        )
        try:
            await asyncio.wait((sent, signal), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not sent.done():  # cut, or the caller went away: stop waiting for the head
                sent.cancel()
                await asyncio.gather(sent, return_exceptions=True)
        if sent.cancelled():
            raise UpstreamError(signal.result())
        try:
            resp = sent.result()
        except TimeoutError:
            raise
        except aiohttp.ClientConnectionError as exc:
            raise ConnectionError(f"{type(exc).__name__}: {exc}") from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from None
        answers = self._answers.get(base_url)
        if answers is None:
            answers = self._answers[base_url] = set()
        return _AiohttpResponse(resp, answers)

    def cut(self, base_url: str, message: str, *, unanswered_only: bool = False) -> int:
        """End every request in flight to one worker (see the module docstring; ``unanswered_only``: those
        still waiting for their answer's head); how many were cut (answers begun, when not only the unanswered)."""
        signal = self._cut_signals.pop(base_url, None)
        if signal is not None and not signal.done():
            signal.set_result(message)
        if unanswered_only:
            return 0
        answers = self._answers.pop(base_url, set())
        for answer in answers:
            answer.cut(message)
        return len(answers)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
