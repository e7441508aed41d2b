"""Background work the app owns: started from handlers, awaited at shutdown.

Admin broadcasts run as owned tasks that the handler awaits through a shield:
if the caller disconnects, the broadcast still finishes and settles its
bookkeeping (restore or fail closed) instead of being cancelled halfway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from router.contract.errors import ApiError

log = logging.getLogger(__name__)

T = TypeVar("T")


async def every(pause_s: Callable[[], float], step: Callable[[], Awaitable[object]], what: str) -> None:
    """Run ``step`` now, then again after each ``pause_s()`` seconds, until cancelled: the app's background
    loops (probes, catch-up, control state). A failed step is logged and never ends the loop."""
    while True:
        try:
            await step()
        except Exception:
            log.exception("%s failed", what)
        await asyncio.sleep(pause_s())


@contextlib.asynccontextmanager
async def running(coro: Coroutine[Any, Any, object], name: str) -> AsyncIterator[asyncio.Task[object]]:
    """``coro`` as a task for as long as the context lasts (an aiohttp cleanup context's body), cancelled after."""
    task = asyncio.get_running_loop().create_task(coro, name=name)
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class TaskSet:
    """A set of tasks kept alive until done, with a bounded drain at shutdown."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str | None = None) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    async def run_detached(self, coro: Coroutine[Any, Any, T], *, name: str | None = None) -> T:
        """Run ``coro`` to completion even if the awaiting handler is cancelled."""
        return await asyncio.shield(self.spawn(coro, name=name))

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        if isinstance(exc, ApiError) and exc.status < 500:
            # A refusal (a caller's mistake, a conflict): the caller gets it; it is no failure of the router.
            log.info("%s refused (%d): %s", task.get_name(), exc.status, exc.message)
        elif isinstance(exc, ApiError) and exc.status == 503:
            # Refused for now (a lock held, a fence not acknowledged): the caller gets it and may retry.
            log.warning("%s refused (%d): %s", task.get_name(), exc.status, exc.message)
        else:
            log.error("background task %s failed: %r", task.get_name(), exc)

    async def close(self, timeout_s: float = 10.0) -> None:
        pending = list(self._tasks)
        if not pending:
            return
        _, still = await asyncio.wait(pending, timeout=timeout_s)
        for task in still:
            task.cancel()
        if still:
            await asyncio.wait(still, timeout=2.0)
