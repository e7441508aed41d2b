"""Admin routes: every worker admin call, broadcast to the fleet.

Each handler parses the body (query parameters fill missing fields) into the
route's request model, once: a caller's mistake is a 400 here, before any
worker is touched or fenced. The model is passed on typed and serialized again
for the workers (:meth:`~router.contract.base.WireRequest.to_json`: the fields
the caller set, unknown fields included), with the router's own worker key.

The generic broadcasts (every route without a handler of its own, vLLM's pause and resume, the
is-paused and is-sleeping reads, abort_requests) take a target set in the query
(``?workers=id,...`` and/or ``?selector=...``, :mod:`router.gateway.admin.targets`), resolved
before the lock; the router takes those parameters out of the query before the body is parsed and
before the query is forwarded. The other routes span the whole fleet and refuse them (400).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar
from urllib.parse import urlencode

from aiohttp import web
from pydantic import BaseModel

from router.contract import endpoints as ep
from router.contract.base import WireRequest, WireResponse
from router.contract.errors import BadRequest
from router.contract.fleet import FleetModelInfo, FleetWeightVersion, WorldSizeResponse
from router.contract.fleet_answers import (
    AbortRequestsFleetAnswer,
    IsPausedFleetAnswer,
    IsSleepingFleetAnswer,
    PauseFleetAnswer,
)
from router.contract.vllm import PauseStatus
from router.contract.web.openapi import Route
from router.contract.web.parsing import parse_model, query_fields, read_json
from router.gateway import keys
from router.gateway.admin import operations as ops
from router.gateway.admin.broadcast import broadcast
from router.gateway.admin.expectation import Expectation
from router.gateway.admin.fanout import AdminCall
from router.gateway.admin.operations import COLLECTIVE_RPC_READ, OPERATIONS, Operation
from router.gateway.admin.targets import TARGET_PARAMS, FleetFacts, only_ids, target_query
from router.gateway.api import adapters, areal
from router.gateway.api.answers import answer_when_done, json_answer, outcome_answer
from router.gateway.api.headers import forward_headers
from router.gateway.sync.ranks import GroupJoin

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Req = TypeVar("Req", bound=WireRequest)
Resp = TypeVar("Resp", bound=WireResponse)


def fleet_facts(app: web.Application) -> FleetFacts:
    """What the target sets and the RL API read of each worker, over the app's worker client."""
    timeout_s = app[keys.CONFIG].health_check_timeout_s
    return FleetFacts(app[keys.REGISTRY], app[keys.WORKERS], app[keys.SERVICE_HEADERS], timeout_s)


async def parse_request(request: web.Request, op: Operation[Req, Resp], *, targeted: bool = True) -> Req:
    """The request model of ``op`` from the body, query parameters filling the gaps (vLLM's dev routes,
    ``/pause``, ``/sleep``, ``/wake_up``, take their arguments in the query, and they win over the body's;
    the model coerces their text). The target parameters are never fields; a route that is not
    ``targeted`` refuses them."""
    if not targeted and not TARGET_PARAMS.isdisjoint(request.query):
        raise BadRequest(f"{op.path} spans the whole fleet: it takes no ?workers= or ?selector=")
    data = await read_json(request, allow_empty=True)
    if op.endpoint.query_params:
        fields = {k: v for k, v in query_fields(request, op.endpoint.request).items() if k not in TARGET_PARAMS}
        return parse_model(op.endpoint.request, {**data, **fields})
    query = {k: request.query[k] for k in request.query if k not in TARGET_PARAMS}
    return parse_model(op.endpoint.request, {**query, **data})


async def _parse(request: web.Request, op: Operation[Req, Resp]) -> Req:
    """The request of a route that spans the whole fleet (it refuses a target set)."""
    return await parse_request(request, op, targeted=False)


def forwarded_query(request: web.Request) -> str:
    """The caller's query string as the workers get it: without the target parameters."""
    if TARGET_PARAMS.isdisjoint(request.query):
        return request.query_string
    return urlencode([(k, v) for k, v in request.query.items() if k not in TARGET_PARAMS])


