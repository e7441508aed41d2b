"""A data plane's lean server for the generation routes: an aiohttp site of the data plane's runner.

It listens on the data plane's port in place of aiohttp's TCP site. Generation requests are served
by :class:`LeanServer` with the same proxy as aiohttp's handlers, behind the same edge: the leader
gate (a standby's data planes refuse what its control process does), the access check, the error
shape, the request metrics and the graceful stop's drain. The gate and the key are checked when a
request's head is complete, before its body is read (:mod:`.connection`, :mod:`.rules`). Every other request's connection goes to
the runner's aiohttp server (:mod:`.connection`), so liveness, readiness and the relay to the control
process are served as before.

Why a server of its own: on the proxy path aiohttp's server costs most of what a proxied request costs
the router (its request and response objects, a payload stream, a writer, the router's dispatch and a
middleware chain per request). This one parses with llhttp, answers with one write, and runs one task
per request; docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

from aiohttp import web

from router.contract.errors import ApiError
from router.contract.web.auth import TokenCheck
from router.contract.web.middleware import error_answer
from router.contract.web.openapi import Route
from router.gateway import keys
from router.gateway.frontend.budget import BodyBudget
from router.gateway.frontend.connection import IDLE_S, CallerConnection
from router.gateway.frontend.wire import LeanCaller
from router.gateway.metrics import RouterMetrics
from router.gateway.routing.proxied import PROXIED, Proxied
from router.gateway.routing.proxy import GenerateProxy
from router.gateway.serving import Listen
from router.gateway.shutdown import DRAIN, RequestDrain

log = logging.getLogger(__name__)

#: How often idle connections are looked for.
SWEEP_S = 60.0


@dataclass(frozen=True, slots=True)
class Frontend:
    """What a data plane's app tells its lean server: the routes it serves, by ``(method, path)``, and its edge."""

    routes: dict[tuple[str, str], Proxied]
    check: TokenCheck
    gate: Callable[[str], web.Response | None] | None = None

    @classmethod
    def of(
        cls, table: Iterable[Route], check: TokenCheck, gate: Callable[[str], web.Response | None] | None = None
    ) -> Frontend:
        """The proxied generation routes of a route table (:data:`~router.gateway.routing.proxied.PROXIED`)."""
        served = {(r.method, r.path): PROXIED[r.path] for r in table if r.access == "generation" and r.path in PROXIED}
        return cls(served, check, gate)


FRONTEND = web.AppKey("lean_frontend", Frontend)


class LeanServer:
    """The requests of every :class:`~.connection.CallerConnection`, through the edge to the proxy."""

    def __init__(
        self,
        frontend: Frontend,
        proxy: GenerateProxy,
        metrics: RouterMetrics,
        drain: RequestDrain,
        fallback: Callable[[], asyncio.Protocol | None],
        *,
        budget: BodyBudget,
        stall_s: float,
    ):
        self.routes = frontend.routes
        self.budget = budget
        self.stall_s = stall_s
        self._check = frontend.check
        self._gate = frontend.gate
        self._proxy = proxy
        self._metrics = metrics
        self._drain = drain
        self._fallback = fallback
        self.connections: set[CallerConnection] = set()
        self.stopping = False

    def fallback(self) -> asyncio.Protocol | None:
        """aiohttp's protocol for a connection handed over, or ``None`` once it stopped."""
        return self._fallback()

    def admit(self, path: str, headers: dict[str, str]) -> web.Response | None:
        """The leader gate's answer, or the key check's refusal, of a request whose head is complete."""
        if self._gate is not None:
            gated = self._gate(path)
            if gated is not None:
                return gated
        try:
            self._check(path, headers.get("authorization"))
        except ApiError as exc:
            return error_answer(exc, "", path)
        return None

    def refused(self, method: str, path: str, status: int) -> None:
        self._metrics.observe_request(path, method, status, 0.0)

    def stalled(self) -> None:
        self._metrics.stream_stalls.inc()

    async def serve(self, caller: LeanCaller, route: Proxied) -> None:
        """One request, answered on its connection; counted as aiohttp's edge counts its requests."""
        start = time.perf_counter()
        status = 500
        task = self._drain.enter()
        if self.stopping:
            caller.keep_alive = False
        try:
            try:
                status = await self._proxy.handle(caller, route.worker_path, route.prepare)
                caller.end_stream()
            except asyncio.CancelledError:
                status = 499  # the caller went away (or the drain's grace ran out)
                raise
            except ConnectionResetError:
                raise
            except Exception as exc:
                if caller.started:  # part of the answer is out: nothing else can be said on this connection
                    log.warning("%s %s failed after its answer began: %r", caller.method, caller.path, exc)
                else:
                    status = caller.answer_with(error_answer(exc, caller.method, caller.path))
        except ConnectionResetError:
            pass  # the caller went away while its answer was written
        finally:
            self._drain.leave(task)
            self._metrics.observe_request(caller.path, caller.method, status, time.perf_counter() - start)

    def close_idle(self, idle_for_s: float = 0.0) -> None:
        """Close the connections with nothing in flight that have been silent ``idle_for_s``."""
        now = asyncio.get_running_loop().time()
        for conn in list(self.connections):
            if conn.idle and now - conn.last_read >= idle_for_s:
                conn.close()


def lean_tcp(host: str, port: int, *, reuse_port: bool = False) -> Listen:
    """:func:`router.gateway.serving.tcp`, with the generation routes served by a lean server."""
    return lambda runner: [LeanSite(runner, host, port, reuse_port=reuse_port)]


class LeanSite(web.BaseSite):
    """``host:port`` served by a :class:`LeanServer`, falling back to the runner's aiohttp server."""

    __slots__ = ("_host", "_lean", "_port", "_reuse_port", "_sweeper")

    def __init__(self, runner: web.AppRunner, host: str, port: int, *, reuse_port: bool = False):
        super().__init__(runner)
        self._host = host
        self._port = port
        self._reuse_port = reuse_port
        self._lean: LeanServer | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        app = cast(web.AppRunner, self._runner).app
        config = app[keys.CONFIG]
        metrics = app[keys.METRICS]
        budget = BodyBudget(config.body_budget_bytes())
        metrics.body_bytes_held.set_function(lambda: budget.held)
        lean = LeanServer(
            app[FRONTEND],
            app[keys.PROXY],
            metrics,
            app[DRAIN],
            self._fallback,
            budget=budget,
            stall_s=config.stream_stall_timeout_s,
        )
        self._lean = lean
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: CallerConnection(lean), self._host, self._port, backlog=self._backlog, reuse_port=self._reuse_port
        )
        self._sweeper = loop.call_later(SWEEP_S, self._sweep)

    def _fallback(self) -> asyncio.Protocol | None:
        server = self._runner.server
        return None if server is None else cast(asyncio.Protocol, server())

    def _sweep(self) -> None:
        if self._lean is not None:
            self._lean.close_idle(IDLE_S)
        self._sweeper = asyncio.get_running_loop().call_later(SWEEP_S, self._sweep)

    async def stop(self) -> None:
        """Stop listening; close the connections with nothing in flight; the rest close after their answer."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._lean is not None:
            self._lean.stopping = True
            self._lean.close_idle()
        await super().stop()
