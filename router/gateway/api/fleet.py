"""Registry, health and journal routes."""

from __future__ import annotations

from typing import Literal

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from router.contract.errors import Conflict
from router.contract.fleet import (
    AddWorkerRequest,
    EngineName,
    JournalResolved,
    JournalResolveRequest,
    JournalView,
    LeaderView,
    UpdateWorkerRequest,
    WorkerList,
    WorkerRecord,
    WorkerUrlQuery,
)
from router.contract.web.parsing import parse_body, parse_model
from router.gateway import keys
from router.gateway.data_planes.metrics_merge import SCRAPE_S, merge
from router.gateway.fleet.registry import Worker, WorkerRegistry
from router.gateway.routing.proxy import describe_fleet


def _guard_registry_change(request: web.Request) -> None:
    gate = request.app[keys.GATE]
    if gate.is_busy:
        holder = gate.holder
        what = f" ({holder.operation})" if holder else ""
        raise Conflict(f"a weight update is in progress{what}; the worker registry cannot change until it ends")


async def _take_out(request: web.Request, worker: Worker) -> None:
    """Take ``worker`` out of routing and return once every routing process has applied it (with
    data-plane processes, their acknowledgement); if one has not in time, put it back and 503."""
    was = worker.disabled
    worker.disabled = True
    try:
        await request.app[keys.ADMIN].barrier.confirm(f"taking {worker.id} out of routing refused")
    except BaseException:
        worker.disabled = was
        raise


def _engine(app: web.Application, asked: EngineName | Literal["auto"] | None) -> EngineName | None:
    """The engine a new worker is registered with: the one asked for, ``None`` to detect it (``auto``), or
    the router's ``--worker-engine`` when the caller named none."""
    if asked is None:
        return app[keys.CONFIG].fixed_engine
    if asked == "auto":
        return None
    return asked


async def _add(
    request: web.Request, url: str, disabled: bool, engine: EngineName | Literal["auto"] | None = None
) -> Worker:
    _guard_registry_change(request)
    app = request.app
    worker = app[keys.REGISTRY].add(url, disabled=disabled, source="api", engine=_engine(app, engine))
    if app[keys.JOURNAL].names(worker.id):
        worker.disabled = True  # an unresolved failed update named this worker
    # First probe outside the update lock: a blackholed worker must not stall updates.
    await app[keys.HEALTH].check(worker)
    return worker


async def list_workers(request: web.Request) -> web.Response:
    registry = request.app[keys.REGISTRY]
    body = WorkerList(workers=[registry.record(w) for w in registry])
    return web.json_response(body.model_dump())


async def add_worker(request: web.Request) -> web.Response:
    req = await parse_body(request, AddWorkerRequest)
    worker = await _add(request, req.url, req.disabled, req.engine)
    return web.json_response(request.app[keys.REGISTRY].record(worker).model_dump(), status=201)


async def get_worker(request: web.Request) -> web.Response:
    worker = request.app[keys.REGISTRY].get(request.match_info["worker_id"])
    return web.json_response(request.app[keys.REGISTRY].record(worker).model_dump())


async def update_worker(request: web.Request) -> web.Response:
    req = await parse_body(request, UpdateWorkerRequest, allow_empty=False)
    _guard_registry_change(request)
    worker = request.app[keys.REGISTRY].get(request.match_info["worker_id"])
    if req.disabled:
        await _take_out(request, worker)
    else:
        worker.disabled = False
        await request.app[keys.JOURNAL].discard_target(worker.id)
    return web.json_response(request.app[keys.REGISTRY].record(worker).model_dump())


async def delete_worker(request: web.Request) -> web.Response:
    _guard_registry_change(request)
    registry = request.app[keys.REGISTRY]
    await _take_out(request, registry.get(request.match_info["worker_id"]))
    worker = registry.remove(request.match_info["worker_id"])
    return web.json_response({"removed": request.app[keys.REGISTRY].record(worker).model_dump()})


async def legacy_add_worker(request: web.Request) -> web.Response:
    query = parse_model(WorkerUrlQuery, dict(request.query))
    worker = await _add(request, query.url, False)
    return web.json_response(
        {
            "success": True,
            "message": f"added {worker.url}",
            "worker": request.app[keys.REGISTRY].record(worker).model_dump(),
        }
    )


