"""Admin routes (SGLang / sglang-omni RL admin surface). Thin handlers: parse the
route's request model, call the Coordinator, answer the route's response model.

Admin failures answer 400 with ``{"success": false, "message", ...,
"error": {"message"}}``: SGLang's admin shape and the project's error shape at
once, so either kind of client reads the reason. Timeouts answer 504, a busy
admin lock 503, a dead scheduler thread 503.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from router.contract import endpoints as ep
from router.contract.admin import (
    AbortRequest,
    AdminResult,
    ContinueRequest,
    EmptyRequest,
    FlushCacheRequest,
    MemoryOccupationRequest,
    PauseRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
    WeightsCheckerRequest,
    WeightVersionResult,
)
from router.contract.base import WireResponse
from router.contract.endpoint import Endpoint
from router.contract.errors import ApiError
from router.contract.vllm_server import ResetPrefixCacheRequest, ResetPrefixCacheResult
from router.contract.web.openapi import Route
from router.contract.web.parsing import parse_body
from router.contract.weight_sync import PrepareWeightsUpdateResponse
from worker.engine import admin_ops
from worker.engine.checker import engine_report
from worker.engine.results import CheckerReport, wire_fields
from worker.http.keys import CONFIG, COORDINATOR
from worker.http.server_info import server_info
from worker.ranks import AdminBusy, AdminTimeout, StageResult
from worker.transfer.handles import from_tensor_request

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def admin_handler(fn: Handler) -> Handler:
    """Map coordinator failures to clear HTTP errors."""

    @functools.wraps(fn)
    async def wrapper(request: web.Request) -> web.StreamResponse:
        try:
            return await fn(request)
        except AdminTimeout as exc:
            raise ApiError(504, str(exc)) from None
        except AdminBusy as exc:
            raise ApiError(503, str(exc)) from None

    return wrapper


#: The answers that say what a call did to the weights (``weights``, ``weights_partial``) and carry
#: ``rank_results``.
RANKED_ANSWERS = (AdminResult, PrepareWeightsUpdateResponse)


def answer(request: web.Request, endpoint: Endpoint[Any, Any], model: WireResponse) -> web.Response:
    """The route's response model as JSON: 200, or 400 with ``error.message`` when it reports a failure.

    ``weights`` says what this call did to the weights. A route that never writes them
    leaves them ``intact``; one that may write them reports what it did (its handler sets
    it). ``weights_partial`` says what the weights are now, whatever the call did: already
    a mix of versions (a failed update before) or released without a copy and not yet
    rewritten. A refusal on such a worker still leaves them ``intact`` (it changed nothing);
    the worker serves nothing until they are whole, and a router keeps it pending."""
    if isinstance(model, RANKED_ANSWERS):
        said = model.weights
        if said is None and not endpoint.writes_weights:
            said = "intact"
        partial = bool(request.app[COORDINATOR].worker.weights_partial or model.weights_partial)
        model = model.model_copy(update={"weights": said, "weights_partial": partial})
        if not model.ok:  # only these answers can report a failure: 400, with ``error.message``
            model = model.failed(model.message)
    return web.json_response(model.model_dump(mode="json"), status=200 if model.ok else 400)


def stage_answer(
    request: web.Request, endpoint: Endpoint[Any, Any], result: StageResult[Any], **extra: Any
) -> web.Response:
    """A stage's aggregate as the route's response model (the JSON edge of a typed result)."""
    return answer(request, endpoint, result.response(endpoint.response, **extra))


async def _exclusive(
    request: web.Request, endpoint: Endpoint[Any, Any], op: Callable[..., Any], req: Any, **extra: Any
) -> web.Response:
    """Run a state-changing admin op inside the coordinator's admin section, so it
    cannot interleave with another one (a weight update, a memory release)."""
    coord = request.app[COORDINATOR]
    bound = endpoint.worker_bound(req)
    async with coord.admin_section(endpoint.name, bound):
        result = await coord.admin(endpoint.name, functools.partial(op, req=req), bound)
    return stage_answer(request, endpoint, result, **extra)


# -- status --------------------------------------------------------------------------------


async def model_info(request: web.Request) -> web.Response:
    await parse_body(request, EmptyRequest)
    return answer(request, ep.MODEL_INFO, request.app[COORDINATOR].model_info())


async def get_weight_version(request: web.Request) -> web.Response:
    """``{"weight_version"}``. Upstream SGLang v0.5.9 answers 404 here (deprecated
    in favour of ``/model_info``); slime patches it back and its client calls it."""
    version = request.app[COORDINATOR].worker.weight_version
    return answer(request, ep.GET_WEIGHT_VERSION, WeightVersionResult(weight_version=version))


# -- weight version ----------------------------------------------------------------------


@admin_handler
async def update_weight_version(request: web.Request) -> web.Response:
    req = await parse_body(request, UpdateWeightVersionRequest, allow_empty=False)
    return await _exclusive(request, ep.UPDATE_WEIGHT_VERSION, admin_ops.update_weight_version, req)


# -- pause / continue / abort / flush ------------------------------------------------------


@admin_handler
async def pause_generation(request: web.Request) -> web.Response:
    req = await parse_body(request, PauseRequest)
    result = await request.app[COORDINATOR].pause(req, ep.PAUSE_GENERATION.worker_bound(req))
    return stage_answer(request, ep.PAUSE_GENERATION, result, status="ok")


@admin_handler
async def continue_generation(request: web.Request) -> web.Response:
    req = await parse_body(request, ContinueRequest)
    return await _exclusive(request, ep.CONTINUE_GENERATION, admin_ops.continue_generation, req, status="ok")


@admin_handler
async def abort_request(request: web.Request) -> web.Response:
    """Prefix-match abort (SGLang); unknown rids are not an error. Aborted
    requests return 200 with ``finish_reason.type == "abort"`` to their callers."""
    req = await parse_body(request, AbortRequest)
    bound = ep.ABORT_REQUEST.worker_bound(req)
    result = await request.app[COORDINATOR].admin(
        "abort_request", functools.partial(admin_ops.abort_request, req=req), bound
    )
    return stage_answer(request, ep.ABORT_REQUEST, result)


@admin_handler
async def flush_cache(request: web.Request) -> web.Response:
    """Refused (400) while any request is active, i.e. holds KV (running or
    frozen by an ``in_place`` pause). Waiting and retracted requests hold none,
    so a ``retract`` pause allows the flush — SGLang v0.5.15 refused it there
    because its idle check counted the waiting queue (fixed in v0.5.23)."""
    req = await parse_body(request, FlushCacheRequest)
    result = await request.app[COORDINATOR].flush_cache(req.timeout, ep.FLUSH_CACHE.worker_bound(req))
    return stage_answer(request, ep.FLUSH_CACHE, result)  # a refusal: 400, the same shape as every admin failure


@admin_handler
async def reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM's flush: the same as ``/flush_cache`` without the wait, but answered as vLLM does, 200
    ``{"success": false}`` while requests hold cache (its callers retry, or carry on), never a 400."""
    req = await parse_body(request, ResetPrefixCacheRequest)
    result = await request.app[COORDINATOR].flush_cache(0.0, ep.RESET_PREFIX_CACHE.worker_bound(req))
    return answer(
        request, ep.RESET_PREFIX_CACHE, ResetPrefixCacheResult(success=result.success, message=result.message)
    )


