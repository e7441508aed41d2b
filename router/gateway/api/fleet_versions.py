"""``GET /fleet/versions``: the weight versions the router recorded for the fleet, and who holds which.

What the version policies (:mod:`router.gateway.routing.version_policy`) decide from, read from the
registry as it is: no worker is asked.
"""

from __future__ import annotations

from aiohttp import web

from router.contract.fleet import FleetVersions, WorkerVersionStanding
from router.contract.web.openapi import Route
from router.gateway import keys


def fleet_versions_view(app: web.Application) -> FleetVersions:
    """The fleet's recorded versions and each worker's standing, as the registry says now (``GET /fleet/status``
    reads it too)."""
    registry = app[keys.REGISTRY]
    fleet = registry.fleet
    record = fleet.record
    standings = {}
    for worker in registry:
        sequence = fleet.verified_sequence(worker.id, worker)
        standings[worker.id] = WorkerVersionStanding(
            weight_version=worker.weight_version,
            fleet_sequence=sequence,
            staleness=None if sequence is None else fleet.latest_sequence - sequence,
            paused=worker.paused,
            asleep=worker.asleep,
        )
    return FleetVersions(
        sequence=fleet.latest_sequence,
        weight_version=None if record is None else record.weight_version,
        version_policy=app[keys.CONFIG].version_policy,
        history=[] if record is None else list(record.history),
        workers=standings,
    )


async def fleet_versions(request: web.Request) -> web.Response:
    return web.json_response(fleet_versions_view(request.app).model_dump())


def routes() -> list[Route]:
    return [
        Route(
            "GET",
            "/fleet/versions",
            fleet_versions,
            "The fleet's recorded weight versions (oldest first) and the one each worker holds",
            answer=FleetVersions,
        )
    ]
