"""The gateway's one client to workers: every HTTP call the router makes to a worker goes here.

::

    WorkerClient
      .stream(method, url, path, body, headers, timeout_s)  → UpstreamResponse  (the proxy)
      .fetch(url, path, model, ..., timeout_s)              → WorkerAnswer[model] (a whole answer)
      .call(url, endpoint, request, headers)                → WorkerAnswer[endpoint.response]
      .fetch_all(method, [(url, path, body)], ...)          → [(status, body, seconds) | error] (a broadcast)

- **One transport choice**, by the worker's scheme, in :meth:`WorkerClient._transport`: ``http://``
  workers over the lean keep-alive client (:mod:`router.gateway.upstream.lean_http`), anything else
  over aiohttp (:mod:`router.gateway.upstream.via_aiohttp`).
- **Two lean pools**, so that neither kind of traffic waits for the other: streams (proxied
  generation) at most ``stream_limit`` in flight (``--max-connections``); whole answers (the
  admin fan-out, health probes, metadata reads, aborts, ``/v1/models``) with no bound in flight (a
  broadcast is one request per worker, all at once) and at most :data:`MAX_IDLE_PER_WORKER` idle
  connections kept per worker.
- **One decoder and one failure classification** for whole answers: :meth:`fetch` never raises
  for the worker's sake (only ``CancelledError`` escapes); what came back, or why nothing did, is a
  :class:`~router.gateway.upstream.answer.WorkerAnswer`.
- **Deadlines from the endpoint table**: :meth:`call` waits
  ``endpoint.budget.router_wait(endpoint.timeout_of(request))``, the router's wait of
  :mod:`router.contract.budget`; :meth:`fetch` and :meth:`stream` take the deadline their caller
  derived (an admin operation's, ``--request-timeout-s``, ``--health-check-timeout-s``).
- Nothing is retried here (:mod:`router.gateway.upstream.transport`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from router.contract.base import WireRequest, WireResponse
from router.contract.endpoint import Endpoint
from router.gateway.upstream.answer import Decoder, WorkerAnswer, decode_answer, unreachable
from router.gateway.upstream.lean_batch import Exchange
from router.gateway.upstream.lean_http import HttpUpstream
from router.gateway.upstream.transport import Transport, UpstreamError, UpstreamResponse
from router.gateway.upstream.via_aiohttp import AiohttpUpstream

__all__ = ["MAX_IDLE_PER_WORKER", "UNREACHABLE", "WorkerClient"]

M = TypeVar("M", bound=WireResponse)
T = TypeVar("T")

#: Idle connections the whole-answer pool keeps per worker.
MAX_IDLE_PER_WORKER = 8
#: Every way a call can fail to bring back an answer (``ValueError``: a URL or header that cannot be encoded).
UNREACHABLE = (OSError, UpstreamError, ValueError)


class WorkerClient:
    """Pooled connections to every worker, over the transport its scheme needs (one per app)."""

    def __init__(self, *, stream_limit: int, connect_timeout_s: float):
        self._streams = HttpUpstream(limit=stream_limit, connect_timeout_s=connect_timeout_s)
        self._calls = HttpUpstream(limit=0, connect_timeout_s=connect_timeout_s, max_idle_per_host=MAX_IDLE_PER_WORKER)
        self._tls = AiohttpUpstream(limit=stream_limit, connect_timeout_s=connect_timeout_s)

    def _transport(self, base_url: str, lean: HttpUpstream) -> Transport:
        """The one place a transport is chosen: ``lean`` for ``http://`` workers, aiohttp for the rest."""
        return lean if base_url.startswith("http://") else self._tls

    def stream(
        self,
        method: str,
        base_url: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        *,
        timeout_s: float,
        admit: Callable[[], bool] | None = None,
    ) -> Awaitable[UpstreamResponse]:
        """Send one request and wait for the answer's head; the body follows as it arrives.

        Raises ``OSError`` (``TimeoutError``, ``ConnectionError``) or :class:`UpstreamError` when no
        answer began; the response's ``read``/``chunks`` raise :class:`UpstreamError` or
        ``TimeoutError``. ``timeout_s`` covers the whole exchange, the body included. ``admit``: see
        :class:`~router.gateway.upstream.transport.Transport` (:class:`NotAdmitted` when it says no).
        """
        return self._transport(base_url, self._streams).request(
            method, base_url, path, body, headers, timeout_s=timeout_s, admit=admit
        )

    async def fetch(
        self,
        base_url: str,
        path: str,
        model: type[M],
        *,
        method: str = "GET",
        body: bytes | None = None,
        headers: dict[str, str],
        timeout_s: float,
        decode: Decoder = decode_answer,
    ) -> WorkerAnswer[M]:
        """One whole exchange decoded as ``model`` (by ``decode``: the worker's engine may answer success
        without JSON); a failure is the answer's ``error``, never raised."""
        try:
            status, raw = await self._transport(base_url, self._calls).fetch(
                method, base_url, path, body, headers, timeout_s=timeout_s
            )
        except UNREACHABLE as exc:
            return unreachable(exc, timeout_s)
        return decode(model, status, raw)

    async def fetch_all(
        self,
        method: str,
        calls: Sequence[tuple[str, str, bytes | None]],
        *,
        headers: dict[str, str],
        timeout_s: float,
        convert: Callable[[int, Exchange], T],
    ) -> list[T]:
        """One whole exchange per ``(base_url, path, body)``, all at once (a broadcast): ``convert(i, exchange)``
        per call, in order, as each answer lands; ``exchange`` is ``(status, body, seconds to the answer)`` or why
        no answer came (an exception out of :data:`UNREACHABLE`, passed on, never raised). Plain-http workers go
        through the lean pool's batch (:meth:`~router.gateway.upstream.lean_http.HttpUpstream.fetch_all`), the
        rest one task each."""

        def checked(i: int, exchange: Exchange) -> T:
            if isinstance(exchange, BaseException) and not isinstance(exchange, UNREACHABLE):
                raise exchange  # not the worker's doing: a fault of the router's own
            return convert(i, exchange)

        lean = [i for i, (url, _, _) in enumerate(calls) if url.startswith("http://")]
        if len(lean) == len(calls):
            return await self._calls.fetch_all(method, calls, headers, timeout_s=timeout_s, convert=checked)
        other = [i for i in range(len(calls)) if i not in set(lean)]
        batch, singles = await asyncio.gather(
            self._calls.fetch_all(
                method, [calls[i] for i in lean], headers, timeout_s=timeout_s, convert=lambda j, e: checked(lean[j], e)
            ),
            asyncio.gather(*(self._timed_fetch(method, *calls[i], headers, timeout_s) for i in other)),
        )
        converted = dict(zip(lean, batch, strict=True))
        converted.update({i: checked(i, exchange) for i, exchange in zip(other, singles, strict=True)})
        return [converted[i] for i in range(len(calls))]

    async def _timed_fetch(
        self, method: str, base_url: str, path: str, body: bytes | None, headers: dict[str, str], timeout_s: float
    ) -> Exchange:
        started = time.monotonic()
        try:
            status, raw = await self._tls.fetch(method, base_url, path, body, headers, timeout_s=timeout_s)
        except UNREACHABLE as exc:
            return exc
        return status, raw, time.monotonic() - started

    async def status(self, base_url: str, path: str, *, headers: dict[str, str], timeout_s: float) -> int | None:
        """The status of one ``GET`` whose body says nothing (vLLM's and SGLang's ``/health``); ``None``
        when no answer came."""
        try:
            status, _ = await self._transport(base_url, self._calls).fetch(
                "GET", base_url, path, None, headers, timeout_s=timeout_s
            )
        except UNREACHABLE:
            return None
        return status

    async def call(
        self,
        base_url: str,
        endpoint: Endpoint[WireRequest, M],
        request: WireRequest | None = None,
        *,
        headers: dict[str, str],
        cap_s: float | None = None,
        query: str = "",
        decode: Decoder = decode_answer,
    ) -> WorkerAnswer[M]:
        """One call of a contract endpoint, waiting as long as its budget gives the router (or
        ``cap_s``, when the caller's own deadline is shorter).

        Without a ``request`` a route that takes ``GET`` is read with a plain ``GET``; otherwise the
        request is POSTed (an empty one when none is given).
        """
        if request is None and "GET" in endpoint.methods:
            method, body = "GET", None
        else:
            method = "POST"
            body = (request if request is not None else endpoint.request()).to_json()
        timeout_s = endpoint.budget.router_wait(endpoint.timeout_of(request) if request is not None else None)
        if cap_s is not None:
            timeout_s = min(timeout_s, cap_s)
        path = f"{endpoint.path}?{query}" if query else endpoint.path
        return await self.fetch(
            base_url,
            path,
            endpoint.response,
            method=method,
            body=body,
            headers=headers,
            timeout_s=timeout_s,
            decode=decode,
        )

    def cut_generation(self, base_url: str, message: str, *, unanswered_only: bool = False) -> int:
        """End the generation requests in flight to one worker (the prober found it dead): a request
        still without an answer fails as if its connection broke, so the proxy retries it elsewhere,
        and a stream already relaying ends with an error event. Admin calls keep their own bounds.
        ``unanswered_only``: only the requests whose answer has not begun (a worker found paused: the
        others resume with it)."""
        return self._transport(base_url, self._streams).cut(base_url, message, unanswered_only=unanswered_only)

    async def close(self) -> None:
        """Close every pooled connection and the aiohttp session (after the calls in flight)."""
        self._streams.close()
        self._calls.close()
        await self._tls.close()