# -- weights ------------------------------------------------------------------------------


@admin_handler
async def update_weights_from_disk(request: web.Request) -> web.Response:
    req = await parse_body(request, UpdateWeightsFromDiskRequest, allow_empty=False)
    result = await request.app[COORDINATOR].update_weights_from_disk(req, ep.UPDATE_WEIGHTS_FROM_DISK.worker_bound(req))
    return stage_answer(request, ep.UPDATE_WEIGHTS_FROM_DISK, result)


@admin_handler
async def weights_checker(request: web.Request) -> web.Response:
    req = await parse_body(request, WeightsCheckerRequest)
    bound = ep.WEIGHTS_CHECKER.worker_bound(req)
    result: StageResult[CheckerReport] = await request.app[COORDINATOR].admin(
        "weights_checker", functools.partial(admin_ops.weights_checker, req=req), bound
    )
    engine = engine_report([o.data for o in result.outcomes])
    return stage_answer(request, ep.WEIGHTS_CHECKER, result, **wire_fields(engine))


@admin_handler
async def update_weights_from_tensor(request: web.Request) -> web.Response:
    """Load tensors a colocated trainer put in shared memory: this project's JSON handle
    message (``tensor_handles``), or SGLang's pickled ``serialized_named_tensors`` when the
    worker runs with ``--allow-pickled-tensors`` (restricted unpickler). Everything is checked
    against the model before any memory is opened; the answer comes after the copy into the model."""
    req = await parse_body(request, UpdateWeightsFromTensorRequest, allow_empty=False)
    coord = request.app[COORDINATOR]
    model = coord.worker.model
    try:
        stage = from_tensor_request.prepare(
            req,
            model.checkpoint_spec(),
            model.is_ignored_weight,
            allow_pickled=request.app[CONFIG].allow_pickled_tensors,
            tp_size=coord.stage.tp_size,
        )
    except ValueError as exc:  # MetadataError, UnsafePayload, HandleError are ValueErrors
        # Refused before anything was opened: say so, so a router restores this worker's fence.
        refusal = AdminResult(success=False, message=str(exc), weights="intact")
        return answer(request, ep.UPDATE_WEIGHTS_FROM_TENSOR, refusal)
    result = await coord.update_weights_from_tensor(req, stage, ep.UPDATE_WEIGHTS_FROM_TENSOR.worker_bound(req))
    return stage_answer(request, ep.UPDATE_WEIGHTS_FROM_TENSOR, result)