async def legacy_remove_worker(request: web.Request) -> web.Response:
    query = parse_model(WorkerUrlQuery, dict(request.query))
    _guard_registry_change(request)
    registry = request.app[keys.REGISTRY]
    await _take_out(request, registry.get(query.url))
    worker = registry.remove(query.url)
    return web.json_response({"success": True, "message": f"removed {worker.url}"})


async def legacy_list_workers(request: web.Request) -> web.Response:
    registry: WorkerRegistry = request.app[keys.REGISTRY]
    workers = list(registry)
    return web.json_response(
        {"urls": [w.url for w in workers], "workers": [registry.record(w).model_dump() for w in workers]}
    )


async def health(request: web.Request) -> web.Response:
    """200 while the process serves, whatever the workers' state: a trainer must reach the admin routes
    even when no worker is routable. Says how discovery fares when it is on."""
    routable = len(request.app[keys.REGISTRY].routable())
    body: dict[str, object] = {"status": "ok", "routable_workers": routable}
    storage = request.app[keys.STATE].view()
    if storage is not None:
        body["state_storage"] = storage.model_dump()
    status = request.app.get(keys.DISCOVERY_STATUS)
    if status is not None:
        body["discovery"] = status.view()
    gate = request.app.get(keys.LEADER_GATE)
    if gate is not None:
        body["leader"] = gate.view().model_dump(exclude_none=True)
    return web.json_response(body)


async def leader(request: web.Request) -> web.Response:
    """200 while this replica serves the admin routes (the leader, or a router without leader election);
    503 on a standby: the readiness probe of replicated routers, so their Service reaches the leader only."""
    gate = request.app.get(keys.LEADER_GATE)
    view = LeaderView(role="single") if gate is None else gate.view()
    return web.json_response(view.model_dump(), status=200 if gate is None or gate.is_open else 503)


async def liveness(request: web.Request) -> web.Response:
    return web.json_response({"status": "alive"})


async def readiness(request: web.Request) -> web.Response:
    registry = request.app[keys.REGISTRY]
    routable = len(registry.routable())
    if routable == 0:
        return web.json_response({"status": "not_ready", "reason": describe_fleet(registry)}, status=503)
    return web.json_response({"status": "ready", "routable_workers": routable})


async def get_journal(request: web.Request) -> web.Response:
    view = JournalView(pending=request.app[keys.JOURNAL].pending, storage=request.app[keys.STATE].view())
    return web.json_response(view.model_dump())


async def resolve_journal(request: web.Request) -> web.Response:
    """The operator vouches for the fleet: restore each journaled worker's previous flag, drop the entry."""
    req = await parse_body(request, JournalResolveRequest, allow_empty=False)
    if not req.acknowledge:
        raise Conflict('nothing resolved: send {"acknowledge": true} to confirm the fleet is consistent')
    _guard_registry_change(request)
    journal = request.app[keys.JOURNAL]
    registry = request.app[keys.REGISTRY]
    pending = journal.pending
    restored: list[WorkerRecord] = []
    if pending is not None:
        for target in pending.targets:
            worker = registry.find(target.id)
            if worker is not None:
                worker.disabled = target.previous_disabled
                restored.append(registry.record(worker))
        await journal.clear()
    # The same vouching covers a fleet-weights record that could not be read: the workers become its holders.
    rebuilt = await registry.fleet.vouch((w.id, w.weights) for w in registry if not w.is_dead)
    answer = JournalResolved(
        success=True, resolved=pending is not None or rebuilt, workers=restored, fleet_record_rebuilt=rebuilt
    )
    return web.json_response(answer.model_dump())


async def metrics(request: web.Request) -> web.Response:
    hub = request.app.get(keys.DATA_PLANES)
    if hub is None:
        body = request.app[keys.METRICS].render()
    else:  # the whole router: this process's series and every data plane's, summed
        body = merge(request.app[keys.METRICS].registry.collect(), await hub.scrape(SCRAPE_S))
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