def _call(
    request: web.Request, op: Operation[Req, Resp], req: Req, only: frozenset[str] | None = None
) -> AdminCall[Req, Resp]:
    return AdminCall(
        op,
        request.method,
        req,
        forward_headers(request),
        timeout_s=op.router_wait(req),
        query=forwarded_query(request),
        only=only,
        expect=Expectation.of_headers(request.headers, changes_weights=op.changes_weights),
    )


async def _targeted(request: web.Request, op: Operation[Req, Resp]) -> AdminCall[Req, Resp]:
    """Parse ``op``'s request and resolve the caller's target set (404/400 before anything is locked)."""
    req = await parse_request(request, op)
    workers = await fleet_facts(request.app).resolve(target_query(request.query))
    return _call(request, op, req, only_ids(workers))


def check_floor(request: web.Request, op: Operation[Req, Resp], only: frozenset[str] | None = None) -> None:
    """409 when ``op`` starts a weight sync the fleet is too thin to take (``--min-routable-workers``,
    :mod:`router.gateway.admin.floor`): after the body and the targets are read, before the update lock."""
    request.app[keys.ADMIN].refuse_below_floor(op, only)


async def broadcast_route(request: web.Request) -> web.Response:
    """Any table route without fleet semantics of its own."""
    op = OPERATIONS[request.path]
    call = await _targeted(request, op)
    check_floor(request, op, call.only)
    return await answer_when_done(request, broadcast(request.app[keys.ADMIN], op, call), op.name)


async def model_info(request: web.Request) -> web.Response:
    req = await _parse(request, ops.MODEL_INFO)
    status, body = await request.app[keys.VIEWS].model_info(_call(request, ops.MODEL_INFO, req))
    return json_answer(status, body)


async def get_weight_version(request: web.Request) -> web.Response:
    req = await _parse(request, ops.GET_WEIGHT_VERSION)
    status, body = await request.app[keys.VIEWS].weight_version(_call(request, ops.GET_WEIGHT_VERSION, req))
    return json_answer(status, body)


async def weight_info(request: web.Request) -> web.Response:
    """vLLM's ``/weight_info``: the version every worker holds, 409 when they differ (as ``/get_weight_version``)."""
    status, body = await request.app[keys.VIEWS].weight_info(await _targeted(request, ops.WEIGHT_INFO))
    return json_answer(status, body)


async def vllm_weight_checker(request: web.Request) -> web.Response:
    call = await _targeted(request, ops.WEIGHT_CHECKER)
    outcome = await request.app[keys.VIEWS].vllm_weight_checker(call.request, call)
    return outcome_answer(outcome)


async def collective_rpc(request: web.Request) -> web.Response:
    """vLLM's ``/collective_rpc``, admin-only: any worker method can change the weights, so the call is a fenced,
    journaled weight update (its targets recorded on a new fleet version) unless the method is known to read only."""
    req = await parse_request(request, ops.COLLECTIVE_RPC)
    op = COLLECTIVE_RPC_READ if req.reads_only else ops.COLLECTIVE_RPC
    workers = await fleet_facts(request.app).resolve(target_query(request.query))
    call = _call(request, op, req, only_ids(workers))
    check_floor(request, op, call.only)
    return await answer_when_done(request, broadcast(request.app[keys.ADMIN], op, call), op.name)


async def shutdown_weight_transfer_engine(request: web.Request) -> web.Response:
    """vLLM's ``/shutdown_weight_transfer_engine`` on every worker; the router then forgets the group vLLM's
    init built (a later ``/start_weight_update`` needs a new ``/init_weight_transfer_engine``)."""
    op = ops.SHUTDOWN_WEIGHT_TRANSFER_ENGINE
    call = _call(request, op, await _parse(request, op))
    admin = request.app[keys.ADMIN]
    outcome = await request.app[keys.TASKS].run_detached(broadcast(admin, op, call), name=op.name)
    group = admin.groups.latest("vllm")
    if group is not None and any(r.success for r in outcome.answer.results):
        await admin.groups.dropped(group)
    return outcome_answer(outcome)


async def server_info(request: web.Request) -> web.Response:
    req = await _parse(request, ops.SERVER_INFO)
    outcome = await request.app[keys.VIEWS].server_info(req, _call(request, ops.SERVER_INFO, req))
    return outcome_answer(outcome)


