"""The admin update lock: one fleet-changing admin operation at a time.

Pause, group init/destroy and every weight-update route hold this gate while
they run. A caller that cannot get it within the timeout gets 503 instead of
queueing forever. ``is_busy`` (held, or someone waiting) is what registry
changes consult to answer 409, so the target set of an update cannot shift
under it.

The gate is taken and given back only through a
:class:`~router.gateway.admin.locked.LockHold`: by an
:class:`~router.gateway.admin.locked.AdminRun` (a two-phase update keeps it from its
prepare to its complete) and by discovery's registry changes; ``holder`` names who holds it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from router.contract.errors import Unavailable


@dataclass(slots=True)
class Holder:
    operation: str
    since: float


class UpdateGate:
    """An asyncio lock with an acquire timeout, a waiter count and wait-time reporting."""

    def __init__(self, timeout_s: float, *, on_wait: Callable[[str, float, bool], None] | None = None):
        self.timeout_s = timeout_s
        self._lock = asyncio.Lock()
        self._waiters = 0
        self._holder: Holder | None = None
        self._on_wait = on_wait

    @property
    def is_busy(self) -> bool:
        """True while an update holds the gate or waits for it."""
        return self._lock.locked() or self._waiters > 0

    @property
    def waiters(self) -> int:
        """How many operations wait for the gate now."""
        return self._waiters

    @property
    def holder(self) -> Holder | None:
        return self._holder

    async def acquire(self, operation: str, timeout_s: float | None = None) -> None:
        """Take the gate or raise 503 after ``timeout_s`` (default: the configured timeout)."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        self._waiters += 1
        try:
            async with asyncio.timeout(limit):
                await self._lock.acquire()
        except TimeoutError:
            waited = time.monotonic() - start
            self._report(operation, waited, False)
            held = self._holder
            by = f" (held by {held.operation} for {time.monotonic() - held.since:.1f}s)" if held else ""
            raise Unavailable(
                f"admin update lock not acquired within {limit:g}s{by}; another update operation is in progress"
            ) from None
        finally:
            self._waiters -= 1
        self._holder = Holder(operation, time.monotonic())
        self._report(operation, time.monotonic() - start, True)

    def release(self) -> None:
        self._holder = None
        self._lock.release()

    def _report(self, operation: str, waited: float, acquired: bool) -> None:
        if self._on_wait is not None:
            self._on_wait(operation, waited, acquired)
