"""The RL control API of the SGLang Model Gateway (``smg --enable-rl``), served by omni-router.

- ``GET /v1/rl/workers``, ``GET /v1/rl/workers/{id}``: each worker's engine, topology, health,
  weight version and capabilities, read now (:class:`~router.gateway.admin.targets.WorkerFacts`).
- ``GET|POST /v1/rl/workers/{id}/engine/{path}``: one engine call to one worker.
- ``GET|POST /v1/rl/engine/{path}?selector=...``: the same call to every worker the selector matches.

Invariant: an engine path is one of the router's own admin operations
(:data:`~router.gateway.admin.operations.OPERATIONS`, by path or alias), run as that operation
targeted at the chosen workers (:mod:`router.gateway.admin.targets`), never sent around it: a call that
changes weights or pause state takes the update lock, fences and journals its targets and fails
closed exactly as the router's own route does. Read-only paths are the same operations without a
lock. Any other path is refused (``invalid_engine_path``), as is a step that spans the whole fleet
(a weight-update group's, a held update's) when the selection is a strict subset.

The answers are smg's (:mod:`router.contract.rl`); where omni-router is stricter (a failed refit
leaves its targets fenced, a later ``continue_generation`` does not make them routable) the fan-out
says so in ``fenced``.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from router.contract import endpoints as ep
from router.contract.base import WireRequest, WireResponse
from router.contract.errors import ApiError
from router.contract.fleet_answers import WorkerResult
from router.contract.rl import (
    RlCallOutcome,
    RlFailedCall,
    RlFanoutResponse,
    RlRefusal,
    RlWorkerEntry,
    RlWorkersResponse,
)
from router.contract.web.openapi import Route
from router.gateway import keys
from router.gateway.admin.broadcast import broadcast
from router.gateway.admin.expectation import Expectation
from router.gateway.admin.fanout import AdminCall
from router.gateway.admin.operations import OPERATIONS, AnyOperation
from router.gateway.admin.targets import TargetQuery, WorkerFacts, target_query
from router.gateway.api.admin import check_floor, fleet_facts, forwarded_query, parse_request
from router.gateway.fleet.registry import Worker

#: Steps the router runs through a coordinator of their own (rank planning, a held update): only on
#: the router's own routes, whose answers and state they need.
_COORDINATED = frozenset(
    e.path
    for e in (
        ep.INIT_WEIGHTS_UPDATE_GROUP,
        ep.PREPARE_WEIGHTS_UPDATE,
        ep.COMPLETE_WEIGHTS_UPDATE,
        ep.ABORT_WEIGHTS_UPDATE,
        ep.INIT_WEIGHT_TRANSFER_ENGINE,
        ep.START_WEIGHT_UPDATE,
        ep.UPDATE_WEIGHTS,
        ep.FINISH_WEIGHT_UPDATE,
    )
)

#: Every engine path the RL API accepts, by path and alias, without its leading slash.
_ENGINE_PATHS: dict[str, AnyOperation] = {
    path.lstrip("/"): op for op in OPERATIONS.values() for path in (op.path, *op.endpoint.aliases)
}


def _json(status: int, body: WireResponse) -> web.Response:
    return web.Response(body=body.model_dump_json(), status=status, content_type="application/json")


def _entry(facts: WorkerFacts) -> RlWorkerEntry:
    w = facts.worker
    return RlWorkerEntry(
        id=w.id,
        url=w.url,
        base_url=w.url,
        engine=facts.rl_dialect,
        model_id=facts.model_id,
        tp_size=facts.tp_size,
        dp_size=1,
        pp_size=1,
        health=facts.health,
        weight_version=facts.weight_version,
        labels=facts.labels(),
        capabilities=facts.rl_capabilities,
    )


async def list_workers(request: web.Request) -> web.Response:
    registry = request.app[keys.REGISTRY]
    facts = await fleet_facts(request.app).read(list(registry))
    workers = [_entry(f) for f in facts]
    return _json(200, RlWorkersResponse(workers=workers, total=len(workers)))


def _one_worker(request: web.Request) -> Worker:
    return fleet_facts(request.app).named([request.match_info["worker_id"]])[0]


async def get_worker(request: web.Request) -> web.Response:
    (facts,) = await fleet_facts(request.app).read([_one_worker(request)])
    return _json(200, _entry(facts))


def _operation(request: web.Request) -> AnyOperation:
    path = request.match_info["path"]
    op = _ENGINE_PATHS.get(path)
    if op is None:
        raise RlRefusal(400, "invalid_engine_path", f"{path[:200]!r} is not an engine control route omni-router runs")
    if op.path in _COORDINATED:
        raise RlRefusal(400, "invalid_engine_path", f"{op.path} runs only on the router's own route POST {op.path}")
    if request.method not in op.endpoint.methods:
        raise RlRefusal(400, "invalid_engine_path", f"{op.path} takes {' or '.join(op.endpoint.methods)}")
    return op


async def _engine_request(request: web.Request, op: AnyOperation) -> WireRequest:
    """The body as ``op``'s request (400 ``invalid_body``), before any worker is read or locked."""
    try:
        return await parse_request(request, op)
    except ApiError as exc:
        raise RlRefusal(400, "invalid_body", f"invalid body for {op.path}: {exc.message}") from None


