"""The worker's aiohttp application factory.

``create_app(config)`` loads the model (blocking, before serving), builds the
ModelWorker → Scheduler → Stage → Coordinator pipeline and one route table:
health, generation, admin and weight sync. The scheduler thread and the
weight-sync controller start and stop with the app (``cleanup_ctx``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator

from aiohttp import web

from router import __version__
from router.contract.generate import INSTANCE_HEADER
from router.contract.web.auth import auth_middleware
from router.contract.web.middleware import error_middleware
from router.contract.web.openapi import Route, openapi_route, paths_with_access, route_defs
from router.contract.web.parsing import MAX_BODY_BYTES
from worker.adapters import AdapterService
from worker.config import WorkerConfig
from worker.coordinator import Coordinator
from worker.engine.daemon_thread import abandon_pending
from worker.engine.model_worker import ModelWorker
from worker.engine.scheduler import Scheduler
from worker.http import (
    admin_routes,
    generate_routes,
    health_routes,
    lora_routes,
    openai_routes,
    peer_routes,
    tokens_routes,
    vllm_routes,
    weight_sync_routes,
)
from worker.http.keys import ADAPTERS, CONFIG, COORDINATOR
from worker.http.operation_log import operation_log
from worker.ranks import Stage
from worker.tp.follower import RankSpec
from worker.tp.peers import TP_TIMEOUT_S, TPPeers, free_local_port

log = logging.getLogger(__name__)

API_DESCRIPTION = (
    "An inference worker with SGLang's generation and RL admin surface: weight updates from disk or "
    "from a trainer's process group, checked byte for byte; refusals are 4xx with "
    '{"error": {"message": ...}} and change nothing.'
)


def route_table() -> list[Route]:
    """Every route the worker serves, ``/openapi.json`` included."""
    table = [
        *health_routes.ROUTES,
        *generate_routes.ROUTES,
        *openai_routes.ROUTES,
        *tokens_routes.ROUTES,
        *admin_routes.ROUTES,
        *weight_sync_routes.ROUTES,
        *peer_routes.ROUTES,
        *vllm_routes.ROUTES,
        *lora_routes.ROUTES,
    ]
    return [*table, openapi_route("omni-worker", __version__, table, description=API_DESCRIPTION)]


def build_coordinator(config: WorkerConfig) -> Coordinator:
    """Load the model and assemble the pipeline (threads not started yet); with ``tp_size`` > 1,
    start the follower ranks first (each loads its own shard while this one loads its own)."""
    peers, tp, device = None, None, config.device
    if config.tp_size > 1:
        spec = RankSpec(
            rank=0,
            size=config.tp_size,
            master_address="127.0.0.1",
            master_port=free_local_port(),
            model_path=config.model_path,
            device=config.device,
            dtype=config.dtype,
            timeout_s=TP_TIMEOUT_S,
            num_threads=config.num_threads,
        )
        peers, tp = TPPeers.start(spec)
        device = spec.rank_device()
    try:
        worker = ModelWorker(
            config.model_path,
            device=device,
            dtype=config.dtype,
            served_model_name=config.served_model_name,
            tp=tp,
            peers=peers,
        )
    except BaseException:
        if peers is not None:
            peers.close()
        raise
    scheduler = Scheduler(
        worker, rank=0, max_running_requests=config.max_running_requests, step_delay_s=config.step_delay_s
    )
    if peers is not None:
        # Serving with a rank missing is impossible: stop the whole worker (a supervisor restarts it).
        peers.watch(lambda _lost: os.kill(os.getpid(), signal.SIGTERM))
    return Coordinator(
        Stage("llm", scheduler, peers),
        health_check_timeout_s=config.health_check_timeout_s,
        noop_updates=config.fault_noop_updates,
    )


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    coord = app[COORDINATOR]
    coord.stage.start()
    yield
    await asyncio.get_running_loop().run_in_executor(None, coord.stage.stop)


async def _abort_on_shutdown(app: web.Application) -> None:
    """Answer every in-flight generation before the server waits for handlers."""
    coord = app[COORDINATOR]
    if coord.alive:
        try:
            await coord.generation.abort(None, abort_all=True, message="Aborted: the worker is shutting down")
        except Exception:
            log.exception("aborting requests at shutdown failed")


async def _abandon_blocked_reads(app: web.Application) -> None:
    """Give up reads stuck in the kernel (a hung mount) so their handlers answer now: the server
    waits for busy handlers before it stops, and a stuck read would make SIGTERM wait for that."""
    if abandoned := abandon_pending("the worker is shutting down"):
        log.info("shutdown: gave up %d blocked read(s)", abandoned)


async def _name_the_instance(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[INSTANCE_HEADER] = request.app[COORDINATOR].instance_id


def create_app(config: WorkerConfig, coordinator: Coordinator | None = None) -> web.Application:
    """The worker app. Without ``coordinator`` it loads the model and runs the pipeline's threads for as
    long as it serves; a ``coordinator`` passed in is one already loaded whose threads its caller
    starts and stops (one pipeline serving several apps in turn, as the in-process tests do)."""
    owned = coordinator is None
    coord = coordinator or build_coordinator(config)
    table = route_table()
    app = web.Application(
        client_max_size=MAX_BODY_BYTES,
        middlewares=[
            operation_log,
            error_middleware,
            auth_middleware(
                admin_key=config.admin_api_key,
                api_key=config.api_key,
                open_paths=paths_with_access(table, "open"),
                generation_paths=paths_with_access(table, "generation"),
            ),
        ],
    )
    app[CONFIG] = config
    app[COORDINATOR] = coord
    app[ADAPTERS] = AdapterService(
        coord.worker.model if config.enable_lora else None,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        allow_pickled=config.allow_pickled_tensors,
        stage=coord.stage,
    )
    coord.updates.leases.wait_s = config.snapshot_lease_wait_s
    app.add_routes(route_defs(table))
    # Cleanup runs in reverse: the controller cancels a receive in flight before the scheduler stops.
    if owned:
        app.cleanup_ctx.append(_engine_ctx)
    app.cleanup_ctx.extend([weight_sync_routes.controller_ctx, vllm_routes.vllm_transfer_ctx])
    app.on_response_prepare.append(_name_the_instance)
    app.on_shutdown.extend([_abandon_blocked_reads, _abort_on_shutdown])
    return app
