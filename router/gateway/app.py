"""The router application: ``create_app(config)`` with one route table.

Shared state lives under the typed keys in :mod:`router.gateway.keys`. The worker
client (:class:`~router.gateway.upstream.WorkerClient`), the objects that use it and the
health-check task are created in a cleanup context, so they exist only while the app runs
and are closed in reverse order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from router import __version__
from router.contract.fleet import (
    AddWorkerRequest,
    JournalResolved,
    JournalResolveRequest,
    JournalView,
    LeaderView,
    RemovedWorker,
    UpdateWorkerRequest,
    WorkerList,
    WorkerRecord,
    WorkerUrlQuery,
)
from router.contract.generate import GenerateRequest, GenerateResponse
from router.contract.web.auth import of_requests, token_check
from router.contract.web.openapi import Route, openapi_route, paths_with_access, route_defs
from router.contract.web.parsing import MAX_BODY_BYTES
from router.gateway import keys
from router.gateway.admin.fanout import FanOut
from router.gateway.admin.fleet_views import FleetViews
from router.gateway.admin.journal import JOURNAL_FILE, UpdateJournal, keep_fenced
from router.gateway.admin.locked import AdminContext
from router.gateway.admin.stale_at_pause import DEFAULT_WAIT_S, StaleAtPause
from router.gateway.admin.update_gate import UpdateGate
from router.gateway.api import adapters, admin, dashboard, fleet, fleet_status, fleet_versions, openai, rl, tokens
from router.gateway.api.proxied import proxied
from router.gateway.catch_up.adapters import adapter_catch_up_ctx
from router.gateway.catch_up.fleet_state import control_sync_ctx
from router.gateway.catch_up.joiners import catch_up_ctx
from router.gateway.config import RouterConfig
from router.gateway.discovery.k8s import KubernetesPods
from router.gateway.discovery.reconcile import DiscoveredFleet
from router.gateway.edge import edge_middleware, expect_after_head
from router.gateway.fleet.adapters import ADAPTERS_FILE
from router.gateway.fleet.groups import GROUPS_FILE, WeightGroups
from router.gateway.fleet.registry import HealthThresholds, WorkerRegistry
from router.gateway.fleet.weights import FLEET_FILE, FleetWeights
from router.gateway.frontend.site import FRONTEND, Frontend
from router.gateway.health import HealthChecker, WorkerProber
from router.gateway.leadership import Leadership
from router.gateway.metrics import RouterMetrics
from router.gateway.routing.affinity import SessionAffinity
from router.gateway.routing.policy import make_policy
from router.gateway.routing.proxy import GenerateProxy
from router.gateway.state.durable import DurableState
from router.gateway.sync.ranks import GroupInitializer
from router.gateway.sync.two_phase import TwoPhaseCoordinator
from router.gateway.sync.weight_transfer import WeightTransfer
from router.gateway.tasks import TaskSet
from router.gateway.upstream import WorkerClient

log = logging.getLogger(__name__)

API_DESCRIPTION = (
    "One URL for a fleet of inference workers: generation is routed to workers that hold the "
    "fleet's weights; admin calls are broadcast to every live worker under one update lock. "
    'Refusals are 4xx with {"error": {"message": ...}} and change nothing.'
)


def routes() -> list[Route]:
    """Every route the router serves (``/openapi.json`` is added by :func:`create_app`)."""
    gen = "Generate on one routable worker (SGLang's /generate; streams when asked)"
    return [
        Route("POST", "/generate", proxied, gen, access="generation", body=GenerateRequest, answer=GenerateResponse),
        Route("PUT", "/generate", proxied, gen, access="generation", body=GenerateRequest, answer=GenerateResponse),
        *openai.routes(),
        *tokens.routes(),
        *fleet_versions.routes(),
        *fleet_status.routes(),
        *adapters.routes(),
        Route("GET", "/health", fleet.health, "The router process serves", access="open"),
        Route("GET", "/liveness", fleet.liveness, "The router process serves", access="open"),
        Route("GET", "/readiness", fleet.readiness, "At least one worker takes generation traffic", access="open"),
        Route(
            "GET",
            "/leader",
            fleet.leader,
            "This replica serves the admin routes (503 on a standby of --leader-election)",
            access="open",
            answer=LeaderView,
        ),
        Route("GET", "/metrics", fleet.metrics, "Prometheus metrics", access="open", media_type="text/plain"),
        Route("GET", "/workers", fleet.list_workers, "The worker registry", answer=WorkerList),
        Route(
            "POST",
            "/workers",
            fleet.add_worker,
            "Register a worker",
            body=AddWorkerRequest,
            answer=WorkerRecord,
            answer_status=201,
        ),
        Route("GET", "/workers/{worker_id}", fleet.get_worker, "One worker", answer=WorkerRecord),
        Route(
            "PUT",
            "/workers/{worker_id}",
            fleet.update_worker,
            "Set a worker's operator flag",
            body=UpdateWorkerRequest,
            answer=WorkerRecord,
        ),
        Route("DELETE", "/workers/{worker_id}", fleet.delete_worker, "Deregister a worker", answer=RemovedWorker),
        Route(
            "POST",
            "/add_worker",
            fleet.legacy_add_worker,
            "Register a worker (SGLang router spelling)",
            query=WorkerUrlQuery,
        ),
        Route(
            "POST",
            "/remove_worker",
            fleet.legacy_remove_worker,
            "Deregister a worker (SGLang router spelling)",
            query=WorkerUrlQuery,
        ),
        Route("GET", "/list_workers", fleet.legacy_list_workers, "The worker registry (SGLang router spelling)"),
        Route(
            "GET",
            "/weight_update_journal",
            fleet.get_journal,
            "The unresolved failed update, if any",
            answer=JournalView,
        ),
        Route(
            "POST",
            "/weight_update_journal/resolve",
            fleet.resolve_journal,
            "An operator vouches for the fleet",
            body=JournalResolveRequest,
            answer=JournalResolved,
        ),
        *admin.routes(),
        *rl.routes(),
        *dashboard.routes(),
    ]


def service_headers(config: RouterConfig) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    key = config.key_for_workers
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return headers


async def upstream_ctx(app: web.Application) -> AsyncIterator[None]:
    """The worker client, everything that uses it, and the health loop."""
    cfg = app[keys.CONFIG]
    workers = WorkerClient(stream_limit=cfg.max_connections, connect_timeout_s=cfg.connect_timeout_s)
    app[keys.WORKERS] = workers
    prober = WorkerProber(workers, timeout_s=cfg.health_check_timeout_s, headers=app[keys.SERVICE_HEADERS])
    ctx = AdminContext(
        registry=app[keys.REGISTRY],
        gate=app[keys.GATE],
        journal=app[keys.JOURNAL],
        metrics=app[keys.METRICS],
        fanout=FanOut(workers),
        prober=prober,
        # Read off the event loop: the store may be the Kubernetes API.
        groups=await asyncio.to_thread(WeightGroups, app[keys.STATE].record(GROUPS_FILE)),
        verify_updates=cfg.verify_updates,
        min_routable_workers=cfg.min_routable_workers,
    )
    await asyncio.to_thread(ctx.registry.adapters.attach, app[keys.STATE].record(ADAPTERS_FILE))
    ctx.registry.adapters.keep_versions = cfg.lora_keep_versions
    hub = app.get(keys.DATA_PLANES)
    if hub is not None:  # the control process of a router with data-plane processes
        ctx.barrier = hub
    app[keys.ADMIN] = ctx
    app[keys.PROXY] = GenerateProxy(
        config=cfg,
        registry=app[keys.REGISTRY],
        policy=make_policy(cfg.policy),
        workers=workers,
        metrics=app[keys.METRICS],
        tasks=app[keys.TASKS],
        service_headers=app[keys.SERVICE_HEADERS],
        affinity=app.get(keys.SESSIONS),
    )
    # A pause drops the requests it makes stale in this process and, through the hub, in every data plane.
    wait_s = hub.ack_timeout_s if hub is not None else DEFAULT_WAIT_S
    ctx.stale = StaleAtPause(ctx.registry, app[keys.PROXY].stale, hub, wait_s)
    app[keys.GROUP_INIT] = GroupInitializer(ctx)
    app[keys.TWO_PHASE] = TwoPhaseCoordinator(
        ctx, app[keys.TASKS], prepared_life_s=cfg.update_session_timeout_s, service_headers=app[keys.SERVICE_HEADERS]
    )
    app[keys.WEIGHT_TRANSFER] = WeightTransfer(
        ctx, app[keys.TASKS], prepared_life_s=cfg.update_session_timeout_s, service_headers=app[keys.SERVICE_HEADERS]
    )
    app[keys.VIEWS] = FleetViews(ctx)
    checker = HealthChecker(app[keys.REGISTRY], prober, interval_s=cfg.health_check_interval_s)
    app[keys.HEALTH] = checker
    app[keys.HEALTH_TASK] = asyncio.get_running_loop().create_task(checker.run(), name="health-checker")
    try:
        yield
    finally:
        app[keys.HEALTH_TASK].cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await app[keys.HEALTH_TASK]
        await app[keys.TASKS].close()
        await workers.close()


async def discovery_ctx(app: web.Application) -> AsyncIterator[None]:
    """Service discovery (``--service-discovery k8s``): the pod watch and the registry reconciler."""
    cfg = app[keys.CONFIG]
    if cfg.service_discovery != "k8s":
        yield
        return
    fleet = DiscoveredFleet(
        app[keys.REGISTRY],
        app[keys.GATE],
        app[keys.JOURNAL],
        app[keys.HEALTH],
        default_engine=cfg.fixed_engine,
        barrier=app[keys.ADMIN].barrier,
    )
    pods = KubernetesPods(
        selector=cfg.selector, on_change=fleet.offer, namespace=cfg.discovery_namespace, port=cfg.discovery_port
    )
    app[keys.DISCOVERY] = fleet
    app[keys.DISCOVERY_STATUS] = pods.status
    loop = asyncio.get_running_loop()
    tasks = [
        loop.create_task(pods.run(), name="k8s-pod-watch"),
        loop.create_task(fleet.run(), name="discovered-fleet"),
    ]
    tasks[0].add_done_callback(_report_crash)
    tasks[1].add_done_callback(_report_crash)
    app[keys.DISCOVERY_TASKS] = tasks
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _report_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s stopped: %r; the registry keeps the workers it has", task.get_name(), task.exception())


def _restore_journal(registry: WorkerRegistry, journal: UpdateJournal) -> None:
    """A previous run left an unresolved update: keep its targets out of routing."""
    keep_fenced(registry, journal.load_or_unreadable([(w.id, w.url) for w in registry]))


def durable_state(config: RouterConfig) -> DurableState:
    """The records' store: ConfigMaps (``--state-store k8s``: every replica reads them), a directory, or memory."""
    if config.effective_state_store == "k8s":
        from router.gateway.state.k8s_store import KubernetesStore  # the k8s extra, only when asked for

        return DurableState(KubernetesStore(prefix=config.state_configmap_prefix))
    return DurableState.in_directory(config.state_dir)