async def _run(
    request: web.Request, op: AnyOperation, req: WireRequest, targets: list[Worker]
) -> tuple[list[WorkerResult[WireResponse]], list[str]]:
    """Run ``op`` as the router's own targeted operation; the per-worker results and the targets kept fenced."""
    try:
        expect = Expectation.of_headers(request.headers, changes_weights=op.changes_weights)
    except ApiError as exc:
        raise RlRefusal(400, "invalid_body", exc.message) from None
    call = AdminCall(
        op,
        request.method,
        req,
        request.app[keys.SERVICE_HEADERS],
        timeout_s=op.router_wait(req),
        query=forwarded_query(request),
        only=frozenset(w.id for w in targets),
        expect=expect,
    )
    check_floor(request, op, call.only)  # a refit of the selection that would leave too few serving: 409
    ctx = request.app[keys.ADMIN]
    outcome = await request.app[keys.TASKS].run_detached(broadcast(ctx, op, call), name=f"rl_{op.name}")
    pending = ctx.journal.pending
    kept = {t.id for t in pending.targets} if pending is not None else set()
    return outcome.answer.results, [w.id for w in targets if w.id in kept and w.disabled]


def _body(result: WorkerResult[WireResponse]) -> dict[str, Any] | None:
    if result.body is not None:
        return result.body.model_dump(mode="json")
    return {"error": {"message": result.error}} if result.error else None


def _failure(result: WorkerResult[WireResponse]) -> RlFailedCall:
    if result.status_code is not None:
        return RlFailedCall(
            worker_id=result.worker,
            url=result.url,
            error="upstream_error",
            message=result.reason()[:500],
            status=result.status_code,
        )
    timed_out = (result.error or "").startswith("no answer within")
    return RlFailedCall(
        worker_id=result.worker,
        url=result.url,
        error="upstream_timeout" if timed_out else "upstream_unreachable",
        message=result.reason()[:500],
    )


def _outcome(result: WorkerResult[WireResponse]) -> RlCallOutcome:
    return RlCallOutcome(
        worker_id=result.worker,
        url=result.url,
        status=result.status_code or 0,
        latency_ms=round(result.elapsed_ms),
        body=_body(result),
    )


async def worker_engine(request: web.Request) -> web.Response:
    """One engine call to one worker: its answer as :class:`RlCallOutcome`, the HTTP status the engine's."""
    worker = _one_worker(request)
    op = _operation(request)
    if worker.is_dead:
        raise RlRefusal(502, "upstream_unreachable", f"worker {worker.id}: the router's health checks found it dead")
    results, fenced = await _run(request, op, await _engine_request(request, op), [worker])
    (result,) = results
    if result.status_code is None:
        failure = _failure(result)
        if failure.error == "upstream_timeout":
            raise RlRefusal(504, "upstream_timeout", failure.message)
        raise RlRefusal(502, "upstream_unreachable", failure.message)
    headers = {"X-Omni-Fenced": ",".join(fenced)} if fenced else None
    answer = _outcome(result)
    return web.Response(
        body=answer.model_dump_json(), status=result.status_code, content_type="application/json", headers=headers
    )


async def engine_fanout(request: web.Request) -> web.Response:
    """The call to every worker the selector matches: 200 when all succeeded, else 207 with ``failed``."""
    query: TargetQuery = target_query(request.query, selector_required=True)
    op = _operation(request)
    req = await _engine_request(request, op)
    targets = await fleet_facts(request.app).resolve(query) or []
    dead = [w for w in targets if w.is_dead]
    live = [w for w in targets if not w.is_dead]
    results: list[WorkerResult[WireResponse]] = []
    fenced: list[str] = []
    if live:
        results, fenced = await _run(request, op, req, live)
    answer = RlFanoutResponse(total=len(targets), fenced=fenced)
    for r in results:
        if r.status_code is not None:
            answer.results[r.worker] = _outcome(r)
        if r.success:
            answer.succeeded += 1
        else:
            answer.failed.append(_failure(r))
    for w in dead:
        answer.failed.append(
            RlFailedCall(
                worker_id=w.id,
                url=w.url,
                error="upstream_unreachable",
                message="the router's health checks found it dead",
            )
        )
    return _json(200 if not answer.failed else 207, answer)


def routes() -> list[Route]:
    worker_engine_path = "/v1/rl/workers/{worker_id}/engine/{path}"
    return [
        Route("GET", "/v1/rl/workers", list_workers, "RL API (smg): every worker", answer=RlWorkersResponse),
        Route("GET", "/v1/rl/workers/{worker_id}", get_worker, "RL API (smg): one worker", answer=RlWorkerEntry),
        *(
            Route(
                method,
                worker_engine_path,
                worker_engine,
                "RL API (smg): one engine call to one worker, run as the router's operation",
                answer=RlCallOutcome,
            )
            for method in ("GET", "POST")
        ),
        *(
            Route(
                method,
                "/v1/rl/engine/{path}",
                engine_fanout,
                "RL API (smg): one engine call to every worker ?selector= matches (207 on partial failure)",
                answer=RlFanoutResponse,
            )
            for method in ("GET", "POST")
        ),
    ]
