"""Admin routes: every worker admin call, broadcast to the fleet.

Bodies are validated with the same wire models the workers use, so a
caller's mistake is a 400 here, before any worker is touched or fenced; the
original bytes are then forwarded (unknown fields included) with the
caller's ``Authorization`` header.
"""

from __future__ import annotations

from typing import Any, Coroutine

from aiohttp import web
from pydantic import BaseModel

from router.gateway import keys
from router.gateway.admin.broadcast import AdminCall, Outcome
from router.gateway.admin.operations import ABORT_WEIGHTS_UPDATE, OPERATIONS, Operation
from router.contract import admin as admin_wire
from router.contract import weight_sync as sync_wire
from router.contract.web.parsing import parse_model, read_json

# Bodies the router checks before broadcasting (the workers check them again).
VALIDATORS: dict[str, type[BaseModel]] = {
    "/pause_generation": admin_wire.PauseRequest,
    "/continue_generation": admin_wire.ContinueRequest,
    "/abort_request": admin_wire.AbortRequest,
    "/flush_cache": admin_wire.FlushCacheRequest,
    "/update_weight_version": admin_wire.UpdateWeightVersionRequest,
    "/update_weights_from_disk": admin_wire.UpdateWeightsFromDiskRequest,
    "/weights_checker": admin_wire.WeightsCheckerRequest,
    "/release_memory_occupation": admin_wire.MemoryOccupationRequest,
    "/resume_memory_occupation": admin_wire.MemoryOccupationRequest,
    "/destroy_weights_update_group": sync_wire.DestroyWeightsUpdateGroupRequest,
    "/update_weights_from_distributed": sync_wire.UpdateWeightsFromDistributedRequest,
    "/prepare_weights_update": sync_wire.PrepareWeightsUpdateRequest,
    "/complete_weights_update": sync_wire.CompleteWeightsUpdateRequest,
    "/begin_weight_update": sync_wire.BeginWeightUpdateRequest,
    "/end_weight_update": sync_wire.EndWeightUpdateRequest,
}


def _forward_headers(request: web.Request) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    auth = request.headers.get("Authorization")
    if auth is not None:
        headers["Authorization"] = auth
    return headers


async def _read(request: web.Request) -> tuple[bytes, dict[str, Any]]:
    """The raw body (forwarded as is) and its parsed, validated view (query parameters fill gaps)."""
    data = await read_json(request)
    raw = await request.read()  # aiohttp caches the bytes read_json consumed
    merged = {**request.query, **data}
    model = VALIDATORS.get(request.path)
    if model is not None:
        parse_model(model, merged)
    return raw, data


def _call(request: web.Request, op: Operation, raw: bytes, data: dict[str, Any]) -> AdminCall:
    return AdminCall(
        method=request.method, path=op.path, headers=_forward_headers(request),
        query=request.query_string, body=raw or None, timeout_s=op.timeout_for(data),
    )  # fmt: skip


def _json(status: int, body: Any) -> web.Response:
    return web.json_response(body, status=status)


async def _detached(request: web.Request, work: Coroutine[Any, Any, Outcome], name: str) -> web.Response:
    """Run a fleet operation to its end even if the caller goes away (it must settle its fence), then answer."""
    outcome = await request.app[keys.TASKS].run_detached(work, name=name)
    return _json(outcome.status, outcome.response.model_dump())


async def broadcast(request: web.Request) -> web.Response:
    """Any table route without special fleet semantics."""
    op = OPERATIONS[request.path]
    raw, data = await _read(request)
    return await _detached(request, request.app[keys.BROADCASTER].broadcast(op, _call(request, op, raw, data)), op.name)


async def model_info(request: web.Request) -> web.Response:
    op = OPERATIONS["/model_info"]
    raw, data = await _read(request)
    status, body = await request.app[keys.VIEWS].model_info(op, _call(request, op, raw, data))
    return _json(status, body)


async def get_weight_version(request: web.Request) -> web.Response:
    op = OPERATIONS["/get_weight_version"]
    raw, data = await _read(request)
    status, body = await request.app[keys.VIEWS].weight_version(op, _call(request, op, raw, data))
    return _json(status, body)


async def weights_checker(request: web.Request) -> web.Response:
    op = OPERATIONS["/weights_checker"]
    raw, data = await _read(request)
    action = parse_model(admin_wire.WeightsCheckerRequest, {**request.query, **data}).action
    status, body = await request.app[keys.VIEWS].weights_checker(op, _call(request, op, raw, data), action)
    return _json(status, body)


async def init_weights_update_group(request: web.Request) -> web.Response:
    _, data = await _read(request)
    # The router rewrites rank_offset per worker; check everything else as a worker would.
    parse_model(sync_wire.InitWeightsUpdateGroupRequest, {**data, "rank_offset": data.get("rank_offset") or 1})
    return await _detached(request, request.app[keys.GROUP_INIT].init(data, _forward_headers(request)), "init_group")


async def get_world_size(request: web.Request) -> web.Response:
    return _json(200, (await request.app[keys.GROUP_INIT].world_size()).model_dump())


async def prepare_weights_update(request: web.Request) -> web.Response:
    raw, data = await _read(request)
    return await _detached(request, request.app[keys.TWO_PHASE].prepare(data, raw, _forward_headers(request)), "prepare")


async def complete_weights_update(request: web.Request) -> web.Response:
    raw, data = await _read(request)
    return await _detached(request, request.app[keys.TWO_PHASE].complete(data, raw, _forward_headers(request)), "complete")


async def abort_weights_update(request: web.Request) -> web.Response:
    _, data = await _read(request)
    return await _detached(request, request.app[keys.TWO_PHASE].abort(data, _forward_headers(request)), ABORT_WEIGHTS_UPDATE.name)
