"""Weight-sync routes: group lifecycle, SGLang's single-phase update, and the
two-phase prepare/complete/abort protocol. Thin handlers over
:class:`worker.transfer.session.WeightSyncController`, one per row of the table
at the bottom (the controller's method and the answer's success test).

Status codes: 200 on success; 400 with the SGLang body (``success: false`` or
``status: "error"``, plus ``message``) and the project's ``error.message`` on
any refusal or failure; 400 for a malformed body; 503 when the admin lock (or,
for an abort, another weight-sync call) is busy; 504 when the scheduler thread
did not answer in time.

``/begin_weight_update`` and ``/end_weight_update`` are SGLang 0.5.23's
bracket (:mod:`worker.transfer.bracket`): accepted, not required.

``/abort_weights_update`` answers 200 only when the prepared receive was
dropped with the weights untouched; 400 when nothing was prepared for the
group, or when buckets had already been applied (``weights_partial: true``).
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Awaitable, Callable

from aiohttp import web
from pydantic import BaseModel

from router.contract.weight_sync import (
    AbortWeightsUpdateRequest,
    BeginWeightUpdateRequest,
    CompleteWeightsUpdateRequest,
    DestroyWeightsUpdateGroupRequest,
    EndWeightUpdateRequest,
    InitWeightsUpdateGroupRequest,
    PrepareWeightsUpdateRequest,
    UpdateWeightsFromDistributedRequest,
)
from router.contract.web.parsing import parse_body
from worker.http.admin_routes import Handler, admin_handler, answer_response
from worker.http.keys import COORDINATOR, WEIGHT_SYNC
from worker.transfer.session import WeightSyncController

Call = Callable[[WeightSyncController, Any], Awaitable[BaseModel]]


def _succeeded(answer: Any) -> bool:
    return bool(answer.success)


def _ready(answer: Any) -> bool:
    return answer.status == "ready"


def _handler(model: type[BaseModel], call: Call, ok: Callable[[Any], bool], *, allow_empty: bool) -> Handler:
    """Parse ``model``, run ``call`` on the controller, answer 200 if ``ok`` else 400."""

    @admin_handler
    async def handle(request: web.Request) -> web.Response:
        req = await parse_body(request, model, allow_empty=allow_empty)
        answer = await call(request.app[WEIGHT_SYNC], req)
        body = answer.model_dump(exclude_none=True)
        return answer_response(body, ok(answer), body.get("message", ""))

    return handle


async def _begin(controller: WeightSyncController, req: BeginWeightUpdateRequest) -> BaseModel:
    return controller.bracket.begin(req)


async def _end(controller: WeightSyncController, req: EndWeightUpdateRequest) -> BaseModel:
    return controller.bracket.end(req)


async def controller_ctx(app: web.Application) -> AsyncIterator[None]:
    """Create the weight-sync controller; at shutdown cancel a receive in flight and leave every group."""
    app[WEIGHT_SYNC] = WeightSyncController(app[COORDINATOR])
    yield
    await app[WEIGHT_SYNC].close()


_W = WeightSyncController
#: (path, request model, controller method, success test, whether an empty body is allowed)
_TABLE: list[tuple[str, type[BaseModel], Call, Callable[[Any], bool], bool]] = [
    ("/init_weights_update_group", InitWeightsUpdateGroupRequest, _W.init_group, _succeeded, False),
    ("/destroy_weights_update_group", DestroyWeightsUpdateGroupRequest, _W.destroy_group, _succeeded, True),
    ("/update_weights_from_distributed", UpdateWeightsFromDistributedRequest, _W.update_from_distributed, _succeeded, False),
    ("/prepare_weights_update", PrepareWeightsUpdateRequest, _W.prepare, _ready, False),
    ("/complete_weights_update", CompleteWeightsUpdateRequest, _W.complete, _succeeded, False),
    ("/abort_weights_update", AbortWeightsUpdateRequest, _W.abort, _succeeded, True),
    ("/begin_weight_update", BeginWeightUpdateRequest, _begin, _succeeded, True),
    ("/end_weight_update", EndWeightUpdateRequest, _end, _succeeded, True),
]

ROUTES: list[web.RouteDef] = [
    web.post(path, _handler(model, call, ok, allow_empty=allow_empty)) for path, model, call, ok, allow_empty in _TABLE
]