# -- memory occupation ---------------------------------------------------------------------


@admin_handler
async def release_memory_occupation(request: web.Request) -> web.Response:
    """Refused while requests are active. Released weights are kept in a host
    copy and restored by resume (SGLang drops their contents)."""
    req = await parse_body(request, MemoryOccupationRequest)
    return await _exclusive(request, ep.RELEASE_MEMORY_OCCUPATION, admin_ops.release_memory, req)


@admin_handler
async def resume_memory_occupation(request: web.Request) -> web.Response:
    req = await parse_body(request, MemoryOccupationRequest)
    return await _exclusive(request, ep.RESUME_MEMORY_OCCUPATION, admin_ops.resume_memory, req)


def endpoint_routes(endpoint: Endpoint[Any, Any], handler: Handler) -> list[Route]:
    """``handler`` on every method of ``endpoint``, under its path and its older aliases.

    A ``GET`` carries no body: its request fields are all defaults (or query parameters)."""
    text = endpoint.summary
    return [
        Route(
            method,
            path,
            handler,
            text if path == endpoint.path else f"{text} (older name of {endpoint.path})",
            body=endpoint.request if method != "GET" else None,
            answer=endpoint.response,
        )
        for path in (endpoint.path, *endpoint.aliases)
        for method in endpoint.methods
    ]


ROUTES: list[Route] = [
    route
    for endpoint, handler in (
        (ep.MODEL_INFO, model_info),
        (ep.GET_WEIGHT_VERSION, get_weight_version),
        (ep.SERVER_INFO, server_info),
        (ep.UPDATE_WEIGHT_VERSION, update_weight_version),
        (ep.PAUSE_GENERATION, pause_generation),
        (ep.CONTINUE_GENERATION, continue_generation),
        (ep.ABORT_REQUEST, abort_request),
        (ep.FLUSH_CACHE, flush_cache),
        (ep.RESET_PREFIX_CACHE, reset_prefix_cache),
        (ep.UPDATE_WEIGHTS_FROM_DISK, update_weights_from_disk),
        (ep.WEIGHTS_CHECKER, weights_checker),
        (ep.UPDATE_WEIGHTS_FROM_TENSOR, update_weights_from_tensor),
        (ep.RELEASE_MEMORY_OCCUPATION, release_memory_occupation),
        (ep.RESUME_MEMORY_OCCUPATION, resume_memory_occupation),
    )
    for route in endpoint_routes(endpoint, handler)
]
