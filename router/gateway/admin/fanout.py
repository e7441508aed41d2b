"""Send one admin call to many workers at once and decode each answer into its model.

A worker *succeeded* when it answered 2xx with a body that parses as the route's
response model and that model reports success (``success: true``, or
``status: "ready"`` for a prepare). A body that does not parse is a worker
failure with a message saying what was wrong, not something to probe with
``dict.get``. Admin POSTs are never retried: a second ``update_weights_*`` could
apply twice.

``http`` workers are reached over the router's lean HTTP/1.1 client
(:mod:`router.gateway.upstream_http`, the same one the proxy uses) with a pool of its own: no
bound on requests in flight (a broadcast is one request per worker, all at once), at most
:data:`MAX_IDLE_PER_WORKER` idle connections kept per worker, a whole answer read at most
``MAX_BODY_BYTES`` (64 MiB), and each call's own timeout covering connect, send and the whole
answer. ``https`` workers go through the shared aiohttp session.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from pydantic import ValidationError

from router.contract.base import WireRequest, WireResponse
from router.contract.errors import ErrorBody
from router.contract.fleet import WorkerResult
from router.gateway.admin.operations import Operation
from router.gateway.fleet.registry import Worker
from router.gateway.upstream_http import HttpUpstream, UpstreamError


@dataclass(slots=True)
class AdminCall:
    """What to send: the operation, the parsed request (or one per worker), headers and the caller's query."""

    op: Operation
    method: str
    request: WireRequest
    headers: dict[str, str]
    timeout_s: float
    query: str = ""
    request_for: Callable[[Worker], WireRequest] | None = None
    """A per-worker request (rank assignment gives each worker its own ``rank_offset``)."""
    _body: bytes | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        data = self.request.to_json()
        # A GET that carried nothing stays a plain GET; everything else forwards the parsed body.
        self._body = None if self.method == "GET" and data == b"{}" else data

    def body_for(self, worker: Worker) -> bytes | None:
        return self.request_for(worker).to_json() if self.request_for is not None else self._body


def decode_answer(model: type[WireResponse], status: int, raw: bytes) -> tuple[WireResponse | None, str | None]:
    """A worker's answer as ``(body, error)``: the parsed response model, and why it is unusable if it is."""
    body: WireResponse | None = None
    problem: str | None = None
    try:
        body = model.model_validate_json(raw) if raw else None
    except ValidationError as exc:
        problem = f"{exc.error_count()} problem(s), first: {_first_problem(exc)}"
    if 200 <= status < 300:
        if body is None:
            what = "an empty body" if not raw else f"a body that is not a valid {model.__name__} ({problem})"
            return None, f"answered {status} with {what}"
        return body, None
    # A refusal: SGLang's admin failures parse as the response model (success false); errors carry error.message.
    try:
        return body, ErrorBody.model_validate_json(raw).error.message
    except ValidationError:
        pass
    if body is not None:
        return body, None
    text = raw.decode("utf-8", errors="replace").strip()
    return None, f"answered {status}" + (f": {text[:300]}" if text else "")


def _first_problem(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "body"
    return f"{where}: {err.get('msg')}"


MAX_IDLE_PER_WORKER = 8


class FanOut:
    """Pooled connections to every worker; one typed :class:`WorkerResult` per call."""

    def __init__(self, session: aiohttp.ClientSession, *, connect_timeout_s: float):
        self._session = session
        self._connect_timeout_s = connect_timeout_s
        self._lean = HttpUpstream(limit=0, connect_timeout_s=connect_timeout_s, max_idle_per_host=MAX_IDLE_PER_WORKER)

    def close(self) -> None:
        self._lean.close()

    async def call(self, worker: Worker, call: AdminCall) -> WorkerResult[Any]:
        start = time.perf_counter()
        body: WireResponse | None = None
        status: int | None = None
        try:
            status, raw = await self._send(worker, call)
            body, error = decode_answer(call.op.endpoint.response, status, raw)
        except TimeoutError:
            error = f"no answer within {call.timeout_s:g}s"
        except (aiohttp.ClientError, OSError, UpstreamError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        success = error is None and status is not None and 200 <= status < 300 and body is not None and body.ok
        return WorkerResult[call.op.endpoint.response](  # type: ignore[name-defined]
            worker=worker.id,
            url=worker.url,
            success=success,
            status_code=status,
            body=body,
            error=error,
            elapsed_ms=round((time.perf_counter() - start) * 1000.0, 3),
        )

    async def to_all(self, targets: Sequence[Worker], call: AdminCall) -> list[WorkerResult[Any]]:
        """Send ``call`` to every target at once; one result per target, in target order."""
        return list(await asyncio.gather(*(self.call(w, call) for w in targets)))

    async def _send(self, worker: Worker, call: AdminCall) -> tuple[int, bytes]:
        path = call.op.path + (f"?{call.query}" if call.query else "")
        data = call.body_for(worker)
        if worker.url.startswith("http://"):
            return await self._lean.fetch(call.method, worker.url, path, data, call.headers, timeout_s=call.timeout_s)
        connect = min(self._connect_timeout_s, call.timeout_s)
        timeout = aiohttp.ClientTimeout(total=call.timeout_s, sock_connect=connect)
        async with self._session.request(
            call.method, worker.url + path, data=data, headers=call.headers, timeout=timeout
        ) as resp:
            return resp.status, await resp.read()
