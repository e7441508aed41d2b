"""LoRA routes through the router: SGLang's and vLLM's loads and unloads, made fleet-wide
(:mod:`router.gateway.sync.adapters`), and ``GET /fleet/adapters``, the fleet's adapter table.

They span the whole fleet, so a target set (``?workers=``, ``?selector=``) is refused (400).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from router.contract.errors import BadRequest
from router.contract.fleet_adapters import FleetAdapterTable
from router.contract.web.openapi import Route
from router.contract.web.parsing import parse_body
from router.gateway import keys
from router.gateway.admin import operations as ops
from router.gateway.admin.fanout import AdminCall
from router.gateway.admin.operations import Operation
from router.gateway.admin.targets import TARGET_PARAMS
from router.gateway.api.answers import answer_when_done
from router.gateway.api.headers import forward_headers
from router.gateway.sync.adapters import LoadRequest, LoraAnswer, UnloadRequest, load_adapter, unload_adapter


async def _call(request: web.Request, op: Operation[Any, LoraAnswer]) -> AdminCall[Any, LoraAnswer]:
    if not TARGET_PARAMS.isdisjoint(request.query):
        raise BadRequest(f"{op.path} spans the whole fleet: it takes no ?workers= or ?selector=")
    req = await parse_body(request, op.endpoint.request)
    headers = forward_headers(request)
    return AdminCall(op, "POST", req, headers, timeout_s=op.router_wait(req))


async def load(request: web.Request) -> web.Response:
    op: Operation[LoadRequest, LoraAnswer] = ops.OPERATIONS[request.path]  # type: ignore[assignment]
    call = await _call(request, op)
    return await answer_when_done(request, load_adapter(request.app[keys.ADMIN], op, call), op.name)


async def unload(request: web.Request) -> web.Response:
    op: Operation[UnloadRequest, LoraAnswer] = ops.OPERATIONS[request.path]  # type: ignore[assignment]
    call = await _call(request, op)
    return await answer_when_done(request, unload_adapter(request.app[keys.ADMIN], op, call), op.name)


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
            "GET",
            "/fleet/adapters",
            fleet_adapters,
            "The fleet's LoRA adapters: each one's fleet version, source and holders",
            answer=FleetAdapterTable,
        )
    ]