async def reset_prefix_cache(request: web.Request) -> web.Response:
    req = await _parse(request, ops.RESET_PREFIX_CACHE)
    outcome = await request.app[keys.VIEWS].reset_prefix_cache(_call(request, ops.RESET_PREFIX_CACHE, req))
    return outcome_answer(outcome)


async def weights_checker(request: web.Request) -> web.Response:
    req = await _parse(request, ops.WEIGHTS_CHECKER)
    outcome = await request.app[keys.VIEWS].weights_checker(req, _call(request, ops.WEIGHTS_CHECKER, req))
    return outcome_answer(outcome)


async def init_weights_update_group(request: web.Request) -> web.Response:
    req = await _parse(request, ops.INIT_GROUP)
    init = request.app[keys.GROUP_INIT].init(GroupJoin.sglang(req), forward_headers(request))
    return await answer_when_done(request, init, "init_group")


async def get_world_size(request: web.Request) -> web.Response:
    return json_answer(200, await request.app[keys.GROUP_INIT].world_size())


async def prepare_weights_update(request: web.Request) -> web.Response:
    req = await _parse(request, ops.PREPARE)
    check_floor(request, ops.PREPARE)
    return await answer_when_done(
        request, request.app[keys.TWO_PHASE].prepare(req, forward_headers(request)), "prepare"
    )


async def complete_weights_update(request: web.Request) -> web.Response:
    req = await _parse(request, ops.COMPLETE)
    return await answer_when_done(
        request,
        request.app[keys.TWO_PHASE].complete(
            req, forward_headers(request), Expectation.of_headers(request.headers, changes_weights=True)
        ),
        "complete",
    )


async def abort_weights_update(request: web.Request) -> web.Response:
    req = await _parse(request, ops.ABORT)
    return await answer_when_done(request, request.app[keys.TWO_PHASE].abort(req, forward_headers(request)), "abort")


# -- vLLM's weight-transfer API


async def init_weight_transfer_engine(request: web.Request) -> web.Response:
    req = await _parse(request, ops.INIT_WEIGHT_TRANSFER)
    init = request.app[keys.GROUP_INIT].init(GroupJoin.vllm(req), forward_headers(request))
    return await answer_when_done(request, init, "init_weight_transfer_engine")


async def start_weight_update(request: web.Request) -> web.Response:
    req = await _parse(request, ops.START)
    check_floor(request, ops.START)
    work = request.app[keys.WEIGHT_TRANSFER].start(req, forward_headers(request))
    return await answer_when_done(request, work, "start_weight_update")


async def update_weights(request: web.Request) -> web.Response:
    req = await _parse(request, ops.UPDATE)
    work = request.app[keys.WEIGHT_TRANSFER].update(req, forward_headers(request))
    return await answer_when_done(request, work, "update_weights")


async def finish_weight_update(request: web.Request) -> web.Response:
    req = await _parse(request, ops.FINISH)
    expect = Expectation.of_headers(request.headers, changes_weights=True)
    work = request.app[keys.WEIGHT_TRANSFER].finish(req, forward_headers(request), expect)
    return await answer_when_done(request, work, "finish_weight_update")


async def pause_or_resume(request: web.Request) -> web.Response:
    """vLLM's ``/pause`` (fenced like ``/pause_generation``) and ``/resume`` (like ``/continue_generation``):
    ``status`` is the workers' (``paused``, ``resumed``) once every one of them answered it."""
    op: Operation[WireRequest, PauseStatus] = ops.PAUSE if request.path == ops.PAUSE.path else ops.RESUME
    call = await _targeted(request, op)
    outcome = await request.app[keys.TASKS].run_detached(broadcast(request.app[keys.ADMIN], op, call), name=op.name)
    answer = outcome.answer
    statuses = {r.body.status for r in answer.results if r.body is not None}
    if outcome.ok and isinstance(answer, PauseFleetAnswer) and len(statuses) == 1:
        answer.status = statuses.pop()
    return json_answer(outcome.status, answer)


async def is_paused(request: web.Request) -> web.Response:
    """``{"is_paused": true}`` only when every live worker says so."""
    outcome = await broadcast(request.app[keys.ADMIN], ops.IS_PAUSED, await _targeted(request, ops.IS_PAUSED))
    answer = outcome.answer
    if isinstance(answer, IsPausedFleetAnswer):
        answer.is_paused = outcome.ok and all(r.body is not None and r.body.is_paused for r in answer.results)
    return json_answer(outcome.status, answer)


