"""Weight-sync routes: group lifecycle, SGLang's single-phase update, and the
two-phase prepare/complete protocol. Thin handlers over
:class:`worker.transfer.session.WeightSyncController`.

Status codes: 200 on success; 400 with the SGLang body (``success: false`` or
``status: "error"``, plus ``message``) and the project's ``error.message`` on
any refusal or failure; 400 for a malformed body; 503 when the admin lock is
busy; 504 when the scheduler thread did not answer in time.

Picked up by ``worker.http.app.create_app`` through ``routes(app)``, which also
registers the controller's lifetime in ``cleanup_ctx``.
"""

from __future__ import annotations

import functools
from typing import AsyncIterator, Awaitable, Callable

from aiohttp import web
from pydantic import BaseModel

from router.protocol.weight_sync import (
    CompleteWeightsUpdateRequest,
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    PrepareWeightsUpdateRequest,
    UpdateWeightsFromDistributedRequest,
)
from router.web.errors import ApiError
from router.web.parsing import parse_body
from worker.coordinator import AdminBusy
from worker.http.keys import COORDINATOR
from worker.stage import AdminTimeout
from worker.transfer.session import WeightSyncController

WEIGHT_SYNC = web.AppKey("weight_sync", WeightSyncController)
"""The per-worker weight-sync controller (groups and the update in flight)."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _errors(fn: Handler) -> Handler:
    @functools.wraps(fn)
    async def wrapper(request: web.Request) -> web.StreamResponse:
        try:
            return await fn(request)
        except AdminTimeout as exc:
            raise ApiError(504, str(exc)) from None
        except AdminBusy as exc:
            raise ApiError(503, str(exc)) from None

    return wrapper


def _reply(answer: BaseModel, ok: bool) -> web.Response:
    body = answer.model_dump(exclude_none=True)
    if not ok:
        body["error"] = {"message": body.get("message", "")}
    return web.json_response(body, status=200 if ok else 400)


@_errors
async def init_weights_update_group(request: web.Request) -> web.Response:
    req = await parse_body(request, InitWeightsUpdateGroupRequest, allow_empty=False)
    answer = await request.app[WEIGHT_SYNC].init_group(req)
    return _reply(answer, answer.success)


@_errors
async def destroy_weights_update_group(request: web.Request) -> web.Response:
    req = await parse_body(request, DestroyWeightsUpdateGroupRequest)
    answer = await request.app[WEIGHT_SYNC].destroy_group(req)
    return _reply(answer, answer.success)


@_errors
async def update_weights_from_distributed(request: web.Request) -> web.Response:
    req = await parse_body(request, UpdateWeightsFromDistributedRequest, allow_empty=False)
    answer = await request.app[WEIGHT_SYNC].update_from_distributed(req)
    return _reply(answer, answer.success)


@_errors
async def prepare_weights_update(request: web.Request) -> web.Response:
    req = await parse_body(request, PrepareWeightsUpdateRequest, allow_empty=False)
    answer = await request.app[WEIGHT_SYNC].prepare(req)
    return _reply(answer, answer.status == "ready")


@_errors
async def complete_weights_update(request: web.Request) -> web.Response:
    req = await parse_body(request, CompleteWeightsUpdateRequest, allow_empty=False)
    answer = await request.app[WEIGHT_SYNC].complete(req)
    return _reply(answer, answer.success)


async def _controller_ctx(app: web.Application) -> AsyncIterator[None]:
    yield
    await app[WEIGHT_SYNC].close()  # leave every group, cancel a receive in flight


def routes(app: web.Application) -> list[web.RouteDef]:
    """The route table; also creates the controller and ties its lifetime to the app."""
    app[WEIGHT_SYNC] = WeightSyncController(app[COORDINATOR])
    app.cleanup_ctx.append(_controller_ctx)
    return [
        web.post("/init_weights_update_group", init_weights_update_group),
        web.post("/destroy_weights_update_group", destroy_weights_update_group),
        web.post("/update_weights_from_distributed", update_weights_from_distributed),
        web.post("/prepare_weights_update", prepare_weights_update),
        web.post("/complete_weights_update", complete_weights_update),
    ]
