"""Admin routes (SGLang / sglang-omni RL admin surface). Thin handlers: parse,
call the Coordinator, shape the response.

Admin failures answer 400 with ``{"success": false, "message", ...,
"error": {"message"}}``: SGLang's admin shape and the project's error shape at
once, so either kind of client reads the reason. Timeouts answer 504, a busy
admin lock 503, a dead scheduler thread 503.
"""

from __future__ import annotations

import functools
from typing import Any, Awaitable, Callable

from aiohttp import web

from router.contract.admin import (
    AbortRequest,
    ContinueRequest,
    EmptyRequest,
    FlushCacheRequest,
    MemoryOccupationRequest,
    PauseRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightVersionRequest,
    WeightsCheckerRequest,
)
from router.contract.errors import ApiError
from router.contract.web.parsing import parse_body
from worker.engine import admin_ops
from worker.engine.checker import engine_report
from worker.http.keys import CONFIG, COORDINATOR
from worker.stage import AdminBusy, AdminTimeout, StageResult

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
VERSION = "0.1.0"


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


async def _exclusive(request: web.Request, action: str, op: Callable[..., Any], req: Any, **extra: Any) -> web.Response:
    """Run a state-changing admin op inside the coordinator's admin section, so it
    cannot interleave with another one (a weight update, a memory release)."""
    coord = request.app[COORDINATOR]
    async with coord.admin_section(action):
        result = await coord.admin(action, functools.partial(op, req=req))
    return admin_response(result, **extra)


def admin_response(result: StageResult, **extra: Any) -> web.Response:
    return answer_response(result.body(**extra), result.success, result.message)


def answer_response(body: dict[str, Any], ok: bool, message: str) -> web.Response:
    """An SGLang admin body; a failure also carries ``error.message`` and answers 400."""
    if not ok:
        body["error"] = {"message": message}
    return web.json_response(body, status=200 if ok else 400)


# -- status --------------------------------------------------------------------------------


async def model_info(request: web.Request) -> web.Response:
    await parse_body(request, EmptyRequest)
    return web.json_response(request.app[COORDINATOR].model_info())


async def get_weight_version(request: web.Request) -> web.Response:
    """``{"weight_version"}``. Upstream SGLang v0.5.9 answers 404 here (deprecated
    in favour of ``/model_info``); slime patches it back and its client calls it."""
    return web.json_response({"weight_version": request.app[COORDINATOR].worker.weight_version})


async def server_info(request: web.Request) -> web.Response:
    """Settings, per-rank scheduler counters and the version. SGLang dumps all
    server args here, API keys included; this worker blanks the keys."""
    coord = request.app[COORDINATOR]
    states = [rank.internal_state() for rank in coord.stage.ranks]
    info = {**request.app[CONFIG].public_dict(), "tp_size": coord.stage.tp_size, "internal_states": states, "version": VERSION}
    info["weight_version"] = coord.worker.weight_version
    return web.json_response(info)


# -- weight version ----------------------------------------------------------------------


@admin_handler
async def update_weight_version(request: web.Request) -> web.Response:
    req = await parse_body(request, UpdateWeightVersionRequest, allow_empty=False)
    return await _exclusive(request, "update_weight_version", admin_ops.update_weight_version, req)


# -- pause / continue / abort / flush ------------------------------------------------------


@admin_handler
async def pause_generation(request: web.Request) -> web.Response:
    req = await parse_body(request, PauseRequest)
    result = await request.app[COORDINATOR].pause(req)
    return admin_response(result, status="ok")


@admin_handler
async def continue_generation(request: web.Request) -> web.Response:
    req = await parse_body(request, ContinueRequest)
    return await _exclusive(request, "continue_generation", admin_ops.continue_generation, req, status="ok")


@admin_handler
async def abort_request(request: web.Request) -> web.Response:
    """Prefix-match abort (SGLang); unknown rids are not an error. Aborted
    requests return 200 with ``finish_reason.type == "abort"`` to their callers."""
    req = await parse_body(request, AbortRequest)
    result = await request.app[COORDINATOR].admin("abort_request", functools.partial(admin_ops.abort_request, req=req))
    return admin_response(result)


@admin_handler
async def flush_cache(request: web.Request) -> web.Response:
    """Refused (400) while any request is active, i.e. holds KV (running or
    frozen by an ``in_place`` pause). Waiting and retracted requests hold none,
    so a ``retract`` pause allows the flush — SGLang v0.5.15 refused it there
    because its idle check counted the waiting queue (fixed in v0.5.23)."""
    req = await parse_body(request, FlushCacheRequest)
    result = await request.app[COORDINATOR].flush_cache(req.timeout)
    if not result.success:
        raise ApiError(400, result.message)
    return admin_response(result)


# -- weights ------------------------------------------------------------------------------


@admin_handler
async def update_weights_from_disk(request: web.Request) -> web.Response:
    req = await parse_body(request, UpdateWeightsFromDiskRequest, allow_empty=False)
    result = await request.app[COORDINATOR].update_weights_from_disk(req)
    return admin_response(result)


@admin_handler
async def weights_checker(request: web.Request) -> web.Response:
    req = await parse_body(request, WeightsCheckerRequest)
    result = await request.app[COORDINATOR].admin("weights_checker", functools.partial(admin_ops.weights_checker, req=req))
    return admin_response(result, **engine_report(result.rank_data))


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    """Not implemented: its payload is pickled tensors, and this worker never
    unpickles caller bytes. The body is not read."""
    raise ApiError(501, "update_weights_from_tensor is not supported by this worker; use update_weights_from_disk or update_weights_from_distributed")


# -- memory occupation ---------------------------------------------------------------------


@admin_handler
async def release_memory_occupation(request: web.Request) -> web.Response:
    """Refused while requests are active. Released weights are kept in a host
    copy and restored by resume (SGLang drops their contents)."""
    req = await parse_body(request, MemoryOccupationRequest)
    return await _exclusive(request, "release_memory_occupation", admin_ops.release_memory, req)


@admin_handler
async def resume_memory_occupation(request: web.Request) -> web.Response:
    req = await parse_body(request, MemoryOccupationRequest)
    return await _exclusive(request, "resume_memory_occupation", admin_ops.resume_memory, req)


def _get_post(path: str, handler: Handler) -> list[web.RouteDef]:
    return [web.get(path, handler), web.post(path, handler)]


ROUTES: list[web.RouteDef] = [
    *_get_post("/model_info", model_info),
    *_get_post("/get_model_info", model_info),
    web.get("/get_weight_version", get_weight_version),
    web.get("/weight_version", get_weight_version),
    web.post("/update_weight_version", update_weight_version),
    web.get("/server_info", server_info),
    web.get("/get_server_info", server_info),
    web.post("/pause_generation", pause_generation),
    web.post("/continue_generation", continue_generation),
    web.post("/abort_request", abort_request),
    *_get_post("/flush_cache", flush_cache),
    web.post("/update_weights_from_disk", update_weights_from_disk),
    *_get_post("/weights_checker", weights_checker),
    web.post("/update_weights_from_tensor", update_weights_from_tensor),
    *_get_post("/release_memory_occupation", release_memory_occupation),
    *_get_post("/resume_memory_occupation", resume_memory_occupation),
]