def create_app(config: RouterConfig) -> web.Application:
    """Build the router app; workers in ``config.worker_urls`` are registered in order."""
    config.validate()
    thresholds = HealthThresholds(
        failure=config.health_failure_threshold, dead=config.dead_threshold, success=config.health_success_threshold
    )
    state = durable_state(config)
    registry = WorkerRegistry(thresholds=thresholds, fleet=FleetWeights(state.record(FLEET_FILE)))
    for url in config.worker_urls:
        registry.add(url, engine=config.fixed_engine)
    journal = UpdateJournal(state.record(JOURNAL_FILE))
    # With leader election the journal is read by the replica that takes the lease (a standby writes nothing).
    leader = Leadership.for_config(config) if config.leader_election else None
    if leader is None:
        _restore_journal(registry, journal)
    metrics = RouterMetrics(registry, journal=journal, leader=leader.gate if leader is not None else None)
    table = routes()
    table.append(openapi_route("omni-router", __version__, table, description=API_DESCRIPTION))

    check = token_check(
        admin_key=config.admin_api_key,
        api_key=config.api_key,
        open_paths=paths_with_access(table, "open"),
        generation_paths=paths_with_access(table, "generation"),
    )
    # A standby's gate answers before the key is checked: nothing runs there either way.
    gate = leader.gate.answer if leader is not None else None
    access = of_requests(check)
    app = web.Application(middlewares=[edge_middleware(access, metrics, gate=gate)], client_max_size=MAX_BODY_BYTES)
    # The generation routes' share of the table, for a lean server when the process serves one (cli.py).
    app[FRONTEND] = Frontend.of(table, check, leader.gate.answer_path if leader is not None else None)
    app[keys.CONFIG] = config
    app[keys.REGISTRY] = registry
    app[keys.JOURNAL] = journal
    app[keys.STATE] = state
    app[keys.METRICS] = metrics
    if config.session_affinity:  # one table, shared with the data planes through the hub
        app[keys.SESSIONS] = SessionAffinity.from_config(config, metrics.affinity)
    app[keys.GATE] = UpdateGate(config.admin_lock_timeout_s, on_wait=metrics.observe_lock_wait)
    app[keys.TASKS] = TaskSet()
    app[keys.SERVICE_HEADERS] = service_headers(config)
    app.router.add_routes(route_defs(table, expect_after_head(access, gate)))
    app.cleanup_ctx.append(state.retry_ctx)
    app.cleanup_ctx.append(upstream_ctx)
    app.cleanup_ctx.append(discovery_ctx)
    app.cleanup_ctx.append(catch_up_ctx)  # after the worker client: stopped before it closes
    app.cleanup_ctx.append(control_sync_ctx)
    app.cleanup_ctx.append(adapter_catch_up_ctx)
    if leader is not None:
        leader.install(app)  # last: its takeover needs everything above
    return app
