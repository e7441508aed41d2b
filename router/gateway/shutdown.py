"""The router's graceful stop: drain the requests in flight for a bounded grace, then cancel the rest.

aiohttp's own graceful stop (``AppRunner(shutdown_timeout=...)``, since 3.9) waits for busy
handlers after the sites stopped listening; past the timeout it only signals a handler through
its request's payload, which a proxy that has read its body never looks at, and then waits as
long again. :class:`RequestDrain` keeps the bound: its middleware (outermost) knows every running
handler, and once the grace has passed (or a second signal came) it cancels them; a cancelled
``/generate`` is aborted on its worker by the proxy.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from router.contract.web.middleware import Handler

log = logging.getLogger(__name__)


class RequestDrain:
    """Tracks running handlers; after :meth:`begin`, counts those that finish and cancels the rest at the grace."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.stopping = asyncio.Event()
        self._hurry = asyncio.Event()
        self._running: set[asyncio.Task[object]] = set()
        self._cut: set[asyncio.Task[object]] = set()
        self._settled = asyncio.Event()
        self._settled.set()
        self.finished = 0

    @property
    def in_flight(self) -> int:
        return len(self._running)

    @property
    def cancelled(self) -> int:
        return len(self._cut)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        task = self.enter()
        try:
            return await handler(request)
        finally:
            self.leave(task)

    def enter(self) -> asyncio.Task[object]:
        """The running task serves a request (aiohttp's through :meth:`middleware`, a data plane's lean server's
        directly); :meth:`leave` it when the answer is done."""
        task = asyncio.current_task()
        assert task is not None
        self._running.add(task)
        self._settled.clear()
        return task

    def leave(self, task: asyncio.Task[object]) -> None:
        self._running.discard(task)
        if not self._running:
            self._settled.set()
        if self.stopping.is_set() and task not in self._cut:
            self.finished += 1

    async def settled(self) -> None:
        """Wait until no request is in flight (bounded once :meth:`cancel_at_grace` runs)."""
        await self._settled.wait()

    def signal(self, name: str) -> None:
        """The first signal starts the stop; a second one cuts the drain short."""
        if self.stopping.is_set():
            log.info("%s again: cancelling the requests still in flight now", name)
            self._hurry.set()
        else:
            log.info("%s: shutting down", name)
            self.stopping.set()

    async def cancel_at_grace(self) -> None:
        """Run once the sites stopped: wait out the grace (or a second signal), then cancel what still runs."""
        try:
            await asyncio.wait_for(self._hurry.wait(), self.grace_s)
        except TimeoutError:
            pass
        self._cut.update(self._running)
        for task in list(self._cut):
            task.cancel()


#: The process's drain, for a server beside aiohttp's that serves requests too (a data plane's lean server).
DRAIN = web.AppKey("request_drain", RequestDrain)
