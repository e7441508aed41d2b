"""Send one admin call to many workers at once and decode each answer into its model.

A worker *succeeded* when it answered 2xx with a body that parses as the route's
response model and that model reports success (``success: true``, or
``status: "ready"`` for a prepare). A body that does not parse is a worker
failure with a message saying what was wrong, not something to probe with
``dict.get``. Admin POSTs are never retried: a second ``update_weights_*`` could
apply twice.

Each call is one whole answer through the gateway's worker client, all sent in one pass
(:meth:`router.gateway.upstream.WorkerClient.fetch_all`: no bound on requests in flight and no task
per worker, since a broadcast is one request per worker, all at once; each answer decoded once),
waiting as long as the operation's budget gives the router (:attr:`AdminCall.timeout_s`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from router.contract.base import WireRequest, WireResponse
from router.contract.fleet_answers import WorkerResult
from router.gateway.admin.expectation import NOTHING_SAID, Expectation
from router.gateway.admin.operations import Operation, parametrized
from router.gateway.engines import engine_of
from router.gateway.fleet.registry import Worker
from router.gateway.upstream import WorkerClient
from router.gateway.upstream.answer import WorkerAnswer, decode_answer, decode_plain, unreachable
from router.gateway.upstream.lean_batch import Exchange

Req = TypeVar("Req", bound=WireRequest)
Resp = TypeVar("Resp", bound=WireResponse)


@dataclass(slots=True)
class AdminCall(Generic[Req, Resp]):
    """What to send: the operation, the parsed request (or one per worker), headers and the caller's query."""

    op: Operation[Req, Resp]
    method: str
    request: Req
    headers: dict[str, str]
    timeout_s: float
    query: str = ""
    request_for: Callable[[Worker], Req] | None = None
    """A per-worker request (rank assignment gives each worker its own ``rank_offset``)."""
    only: frozenset[str] | None = None
    """The worker ids the caller targeted (:mod:`router.gateway.admin.targets`); ``None``: the whole fleet."""
    expect: Expectation = NOTHING_SAID
    """What the caller said the call leaves on the workers (a weight change's digest; :mod:`.verify`)."""
    _body: bytes | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        data = self.request.to_json()
        # A GET that carried nothing stays a plain GET, and a POST that set nothing on a route the workers
        # take bare goes bare (no body to parse: a broadcast's cost on each worker); everything else
        # forwards the parsed body.
        if data == b"{}" and (self.method == "GET" or self.op.endpoint.bare_when_default):
            self._body = None if self.method == "GET" else b""
            self.headers = {k: v for k, v in self.headers.items() if k.lower() != "content-type"}
        else:
            self._body = data

    def body_for(self, worker: Worker) -> bytes | None:
        return self.request_for(worker).to_json() if self.request_for is not None else self._body


class FanOut:
    """One typed :class:`WorkerResult` per worker and call."""

    def __init__(self, workers: WorkerClient) -> None:
        self._workers = workers

    async def to_all(self, targets: Sequence[Worker], call: AdminCall[Req, Resp]) -> list[WorkerResult[Resp]]:
        """Send ``call`` to every target at once; one result per target, in target order, each decoded as its
        answer lands."""
        path = call.op.path + (f"?{call.query}" if call.query else "")
        result: type[WorkerResult[Resp]] = parametrized(WorkerResult, call.op.endpoint.response)
        started = time.perf_counter()

        def land(i: int, exchange: Exchange) -> WorkerResult[Resp]:
            worker = targets[i]
            if isinstance(exchange, BaseException):
                answer: WorkerAnswer[Resp] = unreachable(exchange, call.timeout_s)
                elapsed_s = time.perf_counter() - started
            else:
                status, raw, elapsed_s = exchange
                engine = engine_of(worker)
                decode = (
                    decode_plain if call.op.text_answers else engine.decode if engine is not None else decode_answer
                )
                answer = decode(call.op.endpoint.response, status, raw)
            return result(
                worker=worker.id,
                url=worker.url,
                success=answer.value is not None and answer.value.ok,
                status_code=answer.status,
                body=answer.body,
                error=answer.error,
                elapsed_ms=round(elapsed_s * 1000.0, 3),
            )

        return await self._workers.fetch_all(
            call.method,
            [(w.url, path, call.body_for(w)) for w in targets],
            headers=call.headers,
            timeout_s=call.timeout_s,
            convert=land,
        )
