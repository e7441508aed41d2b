"""vLLM's RL routes: the weight-transfer engine (init, start, update, finish), pause/resume, and the
dev routes ``/sleep``, ``/wake_up``, ``/is_sleeping``, ``/abort_requests``.

Thin handlers over :class:`worker.transfer.vllm.engine.VllmWeightTransfer` and the
coordinator's pause. Answers keep vLLM's fields (``message``, ``status``,
``is_paused``, ``world_size``) and add the project's ``success`` and ``weights``;
a refusal is 400, a call out of order 409, both with ``error.message`` and nothing
changed. ``/pause``, ``/sleep`` and ``/wake_up`` take their arguments as query parameters, as vLLM's do.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

from aiohttp import web

from router.contract import endpoints as ep
from router.contract.admin import ContinueRequest
from router.contract.endpoint import Endpoint
from router.contract.vllm import (
    SCHEDULER_PAUSE_MODE,
    EmptyVllmRequest,
    IsPausedResponse,
    PauseQuery,
    PauseStatus,
    VllmResult,
    WorkerWorldSize,
)
from router.contract.vllm_dev import AbortRequestsRequest, IsSleepingResponse, SleepQuery, WakeUpQuery
from router.contract.web.openapi import Route
from router.contract.web.parsing import parse_body, parse_model, parse_query_first, read_json
from worker.engine import admin_ops
from worker.http.admin_routes import Handler, admin_handler, answer, endpoint_routes, stage_answer
from worker.http.keys import CONFIG, COORDINATOR, VLLM_TRANSFER, WEIGHT_SYNC
from worker.transfer.vllm.engine import VllmWeightTransfer


def _answer(request: web.Request, endpoint: Endpoint[Any, Any], status: int, body: VllmResult) -> web.Response:
    response = answer(request, endpoint, body)
    if status != 200 and not body.success:
        response.set_status(status)
    return response


Call = Callable[[VllmWeightTransfer, Any], Awaitable[tuple[int, VllmResult]]]


def _transfer_handler(endpoint: Endpoint[Any, Any], call: Call, required: str | None = None) -> Handler:
    """Parse ``endpoint``'s request (``required``: the field vLLM answers 400 "Missing ..." without),
    run ``call`` on the engine state, answer its status and body."""

    @admin_handler
    async def handle(request: web.Request) -> web.Response:
        data = await read_json(request, allow_empty=True)
        if required is not None and required not in data:
            return _answer(request, endpoint, 400, _missing(required))
        for key, value in request.query.items():
            data.setdefault(key, value)
        status, body = await call(request.app[VLLM_TRANSFER], parse_model(endpoint.request, data))
        return _answer(request, endpoint, status, body)

    return handle


@admin_handler
async def pause(request: web.Request) -> web.Response:
    req = await parse_query_first(request, PauseQuery)
    mode = req.effective_mode
    coord = request.app[COORDINATOR]
    await coord.pause_in(SCHEDULER_PAUSE_MODE[mode], ep.PAUSE.worker_bound(req), action="pause")
    return answer(request, ep.PAUSE, PauseStatus(status="paused", mode=mode, weights="intact"))


@admin_handler
async def resume(request: web.Request) -> web.Response:
    await parse_body(request, EmptyVllmRequest)
    coord = request.app[COORDINATOR]
    bound = ep.RESUME.budget.bound(None)
    async with coord.admin_section("resume", bound):
        await coord.admin("resume", partial(admin_ops.continue_generation, req=_RESUME), bound)
    return answer(request, ep.RESUME, PauseStatus(status="resumed", weights="intact"))


async def is_paused(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    return answer(request, ep.IS_PAUSED, IsPausedResponse(is_paused=coord.is_paused))


async def get_world_size(request: web.Request) -> web.Response:
    return answer(request, ep.GET_WORLD_SIZE, WorkerWorldSize(world_size=request.app[COORDINATOR].stage.tp_size))


@admin_handler
async def sleep(request: web.Request) -> web.Response:
    """Pause, then release memory (level 1: the weights keep a host copy; level 2: they do not)."""
    req = await parse_query_first(request, SleepQuery)
    coord = request.app[COORDINATOR]
    result = await coord.sleep(req, ep.SLEEP.worker_bound(req))
    return stage_answer(request, ep.SLEEP, result, level=req.level, is_sleeping=coord.is_sleeping)


@admin_handler
async def wake_up(request: web.Request) -> web.Response:
    req = await parse_query_first(request, WakeUpQuery)
    coord = request.app[COORDINATOR]
    result = await coord.wake_up(req, ep.WAKE_UP.worker_bound(req))
    return stage_answer(request, ep.WAKE_UP, result, is_sleeping=coord.is_sleeping)


async def is_sleeping(request: web.Request) -> web.Response:
    return answer(request, ep.IS_SLEEPING, IsSleepingResponse(is_sleeping=request.app[COORDINATOR].is_sleeping))


@admin_handler
async def abort_requests(request: web.Request) -> web.Response:
    req = await parse_body(request, AbortRequestsRequest)
    result = await request.app[COORDINATOR].abort_requests(req, ep.ABORT_REQUESTS.worker_bound(req))
    return stage_answer(request, ep.ABORT_REQUESTS, result)


_RESUME = ContinueRequest(torch_empty_cache=False)


def _missing(field: str) -> VllmResult:
    return VllmResult(success=False, message=f"Missing '{field}' in request body", weights="intact")


async def vllm_transfer_ctx(app: web.Application) -> AsyncIterator[None]:
    """The vLLM engine state over the weight-sync controller; an open update is ended at shutdown."""
    config = app[CONFIG]
    app[VLLM_TRANSFER] = VllmWeightTransfer(
        app[WEIGHT_SYNC], allow_pickled=config.allow_pickled_tensors, backend=config.weight_transfer_backend
    )
    yield
    await app[VLLM_TRANSFER].close()


_V = VllmWeightTransfer
_TABLE: list[tuple[Endpoint[Any, Any], Handler]] = [
    (ep.INIT_WEIGHT_TRANSFER_ENGINE, _transfer_handler(ep.INIT_WEIGHT_TRANSFER_ENGINE, _V.init_engine, "init_info")),
    (ep.START_WEIGHT_UPDATE, _transfer_handler(ep.START_WEIGHT_UPDATE, _V.start)),
    (ep.UPDATE_WEIGHTS, _transfer_handler(ep.UPDATE_WEIGHTS, _V.update, "update_info")),
    (ep.FINISH_WEIGHT_UPDATE, _transfer_handler(ep.FINISH_WEIGHT_UPDATE, _V.finish)),
    (ep.PAUSE, pause),
    (ep.RESUME, resume),
    (ep.IS_PAUSED, is_paused),
    (ep.GET_WORLD_SIZE, get_world_size),
    (ep.SLEEP, sleep),
    (ep.WAKE_UP, wake_up),
    (ep.IS_SLEEPING, is_sleeping),
    (ep.ABORT_REQUESTS, abort_requests),
]

ROUTES: list[Route] = [route for endpoint, handler in _TABLE for route in endpoint_routes(endpoint, handler)]
