"""AReaL's vLLM pause and continue through the router: ``/areal_pause_generation``, ``/areal_continue_generation``.

AReaL's ``RemotevLLMEngine`` (areal 1.0.4) posts them to every server it knows, around a weight or LoRA
sync; they are routes of AReaL's own vLLM server (:mod:`router.contract.areal`). Behind a router they are the
fleet's pause and continue, run in the one shape of every admin operation: under the update lock, the pause
fenced and journaled like ``/pause_generation`` and ``/pause`` (a target that fails it stays out of routing
unless it refused untouched), the router's record of each worker's pause state updated before the fence is
lowered, so a worker it paused is never taken for one paused behind its back.

Each worker is sent what its engine serves for them (:meth:`~router.gateway.engines.base.Engine.generation_control`):
vLLM's ``/pause?mode=abort&clear_cache=true`` and ``/resume`` on omni-worker and vLLM servers, SGLang's
``/pause_generation`` (``abort``) and ``/continue_generation`` on SGLang servers, and AReaL's routes as they
came on a real AReaL vLLM server, whose pause does more than vLLM's (it holds its completions until the
continue). A worker whose engine is not known yet gets AReaL's route, and fails it if it cannot answer. A
target whose engine serves none of these (a vLLM server without dev mode) is refused (400) before anything
is locked or sent.

The answer is AReaL's server's shape, ``{"success", "message"}`` (200 when every worker succeeded), with the
router's envelope beside it; each worker's result says which route it was sent (``relayed_as``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from router.contract import endpoints as ep
from router.contract.areal import ArealControlRequest, ArealControlResult
from router.contract.base import WireResponse
from router.contract.errors import BadRequest
from router.contract.fleet_answers import WorkerResult
from router.contract.web.openapi import Route
from router.contract.web.parsing import parse_body
from router.gateway import keys
from router.gateway.admin import operations as ops
from router.gateway.admin.answers import Outcome
from router.gateway.admin.fanout import AdminCall
from router.gateway.admin.locked import AdminContext, AdminRun
from router.gateway.admin.operations import AnyOperation, Operation, parametrized
from router.gateway.admin.stale_at_pause import drop_stale
from router.gateway.admin.targets import TARGET_PARAMS
from router.gateway.api.answers import answer_when_done
from router.gateway.api.headers import forward_headers
from router.gateway.engines import engine_of, refuse_unserved
from router.gateway.engines.base import EngineCall
from router.gateway.fleet.registry import Worker

ArealOperation = Operation[ArealControlRequest, ArealControlResult]

#: The routes a worker may be sent in AReaL's stead, as the router's operations (their answers' models).
_RELAYED: dict[str, AnyOperation] = {
    op.path: op
    for op in (
        ops.PAUSE,
        ops.RESUME,
        ops.OPERATIONS[ep.PAUSE_GENERATION.path],
        ops.OPERATIONS[ep.CONTINUE_GENERATION.path],
        ops.AREAL_PAUSE,
        ops.AREAL_CONTINUE,
    )
}
#: The registry records a pause's effect on a worker by the route that made it; AReaL's are vLLM's pause and resume.
_EFFECT_OF = {ops.AREAL_PAUSE.path: ep.PAUSE.path, ops.AREAL_CONTINUE.path: ep.RESUME.path}


def _engine_call(worker: Worker, op: ArealOperation) -> EngineCall:
    engine = engine_of(worker)
    if engine is None:
        return EngineCall(op.endpoint, ArealControlRequest())
    return engine.generation_control(worker, pause=op is ops.AREAL_PAUSE)


def _as_areal(result: WorkerResult[WireResponse], path: str) -> WorkerResult[ArealControlResult]:
    """One worker's answer to the route it was sent, in AReaL's answer shape (what it said of its weights kept:
    the fence's verdict reads it)."""
    body = result.body
    weights = getattr(body, "weights", None) if body is not None else None
    said = ArealControlResult(success=result.success, message=result.reason(), relayed_as=path, weights=weights)
    areal: type[WorkerResult[ArealControlResult]] = parametrized(WorkerResult, ArealControlResult)
    return areal(
        worker=result.worker,
        url=result.url,
        success=result.success,
        status_code=result.status_code,
        body=said if body is not None else None,
        error=result.error,
        elapsed_ms=result.elapsed_ms,
    )


async def relay(ctx: AdminContext, op: ArealOperation, headers: dict[str, str]) -> Outcome[ArealControlResult]:
    """Pause or continue every live worker in its engine's routes, as one admin operation (module docstring)."""
    async with AdminRun.open(op, ctx) as run:
        targets = ctx.live_targets()
        calls: dict[str, tuple[EngineCall, list[Worker]]] = {}
        for worker in targets:
            call = _engine_call(worker, op)
            calls.setdefault(call.endpoint.path, (call, []))[1].append(worker)
        for path, (_, group) in calls.items():
            refuse_unserved(group, path)
        await run.fence_targets(targets)
        await drop_stale(ctx.stale, op.path, targets)
        groups = list(calls.values())
        answered = await asyncio.gather(*(run.fan_out(group, _admin_call(call, headers)) for call, group in groups))
        by_worker: dict[str, WorkerResult[ArealControlResult]] = {}
        for (call, _), results in zip(groups, answered, strict=True):
            for r in results:
                by_worker[r.worker] = _as_areal(r, call.endpoint.path)
        results = [by_worker[w.id] for w in targets]
        # Before the fence is lowered (settle): a probe must find the router's own record of the pause.
        ctx.registry.observe_control(_EFFECT_OF[op.path], (r.worker for r in results if r.success))
        return await run.settle(results)


def _admin_call(call: EngineCall, headers: dict[str, str]) -> AdminCall[Any, Any]:
    """The call of the route ``call`` names, as the router sends that route (its answer read by its own model)."""
    op = _RELAYED[call.endpoint.path]
    return AdminCall(op, "POST", call.request, headers, timeout_s=op.router_wait(call.request), query=call.query)


async def _handle(request: web.Request, op: ArealOperation) -> web.Response:
    if not TARGET_PARAMS.isdisjoint(request.query):
        raise BadRequest(f"{op.path} spans the whole fleet: it takes no ?workers= or ?selector=")
    await parse_body(request, ArealControlRequest)
    work = relay(request.app[keys.ADMIN], op, forward_headers(request))
    return await answer_when_done(request, work, op.name)


async def pause(request: web.Request) -> web.Response:
    return await _handle(request, ops.AREAL_PAUSE)


async def resume(request: web.Request) -> web.Response:
    return await _handle(request, ops.AREAL_CONTINUE)


def routes() -> Sequence[Route]:
    return [
        Route(
            "POST",
            ops.AREAL_PAUSE.path,
            pause,
            "AReaL's vLLM pause: every live worker paused in its engine's routes, aborting its requests "
            "(fenced; fails closed)",
            body=ArealControlRequest,
            answer=ops.AREAL_PAUSE.answer_model(),
        ),
        Route(
            "POST",
            ops.AREAL_CONTINUE.path,
            resume,
            "AReaL's vLLM continue: every live worker continued in its engine's routes",
            body=ArealControlRequest,
            answer=ops.AREAL_CONTINUE.answer_model(),
        ),
    ]
