"""``GET /fleet/status``: every worker with the router's verdict (in rotation, or why not), the
journal and the fleet's versions, in one answer (what ``omni-router status`` and the fleet page show).

Each part is read as the route that serves it alone reads it (``GET /workers``,
``/weight_update_journal``, ``/fleet/versions``, ``/leader``), so the combined answer cannot say
something else than they do; the verdicts are judged where they live (:mod:`router.gateway.status.verdict`).
Nothing here awaits I/O: the parts are read in one turn of the event loop, so the verdicts, the journal
and the versions are of the same moment.
"""

from __future__ import annotations

import time

from aiohttp import web

from router.contract.fleet import JournalView, LeaderView
from router.contract.fleet_status import FleetStatus
from router.contract.web.openapi import Route
from router.gateway import keys
from router.gateway.api.fleet_versions import fleet_versions_view
from router.gateway.status.verdict import fleet_status as judge_fleet


def _leader(app: web.Application) -> LeaderView:
    gate = app.get(keys.LEADER_GATE)
    # Only an open gate lets an admin route run: a standby never gets here.
    return LeaderView(role="single") if gate is None else gate.view()


async def read(request: web.Request) -> FleetStatus:
    read_at = time.time()
    app = request.app
    registry = app[keys.REGISTRY]
    status = judge_fleet(
        [registry.record(w) for w in registry],
        JournalView(pending=app[keys.JOURNAL].pending, storage=app[keys.STATE].view()),
        fleet_versions_view(app),
        _leader(app),
        read_at=read_at,
    )
    admin = app.get(keys.ADMIN)
    status.last_update = admin.last_update if admin is not None else None
    return status


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
