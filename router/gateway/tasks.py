"""Background work the app owns: started from handlers, awaited at shutdown.

Admin broadcasts run as owned tasks that the handler awaits through a shield:
if the caller disconnects, the broadcast still finishes and settles its
bookkeeping (restore or fail closed) instead of being cancelled halfway.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from router.contract.errors import ApiError

log = logging.getLogger(__name__)

T = TypeVar("T")


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
