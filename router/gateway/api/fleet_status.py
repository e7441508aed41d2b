"""``GET /fleet/status``: every worker with the router's verdict (in rotation, or why not), the
journal and the fleet's versions, in one answer (what ``omni-router status`` and the fleet page show)."""

from __future__ import annotations

from aiohttp import web

from router.contract.fleet_status import FleetStatus
from router.contract.web.openapi import Route
from router.gateway.status.answer import read


async def fleet_status(request: web.Request) -> web.Response:
    return web.json_response((await read(request)).model_dump())


def routes() -> list[Route]:
    return [
        Route(
            "GET",
            "/fleet/status",
            fleet_status,
            "Every worker with whether it takes generation traffic and why not, the journal and the fleet's versions",
            answer=FleetStatus,
        )
    ]
