"""One update held across calls, and its expiry: the shape both worker holders share.

A two-phase update is held from prepare to complete or abort; vLLM's from
``/start_weight_update`` to ``/finish_weight_update``. Either holds the worker's
writer lock (:mod:`worker.update_pipeline`) in between, so nobody may hold it forever:

- :meth:`Held.hold` records the update and starts its expiry task.
- :meth:`Held.detach` is called by whoever now ends the update (its closing call,
  a failure, the expiry, shutdown); it cancels the expiry task unless that task is
  the caller.
- The expiry sleeps until ``expires_at()`` (which a later call may push back), then
  hands the update to ``end``; ``end`` takes the adapter's call lock, checks that the
  update is still the one held, and returns ``False`` to be tried again later (the
  lock was busy).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

U = TypeVar("U")

#: How long the expiry waits before trying again when ``end`` could not end the update yet.
RETRY_S = 1.0


class Held(Generic[U]):
    """At most one held update, with the task that ends it once it expires."""

    def __init__(self, name: str):
        self._name = name
        self._current: U | None = None
        self._expiry: asyncio.Task[None] | None = None

    @property
    def current(self) -> U | None:
        return self._current

    def hold(self, update: U, *, expires_at: Callable[[], float], end: Callable[[U], Awaitable[bool]]) -> None:
        """Hold ``update`` until :meth:`detach`; past ``expires_at()`` (a monotonic time), ``end`` it."""
        self._current = update
        self._expiry = asyncio.get_running_loop().create_task(self._expire(update, expires_at, end), name=self._name)

    def detach(self, update: U) -> None:
        """The caller now ends ``update``: it is no longer held, and its expiry is called off."""
        if self._current is update:
            self._current = None
            expiry, self._expiry = self._expiry, None
            if expiry is not None and expiry is not asyncio.current_task():
                expiry.cancel()

    async def _expire(self, update: U, expires_at: Callable[[], float], end: Callable[[U], Awaitable[bool]]) -> None:
        while self._current is update:
            await asyncio.sleep(max(expires_at() - time.monotonic(), 0.0))
            if self._current is not update:
                return
            if time.monotonic() < expires_at():
                continue  # a later call pushed the expiry back
            if await end(update):
                return
            await asyncio.sleep(RETRY_S)
