"""Serve one router app until SIGTERM or SIGINT, then stop gracefully.

The same loop serves every kind of router process: the single process (a TCP site), a data-plane
process (a TCP site shared with its siblings through ``SO_REUSEPORT``) and the control process of
a router with data planes (its private Unix socket). On the signal: ``on_stopping`` runs first
(the control process stops its data planes there, while it still answers their relayed calls),
then the sites stop listening, the requests in flight get the grace
(:class:`~router.gateway.shutdown.RequestDrain`), and the app's cleanup context closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from aiohttp import web

from router.gateway.shutdown import DRAIN, RequestDrain

log = logging.getLogger("router")

#: The sites one process listens on, given its runner.
Listen = Callable[[web.AppRunner], Sequence[web.BaseSite]]


def tcp(host: str, port: int, *, reuse_port: bool = False) -> Listen:
    return lambda runner: [web.TCPSite(runner, host, port, reuse_port=reuse_port)]


def unix(path: str) -> Listen:
    return lambda runner: [web.UnixSite(runner, path)]


@dataclass(frozen=True, slots=True)
class Hooks:
    """What a process does around serving (both optional)."""

    on_started: Callable[[list[str]], None] | None = None
    """Called with the bound addresses (``http://host:port`` or the socket path) once every site listens."""
    on_stopping: Callable[[], Awaitable[None]] | None = None
    """Awaited on the signal, before the sites stop listening."""


def app_runner(app: web.Application, grace_s: float) -> web.AppRunner:
    """The runner every router process serves ``app`` with (tests serve theirs with it too)."""
    # handler_cancellation: a caller that disconnects cancels its handler, which is how the proxy
    # learns to abort the request on the worker. shutdown_timeout: aiohttp's graceful stop is the drain.
    # lingering_time=0: a request answered without its body being read (refused at its head: no key, a
    # declared length over the bound) closes its connection at once, rather than aiohttp reading and
    # dropping what the caller still sends for up to 10 s (router/gateway/edge.py).
    return web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=grace_s, lingering_time=0)


async def serve(app: web.Application, listen: Listen, grace_s: float, hooks: Hooks = Hooks()) -> None:
    """Serve until SIGTERM or SIGINT, then stop gracefully: stop listening at once, let the requests in
    flight (streams included) finish for up to ``grace_s``, cancel what is left (the proxy aborts a
    cancelled request on its worker), close the app's cleanup context, log what was drained."""
    drain = RequestDrain(grace_s)
    app.middlewares.insert(0, drain.middleware)
    app[DRAIN] = drain
    runner = app_runner(app, drain.grace_s)
    await runner.setup()
    loop = asyncio.get_running_loop()
    cutter: asyncio.Task[None] | None = None
    try:
        for site in listen(runner):
            await site.start()
        if hooks.on_started is not None:
            hooks.on_started([_url(a) for a in runner.addresses])
        # Start-up objects never die: keep them out of every later GC pass (shorter pauses).
        gc.freeze()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, drain.signal, sig.name)
        await drain.stopping.wait()
        if hooks.on_stopping is not None:
            await hooks.on_stopping()
        # Closing the listening socket first: from here a new connection is refused (a Kubernetes
        # Service has already been told, or is being told, to send nothing more here).
        for running_site in list(runner.sites):
            await running_site.stop()
        log.info(
            "stopped accepting connections; %d request(s) in flight may finish within %gs",
            drain.in_flight,
            drain.grace_s,
        )
        cutter = loop.create_task(drain.cancel_at_grace(), name="shutdown-grace")
        # Requests a site other than aiohttp's serves are the drain's alone to wait for (the cutter bounds it).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(drain.grace_s + 5.0):
                await drain.settled()
    finally:
        # Waits for the busy handlers (at most the grace: the cutter cancels the rest), then closes the
        # cleanup context: the health task, the owned tasks (aborts sent for cancelled requests, an
        # interrupted update settled or left journaled) and the upstream session.
        await runner.cleanup()
        if cutter is not None:
            cutter.cancel()
    log.info(
        "shutdown: %d request(s) finished during the drain, %d cancelled (shutdown grace %gs)",
        drain.finished,
        drain.cancelled,
        drain.grace_s,
    )


def _url(address: object) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        host = str(address[0])
        return f"http://[{host}]:{address[1]}" if ":" in host else f"http://{host}:{address[1]}"
    return str(address)
