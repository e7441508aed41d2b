"""LoRA routes through the router: SGLang's and vLLM's loads and unloads, made fleet-wide
(:mod:`router.gateway.sync.adapters`), and ``GET /fleet/adapters``, the fleet's adapter table.

They span the whole fleet, so a target set (``?workers=``, ``?selector=``) is refused (400). A load
through SGLang's routes may carry the trainer's digest of the adapter (``X-Expected-Weights-Checksum``,
:func:`router.dataplane.digest.adapter_checksum`): it is checked against what each worker reports it
loaded. vLLM's load answers text and reports no digest, so there the header is refused (400), as is
``X-Expected-Weights-Change`` on every adapter route (an adapter leaves the base weights as they are).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from router.contract.errors import BadRequest
from router.contract.fleet_adapters import FleetAdapterTable
from router.contract.lora import (
    SKYRL_LOAD_LORA_ADAPTER_PATH,
    SkyrlLoadLoraAdapterRequest,
    SkyrlLoraLoaded,
    VllmLoadLoraAdapterRequest,
)
from router.contract.web.openapi import Route
from router.contract.web.parsing import parse_body
from router.contract.weight_digest import EXPECTED_CHANGE_HEADER, EXPECTED_CHECKSUM_HEADER
from router.gateway import keys
from router.gateway.admin import operations as ops
from router.gateway.admin.expectation import NOTHING_SAID, Expectation
from router.gateway.admin.fanout import AdminCall
from router.gateway.admin.operations import Operation
from router.gateway.admin.targets import TARGET_PARAMS
from router.gateway.api.answers import answer_when_done, json_answer, outcome_answer
from router.gateway.api.headers import forward_headers
from router.gateway.sync.adapters import LoadRequest, LoraAnswer, UnloadRequest, load_adapter, unload_adapter


async def _call(request: web.Request, op: Operation[Any, LoraAnswer]) -> AdminCall[Any, LoraAnswer]:
    if not TARGET_PARAMS.isdisjoint(request.query):
        raise BadRequest(f"{op.path} spans the whole fleet: it takes no ?workers= or ?selector=")
    expect = _expectation(request, op)
    req = await parse_body(request, op.endpoint.request)
    headers = forward_headers(request)
    return AdminCall(op, "POST", req, headers, timeout_s=op.router_wait(req), expect=expect)


def _expectation(request: web.Request, op: Operation[Any, LoraAnswer]) -> Expectation:
    """The adapter's digest the caller expects every worker to load (400 where no answer could show it)."""
    if EXPECTED_CHANGE_HEADER in request.headers:
        raise BadRequest(f"{EXPECTED_CHANGE_HEADER} belongs on a change of the base weights, not on {op.path}")
    if EXPECTED_CHECKSUM_HEADER not in request.headers:
        return NOTHING_SAID
    if op not in (ops.LORA_LOAD, ops.LORA_LOAD_TENSORS):
        raise BadRequest(
            f"{EXPECTED_CHECKSUM_HEADER} is checked on SGLang's adapter loads ({ops.LORA_LOAD.path}, "
            f"{ops.LORA_LOAD_TENSORS.path}), whose answers report the adapter's digest; {op.path} reports none"
        )
    return Expectation.of_headers(request.headers, changes_weights=True)


async def load(request: web.Request) -> web.Response:
    op: Operation[LoadRequest, LoraAnswer] = ops.OPERATIONS[request.path]  # type: ignore[assignment]
    call = await _call(request, op)
    work = load_adapter(request.app[keys.ADMIN], op, call, request.app[keys.TASKS])
    return await answer_when_done(request, work, op.name)


async def unload(request: web.Request) -> web.Response:
    op: Operation[UnloadRequest, LoraAnswer] = ops.OPERATIONS[request.path]  # type: ignore[assignment]
    call = await _call(request, op)
    return await answer_when_done(request, unload_adapter(request.app[keys.ADMIN], op, call), op.name)


async def skyrl_load(request: web.Request) -> web.Response:
    """SkyRL's own load route, as its client posts it to every server: vLLM's load with ``load_inplace``, made
    fleet-wide like every load. SkyRL's ``in_memory`` adapters are built from tensors its own weight sync staged
    inside its vLLM workers, which no other server holds: refused (400), nothing changes."""
    if not TARGET_PARAMS.isdisjoint(request.query):
        raise BadRequest(f"{SKYRL_LOAD_LORA_ADAPTER_PATH} spans the whole fleet: it takes no ?workers= or ?selector=")
    _expectation(request, ops.V1_LORA_LOAD)
    asked = await parse_body(request, SkyrlLoadLoraAdapterRequest)
    if asked.lora_path is None:
        raise BadRequest(
            "in_memory adapters are built from tensors SkyRL staged in its own vLLM workers; load the adapter "
            "from a path (lora_path) through this router"
        )
    op = ops.V1_LORA_LOAD
    req = VllmLoadLoraAdapterRequest(lora_name=asked.lora_name, lora_path=asked.lora_path, load_inplace=True)
    call: AdminCall[Any, LoraAnswer] = AdminCall(
        op, "POST", req, forward_headers(request), timeout_s=op.router_wait(req)
    )
    tasks = request.app[keys.TASKS]
    outcome = await tasks.run_detached(load_adapter(request.app[keys.ADMIN], op, call, tasks), name=op.name)
    entry = request.app[keys.REGISTRY].adapters.get(asked.lora_name)
    if outcome.status != 200 or entry is None:
        return outcome_answer(outcome)
    # The fleet's version of the adapter stands for vLLM's per-server id: the same on every worker, new per load.
    return json_answer(200, SkyrlLoraLoaded(lora_name=asked.lora_name, lora_int_id=entry.version))


async def fleet_adapters(request: web.Request) -> web.Response:
    table = request.app[keys.REGISTRY].adapters.table()
    return web.Response(body=table.model_dump_json(), content_type="application/json")


#: The handler of each LoRA operation (``router.gateway.api.admin`` serves them under their paths).
HANDLERS = {
    ops.LORA_LOAD.path: load,
    ops.LORA_LOAD_TENSORS.path: load,
    ops.V1_LORA_LOAD.path: load,
    ops.LORA_UNLOAD.path: unload,
    ops.V1_LORA_UNLOAD.path: unload,
}


def routes() -> list[Route]:
    return [
        Route(
            "POST",
            SKYRL_LOAD_LORA_ADAPTER_PATH,
            skyrl_load,
            "SkyRL's load of a LoRA adapter from a path (vLLM's load in place), on every worker or none",
            body=SkyrlLoadLoraAdapterRequest,
            answer=SkyrlLoraLoaded,
        ),
        Route(
            "GET",
            "/fleet/adapters",
            fleet_adapters,
            "The fleet's LoRA adapters: each one's fleet version, source and holders",
            answer=FleetAdapterTable,
        ),
    ]
