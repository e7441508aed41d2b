"""One data-plane process: the generation routes from a mirror of the control process's state.

It serves the routes whose access is ``generation`` (``/generate``, the OpenAI and vLLM
token routes) with the same :class:`~router.gateway.routing.proxy.GenerateProxy` as the single
process, over a :class:`~router.gateway.fleet.registry.WorkerRegistry` that mirrors the control
process's; ``/liveness`` and ``/readiness`` answer for this process; every other route is relayed
to the control process (:mod:`.forward`). With leader election, the control process's gate is
mirrored here (:mod:`.leader_mirror`): a standby's data planes refuse what its control process does.

:class:`ControlLink` keeps the mirror: it applies each snapshot on the event loop and only then
acknowledges it, reports this process's load and the restarts its instance check sees, and
answers metrics scrapes. A data plane starts listening only once it holds a snapshot, and stops
serving (a graceful drain, as on SIGTERM) when it hears nothing from the control process for
:data:`~.hub.SILENT_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web
from pydantic import ValidationError

from router.contract.web.auth import of_requests, token_check
from router.contract.web.openapi import paths_with_access, route_defs
from router.contract.web.parsing import MAX_BODY_BYTES
from router.gateway import keys
from router.gateway.app import routes, service_headers
from router.gateway.config import RouterConfig
from router.gateway.data_planes.forward import ControlForwarder
from router.gateway.data_planes.handoff import ConnectionHandoff, handoff_path
from router.gateway.data_planes.hub import HUB_PATH, KEEPALIVE_S, LOAD_EVERY_S, SILENT_S
from router.gateway.data_planes.leader_mirror import MirroredLease, apply_gate, mirrored_gate
from router.gateway.data_planes.messages import (
    TO_DATA_PLANE,
    Ack,
    DropStale,
    LoadElsewhere,
    LoadReport,
    PinsUsed,
    Placed,
    RoutingSnapshot,
    ScrapeAnswer,
    ScrapeRequest,
    StaleDropped,
    Unpinned,
    WorkerRestarted,
)
from router.gateway.data_planes.mirror import apply
from router.gateway.data_planes.session_pins import SessionPins
from router.gateway.edge import edge_middleware, expect_after_head, route_label
from router.gateway.fleet.registry import Worker, WorkerRegistry
from router.gateway.frontend.site import FRONTEND, Frontend
from router.gateway.leader.gate import LeaderGate
from router.gateway.metrics import RouterMetrics
from router.gateway.routing.policy import make_policy
from router.gateway.routing.proxy import GenerateProxy
from router.gateway.routing.stale import StaleRequests
from router.gateway.tasks import TaskSet
from router.gateway.upstream import WorkerClient

log = logging.getLogger(__name__)

FORWARDER = web.AppKey("control_forwarder", ControlForwarder)
#: How long a new data plane waits for its first snapshot before it gives up (and is restarted).
FIRST_SNAPSHOT_S = 30.0


class ControlLink:
    """This process's WebSocket to the control process (see the module docstring)."""

    def __init__(
        self,
        socket_path: str,
        index: int,
        registry: WorkerRegistry,
        metrics: RouterMetrics,
        admin_key: str | None,
        gate: tuple[LeaderGate, MirroredLease] | None = None,
    ):
        self.socket_path = socket_path
        self.gate = gate
        # The hub's route sits behind the control process's admin key, like every non-open route.
        self._headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.index = index
        self.registry = registry
        self.metrics = metrics
        self.ready = asyncio.Event()
        self.version = 0
        self._socket: aiohttp.ClientWebSocketResponse | None = None
        self._outbox: asyncio.Queue[str] = asyncio.Queue()
        self.pins: SessionPins | None = None
        """Copies of the control process's session pins (``--session-affinity``; :mod:`.session_pins`)."""
        self.stale: StaleRequests | None = None
        """This process's requests a pause may drop (the proxy's, once it exists)."""
        self._drops: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        """Hold the link until it breaks; then stop this process (SIGTERM: a graceful drain)."""
        connector = aiohttp.UnixConnector(path=self.socket_path)
        try:
            async with (
                aiohttp.ClientSession(connector=connector) as session,
                session.ws_connect(
                    f"http://control{HUB_PATH}?index={self.index}",
                    headers=self._headers,
                    heartbeat=KEEPALIVE_S,
                    receive_timeout=SILENT_S,
                    max_msg_size=64 * 1024 * 1024,
                    # A local socket: compressing every snapshot would only cost both ends CPU on the fence's path.
                    compress=0,
                ) as socket,
            ):
                self._socket = socket
                sender = asyncio.create_task(self._send_loop(socket), name="control-link-send")
                reporter = asyncio.create_task(self._report_load(), name="control-link-load")
                try:
                    await self._receive_loop(socket)
                finally:
                    sender.cancel()
                    reporter.cancel()
                    await asyncio.gather(sender, reporter, return_exceptions=True)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.error("data plane %d: the link to the control process broke: %r", self.index, exc)
        else:
            log.error("data plane %d: the control process closed the link", self.index)
        os.kill(os.getpid(), signal.SIGTERM)

    async def _receive_loop(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        async for message in socket:
            if message.type != aiohttp.WSMsgType.TEXT:
                return
            try:
                parsed = TO_DATA_PLANE.validate_json(message.data)
            except ValidationError as exc:
                log.error("data plane %d: unreadable message from the control process: %s", self.index, exc)
                continue
            if isinstance(parsed, RoutingSnapshot):
                self._apply(parsed)
            elif isinstance(parsed, LoadElsewhere):
                for worker in self.registry:
                    worker.inflight_elsewhere = parsed.inflight.get(worker.id, 0)
            elif isinstance(parsed, Placed):
                if self.pins is not None:
                    self.pins.answered(parsed.id, parsed.worker)
            elif isinstance(parsed, Unpinned):
                if self.pins is not None:
                    self.pins.forget(parsed.rows)
            elif isinstance(parsed, ScrapeRequest):
                text = self.metrics.render().decode()
                self.post(ScrapeAnswer(id=parsed.id, text=text).model_dump_json())
            elif isinstance(parsed, DropStale):
                # Off the receive loop: the aborts wait on workers, and snapshots must keep being applied.
                task = asyncio.create_task(self._drop_stale(parsed), name="drop-stale")
                self._drops.add(task)
                task.add_done_callback(self._drops.discard)

    async def _drop_stale(self, order: DropStale) -> None:
        dropped = 0
        if self.stale is not None:
            dropped = await self.stale.drop(order.next_sequence, order.workers, order.wait_s)
        self.post(StaleDropped(id=order.id, dropped=dropped).model_dump_json())

    def _apply(self, snapshot: RoutingSnapshot) -> None:
        if snapshot.version < self.version:
            return  # never go back to an older state (a keepalive raced a newer snapshot)
        apply(self.registry, snapshot)
        if self.gate is not None:
            apply_gate(*self.gate, snapshot.gate)
        self.version = snapshot.version
        # Applied synchronously above: from here no pick, and no first byte, goes to a fenced worker.
        self.post(Ack(version=snapshot.version).model_dump_json())
        self.ready.set()

    def post(self, text: str) -> None:
        self._outbox.put_nowait(text)

    def worker_restarted(self, worker: Worker) -> None:
        if worker.instance_id is not None:
            self.post(WorkerRestarted(worker=worker.id, instance_id=worker.instance_id).model_dump_json())

    async def _send_loop(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        while True:
            await socket.send_str(await self._outbox.get())

    async def _report_load(self) -> None:
        last: LoadReport | None = None
        while True:
            await asyncio.sleep(LOAD_EVERY_S)
            now = LoadReport(
                inflight={w.id: w.inflight for w in self.registry if w.inflight},
                adapters=dict(self.registry.adapters.inflight),
            )
            if now != last:
                self.post(now.model_dump_json())
                last = now
            used = self.pins.take_used() if self.pins is not None else []
            if used:
                self.post(PinsUsed(rows=used).model_dump_json())


CONTROL_LINK = web.AppKey("control_link", ControlLink)
#: The catch-all route of what this process relays to the control process.
RELAYED = "/{tail:.*}"


def _served_here(request: web.Request) -> bool:
    """A relayed request is counted once, by the control process; what this process serves, here."""
    return route_label(request) != "/{tail}"


async def liveness(_request: web.Request) -> web.Response:
    return web.json_response({"status": "alive"})


async def readiness(request: web.Request) -> web.Response:
    """Ready when this process holds a snapshot in which some worker is routable."""
    link = request.app[CONTROL_LINK]
    routable = len(request.app[keys.REGISTRY].routable())
    if not link.ready.is_set() or routable == 0:
        return web.json_response({"status": "not_ready", "reason": "no routable worker"}, status=503)
    return web.json_response({"status": "ready", "routable_workers": routable})


def create_data_plane_app(config: RouterConfig, socket_path: str, index: int) -> web.Application:
    """The app one data-plane process serves (the generation routes of the router's one table)."""
    registry = WorkerRegistry()
    metrics = RouterMetrics(registry, fleet_gauges=False)
    table = routes()
    # With leader election a standby's data planes refuse as its control process does (.leader_mirror).
    gate = mirrored_gate() if config.leader_election else None
    check = token_check(
        admin_key=config.admin_api_key,
        api_key=config.api_key,
        open_paths=paths_with_access(table, "open"),
        generation_paths=paths_with_access(table, "generation"),
    )
    access = of_requests(check)
    answer_gate = gate[0].answer if gate is not None else None
    app = web.Application(
        middlewares=[edge_middleware(access, metrics, counted=_served_here, gate=answer_gate)],
        client_max_size=MAX_BODY_BYTES,
    )
    link = ControlLink(socket_path, index, registry, metrics, config.admin_api_key, gate)
    if config.session_affinity:
        link.pins = SessionPins(
            ttl_s=config.session_affinity_ttl_s,
            max_sessions=config.session_affinity_max_sessions,
            post=link.post,
            stats=metrics.affinity,
        )
    handed = frozenset(r.path for r in table if r.access == "admin" and r.method == "POST" and "{" not in r.path)
    handoff = ConnectionHandoff(handoff_path(socket_path), handed, on_handed=metrics.handed_connections.inc)
    forwarder = ControlForwarder(socket_path, handoff)
    app[keys.CONFIG] = config
    app[keys.REGISTRY] = registry
    app[keys.METRICS] = metrics
    app[keys.TASKS] = TaskSet()
    app[keys.SERVICE_HEADERS] = service_headers(config)
    app[CONTROL_LINK] = link
    app[FORWARDER] = forwarder
    served = [r for r in table if r.access == "generation"]
    # The lean server's share of them, when it serves (run_data_plane).
    app[FRONTEND] = Frontend.of(served, check, gate[0].answer_path if gate is not None else None)
    expect = expect_after_head(access, answer_gate)
    app.router.add_routes(route_defs(served, expect))
    app.router.add_get("/liveness", liveness)
    app.router.add_get("/readiness", readiness)
    app.router.add_route("*", RELAYED, forwarder.handle, expect_handler=expect)
    app.cleanup_ctx.append(_data_plane_ctx)
    return app


async def _data_plane_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[keys.CONFIG]
    link = app[CONTROL_LINK]
    workers = WorkerClient(stream_limit=cfg.max_connections, connect_timeout_s=cfg.connect_timeout_s)
    app[keys.WORKERS] = workers
    app[keys.PROXY] = GenerateProxy(
        config=cfg,
        registry=app[keys.REGISTRY],
        policy=make_policy(cfg.policy),
        workers=workers,
        metrics=app[keys.METRICS],
        tasks=app[keys.TASKS],
        service_headers=app[keys.SERVICE_HEADERS],
        on_restarted=link.worker_restarted,
        placer=link.pins.choose if link.pins is not None else None,
    )
    link.stale = app[keys.PROXY].stale
    task = asyncio.create_task(link.run(), name="control-link")
    try:
        async with asyncio.timeout(FIRST_SNAPSHOT_S):
            await link.ready.wait()
    except TimeoutError:
        task.cancel()
        raise RuntimeError(f"no routing snapshot from the control process within {FIRST_SNAPSHOT_S:g}s") from None
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await app[keys.TASKS].close()
        await workers.close()
        await app[FORWARDER].close()
