"""The loop every catch-up shares: scan the registry every :data:`SCAN_S`, repair at most one worker per
scan under the admin update lock, and back off per worker after a failure.

A repair waits at most :data:`LOCK_WAIT_S` for the update lock: a fleet update in progress wins, and the
worker is looked at again on a later scan. One repair per scan keeps the lock free between them for the
fleet's own updates. A worker's failures put its next try off exponentially (:data:`FIRST_BACKOFF_S`
doubling to :data:`MAX_BACKOFF_S`), so one that keeps failing does not take the lock on every scan; the
count is forgotten once the worker needs no repair or one succeeds. A loop may cap the count
(:attr:`Backoff.limit`): a worker that reached it is not tried again until the loop forgets it. The loops
run only in the control process and, with ``--leader-election``, only while this replica leads: a standby
changes no worker.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Generic, Self, TypeVar

from aiohttp import web

from router.contract.errors import Unavailable
from router.gateway import keys
from router.gateway.admin.locked import AdminContext, LockHold
from router.gateway.fleet.registry import Worker
from router.gateway.leader.gate import LeaderGate
from router.gateway.tasks import every
from router.gateway.upstream import WorkerClient

#: How often the registry is scanned for workers to repair.
SCAN_S = 0.5
#: How long a repair waits for the update lock before it leaves it to a fleet update and retries later.
LOCK_WAIT_S = 0.5
#: The first retry's delay after a failure; it doubles per failure up to :data:`MAX_BACKOFF_S`.
FIRST_BACKOFF_S = 2.0
MAX_BACKOFF_S = 60.0


def backoff_s(attempts: int) -> float:
    """The delay before the next attempt after ``attempts`` failures (>= 1)."""
    return min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2.0 ** max(0, attempts - 1))


@dataclass(slots=True, kw_only=True)
class Tries:
    """A worker's failed attempts in a row, and when the next may start (on its :class:`Backoff`'s clock)."""

    attempts: int = 0
    next_try_at: float = 0.0


# Covariant: a loop that keeps more about a worker's failures (a subclass of Tries) still has a Backoff[Tries].
TriesT = TypeVar("TriesT", bound=Tries, covariant=True)


class Backoff(Generic[TriesT]):
    """Each worker's :class:`Tries`, by worker id; a worker without any may be tried at once.

    ``new`` makes a worker's first record (a loop may keep more about its failures than their count);
    ``clock`` is what :attr:`Tries.next_try_at` is measured on; ``limit``: failures after which a worker is
    :meth:`exhausted` and never due again until its record is forgotten or restarted (``None``: no limit)."""

    def __init__(
        self,
        new: Callable[[Worker], TriesT],
        *,
        clock: Callable[[], float] = time.monotonic,
        limit: int | None = None,
    ) -> None:
        self._new = new
        self._clock = clock
        self.limit = limit
        self._tries: dict[str, TriesT] = {}

    def now(self) -> float:
        return self._clock()

    def get(self, worker_id: str) -> TriesT | None:
        return self._tries.get(worker_id)

    def attempts(self, worker_id: str) -> int:
        tries = self._tries.get(worker_id)
        return 0 if tries is None else tries.attempts

    def exhausted(self, worker_id: str) -> bool:
        """Whether the worker failed :attr:`limit` times: no back-off ends for it."""
        return self.limit is not None and self.attempts(worker_id) >= self.limit

    def due(self, worker_id: str, now: float) -> bool:
        """Whether the worker's back-off, if any, is over at ``now`` (never, once it is :meth:`exhausted`)."""
        tries = self._tries.get(worker_id)
        return tries is None or (tries.next_try_at <= now and not self.exhausted(worker_id))

    def entry(self, worker: Worker) -> TriesT:
        """The worker's record, made now if it has none."""
        return self._tries.setdefault(worker.id, self._new(worker))

    def restart(self, worker: Worker) -> TriesT:
        """A fresh record for the worker, in place of the one it had: it may be tried at once."""
        tries = self._tries[worker.id] = self._new(worker)
        return tries

    def failed(self, worker: Worker, attempts: int) -> float:
        """Record failure ``attempts + 1`` of ``worker`` and put its next try off; the delay, in seconds."""
        tries = self.entry(worker)
        tries.attempts = attempts + 1
        delay = backoff_s(tries.attempts)
        tries.next_try_at = self._clock() + delay
        return delay

    def forget(self, worker_id: str) -> None:
        self._tries.pop(worker_id, None)


class ScanLoop(abc.ABC):
    """One catch-up's loop (see the module docstring): a subclass says what a scan looks for and how one worker
    is repaired."""

    #: Names the loop in the log when a scan fails.
    scan_name: ClassVar[str]
    #: ``holder`` of the update lock while a repair holds it (in a 503 another operation gets).
    lock_holder: ClassVar[str]

    def __init__(
        self, ctx: AdminContext, workers: WorkerClient, *, headers: dict[str, str], leader: LeaderGate | None = None
    ):
        self._ctx = ctx
        self._workers = workers
        self._headers = headers
        self._leader = leader
        self._backoff = self.new_backoff()

    @classmethod
    def from_app(cls, app: web.Application) -> Self:
        """The loop over the app's fleet, with the service's headers on its calls to workers."""
        return cls(
            app[keys.ADMIN], app[keys.WORKERS], headers=app[keys.SERVICE_HEADERS], leader=app.get(keys.LEADER_GATE)
        )

    def new_backoff(self) -> Backoff[Tries]:
        """Each worker's failures, counted on the monotonic clock; a loop that keeps more about them, or shows
        when the next try starts, makes its own."""
        return Backoff(lambda _worker: Tries())

    @abc.abstractmethod
    async def scan(self) -> None:
        """Look through the registry once and repair at most one worker whose back-off is over."""

    @property
    def standby(self) -> bool:
        """Leader election is on and this replica does not lead (now): it changes no worker."""
        return self._leader is not None and not self._leader.is_open

    async def run(self) -> None:
        """Scan every :data:`SCAN_S` until cancelled; a failed scan is logged and the loop goes on."""
        await every(lambda: SCAN_S, self.scan, self.scan_name)

    async def take_lock(self) -> LockHold | None:
        """The update lock, or ``None`` when a fleet update keeps it past :data:`LOCK_WAIT_S`."""
        try:
            return await LockHold.take(self._ctx.gate, self.lock_holder, timeout_s=LOCK_WAIT_S)
        except Unavailable:
            return None
