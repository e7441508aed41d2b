"""Weight-sync routes: group lifecycle, SGLang's single-phase update, and the
two-phase prepare/complete/abort protocol. Thin handlers over
:class:`worker.transfer.group.controller.WeightSyncController` (the groups) and its
adapters (:mod:`worker.transfer.group.two_phase`, :mod:`worker.transfer.group.single_phase`),
one per row of the table at the bottom (its endpoint, the call, whether an empty
body is allowed).

Status codes: 200 on success; 400 with the SGLang body (``success: false`` or
``status: "error"``, plus ``message``) and the project's ``error.message`` on
any refusal or failure; 400 for a malformed body; 503 when another weight-sync
call or another update holds the worker past the call's lock wait (30 s, or the
call's own ``timeout_s`` when shorter; 10 s for an abort: the lock order in
:mod:`worker.coordinator`); 504 when the scheduler thread did not answer in time.

``/begin_weight_update`` and ``/end_weight_update`` are SGLang 0.5.23's
bracket (:mod:`worker.transfer.group.bracket`): accepted, not required.

``/abort_weights_update`` answers 200 only when the prepared receive was
dropped with the weights untouched; 400 when nothing was prepared for the
group, or when buckets had already been applied (``weights_partial: true``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from router.contract import endpoints as ep
from router.contract.admin import RankResult
from router.contract.base import WireRequest, WireResponse
from router.contract.endpoint import Endpoint
from router.contract.web.openapi import Route
from router.contract.web.parsing import parse_body
from worker.http.admin_routes import RANKED_ANSWERS, Handler, admin_handler, answer, endpoint_routes
from worker.http.keys import COORDINATOR, WEIGHT_SYNC
from worker.transfer.group.controller import WeightSyncController

Call = Callable[[WeightSyncController, Any], Awaitable[WireResponse]]


def _handler(endpoint: Endpoint[Any, Any], call: Call, *, allow_empty: bool) -> Handler:
    """Parse the endpoint's request, run ``call`` on the controller, answer its response model."""

    @admin_handler
    async def handle(request: web.Request) -> web.Response:
        req: WireRequest = await parse_body(request, endpoint.request, allow_empty=allow_empty)
        response = await call(request.app[WEIGHT_SYNC], req)
        return answer(request, endpoint, with_rank_results(response, request.app[COORDINATOR].stage.tp_size))

    return handle


def with_rank_results(response: WireResponse, tp_size: int) -> WireResponse:
    """One ``rank_results`` entry per TP rank. A weight-sync call's outcome is decided for the whole
    stage by rank 0 (a follower's failure fails the call and is named in its message), so every rank
    reports that outcome."""
    if not isinstance(response, RANKED_ANSWERS) or response.rank_results:
        return response
    response.rank_results = [
        RankResult(rank=r, tp_rank=r, tp_size=tp_size, success=response.ok, message=response.message)
        for r in range(tp_size)
    ]
    return response


async def _begin(controller: WeightSyncController, req: Any) -> WireResponse:
    return controller.bracket.begin(req)


async def _end(controller: WeightSyncController, req: Any) -> WireResponse:
    return controller.bracket.end(req)


async def controller_ctx(app: web.Application) -> AsyncIterator[None]:
    """Create the weight-sync controller; at shutdown cancel a receive in flight and leave every group."""
    app[WEIGHT_SYNC] = WeightSyncController(app[COORDINATOR])
    yield
    await app[WEIGHT_SYNC].close()


_W = WeightSyncController
#: (endpoint, the call on the controller or its adapter, whether an empty body is allowed)
_TABLE: list[tuple[Endpoint[Any, Any], Call, bool]] = [
    (ep.INIT_WEIGHTS_UPDATE_GROUP, _W.init_group, False),
    (ep.DESTROY_WEIGHTS_UPDATE_GROUP, _W.destroy_group, True),
    (ep.UPDATE_WEIGHTS_FROM_DISTRIBUTED, lambda sync, req: sync.single_phase.update(req), False),
    (ep.PREPARE_WEIGHTS_UPDATE, lambda sync, req: sync.two_phase.prepare(req), False),
    (ep.COMPLETE_WEIGHTS_UPDATE, lambda sync, req: sync.two_phase.complete(req), False),
    (ep.ABORT_WEIGHTS_UPDATE, lambda sync, req: sync.two_phase.abort(req), True),
    (ep.BEGIN_WEIGHT_UPDATE, _begin, True),
    (ep.END_WEIGHT_UPDATE, _end, True),
]

ROUTES: list[Route] = [
    route
    for endpoint, call, allow_empty in _TABLE
    for route in endpoint_routes(endpoint, _handler(endpoint, call, allow_empty=allow_empty))
]