async def is_sleeping(request: web.Request) -> web.Response:
    """``{"is_sleeping": true}`` only when every live worker says so."""
    outcome = await broadcast(request.app[keys.ADMIN], ops.IS_SLEEPING, await _targeted(request, ops.IS_SLEEPING))
    answer = outcome.answer
    if isinstance(answer, IsSleepingFleetAnswer):
        answer.is_sleeping = outcome.ok and all(r.body is not None and r.body.is_sleeping for r in answer.results)
    return json_answer(outcome.status, answer)


async def abort_requests(request: web.Request) -> web.Response:
    """vLLM's ``/abort_requests`` on every live worker: ``aborted`` is the sum of what each one ended."""
    op = ops.ABORT_REQUESTS
    outcome = await broadcast(request.app[keys.ADMIN], op, await _targeted(request, op))
    answer = outcome.answer
    if isinstance(answer, AbortRequestsFleetAnswer):
        answer.aborted = sum(r.body.aborted for r in answer.results if r.body is not None)
        answer.status = "aborted" if outcome.ok else "error"
    return json_answer(outcome.status, answer)


#: Operations whose fleet semantics need more than the generic broadcast.
_SPECIAL: dict[str, Handler] = {
    ep.MODEL_INFO.path: model_info,
    ep.GET_WEIGHT_VERSION.path: get_weight_version,
    ep.WEIGHTS_CHECKER.path: weights_checker,
    ep.SERVER_INFO.path: server_info,
    ep.RESET_PREFIX_CACHE.path: reset_prefix_cache,
    ep.INIT_WEIGHTS_UPDATE_GROUP.path: init_weights_update_group,
    ep.PREPARE_WEIGHTS_UPDATE.path: prepare_weights_update,
    ep.COMPLETE_WEIGHTS_UPDATE.path: complete_weights_update,
    ep.ABORT_WEIGHTS_UPDATE.path: abort_weights_update,
    ep.INIT_WEIGHT_TRANSFER_ENGINE.path: init_weight_transfer_engine,
    ep.START_WEIGHT_UPDATE.path: start_weight_update,
    ep.UPDATE_WEIGHTS.path: update_weights,
    ep.FINISH_WEIGHT_UPDATE.path: finish_weight_update,
    ep.PAUSE.path: pause_or_resume,
    ep.RESUME.path: pause_or_resume,
    ep.IS_PAUSED.path: is_paused,
    ep.IS_SLEEPING.path: is_sleeping,
    ep.ABORT_REQUESTS.path: abort_requests,
    ep.WEIGHT_INFO.path: weight_info,
    ep.WEIGHT_CHECKER.path: vllm_weight_checker,
    ep.COLLECTIVE_RPC.path: collective_rpc,
    ep.SHUTDOWN_WEIGHT_TRANSFER_ENGINE.path: shutdown_weight_transfer_engine,
    **adapters.HANDLERS,
}

#: The router's answer where it is not the workers' answers lifted to the fleet.
_ANSWERS: dict[str, type[BaseModel]] = {
    ep.MODEL_INFO.path: FleetModelInfo,
    ep.GET_WEIGHT_VERSION.path: FleetWeightVersion,
    ep.WEIGHT_INFO.path: FleetWeightVersion,
}


def routes() -> list[Route]:
    """One route per method of every operation, plus the router's own ``/get_world_size`` and AReaL's vLLM pause
    and continue (:mod:`router.gateway.api.areal`: translated per engine, not broadcast as they came)."""
    table = [
        Route(
            "GET",
            "/get_world_size",
            get_world_size,
            "Ranks the fleet takes in a weight-update group",
            answer=WorldSizeResponse,
        )
    ]
    for path, op in OPERATIONS.items():
        handler = _SPECIAL.get(path, broadcast_route)
        summary = f"Every live worker: {op.endpoint.summary}" + (" (fenced; fails closed)" if op.fenced else "")
        answer = _ANSWERS.get(path, op.answer_model())
        for method in op.endpoint.methods:
            body = op.endpoint.request if method != "GET" else None
            table.append(Route(method, path, handler, summary, body=body, answer=answer))
    table.extend(areal.routes())
    return table
