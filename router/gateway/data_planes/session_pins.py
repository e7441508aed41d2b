"""One session table for the whole router, read by every data plane (``--session-affinity``).

The control process's :class:`~router.gateway.routing.affinity.SessionAffinity` is the only table
that places sessions. A data plane keeps a copy of the pins it was told (:class:`SessionPins`):

::

    a turn whose pin is copied here, on a worker it may go to   served here (a hit, no message)
    anything else (new, expired here, its worker not eligible)  Place → the control process's table
                                                                decides → Placed; copied here
    the control process moved or evicted a pin                   Unpinned to every data plane: the
                                                                copies are dropped, the next turn asks

Why a copy is safe:

- **It never outlives the table's pin.** A copy lives ``ttl_s`` less :data:`PLACE_TIMEOUT_S` from
  this process's last use of it (an answer older than that is not waited for); every use is reported (:class:`~.messages.PinsUsed`, with the load, every
  :data:`~.hub.LOAD_EVERY_S`) and refreshes the table's pin from the moment it arrives, so the
  table's pin expires no sooner than any copy of it.
- **A move reaches every copy.** The table tells every data plane about each pin it moves or evicts,
  right after deciding it; a copy is only ever used for a worker that is still eligible here.
- **It is bounded** like the table: at most ``max_sessions`` copies, least recently used dropped first.

If the control process does not answer within :data:`PLACE_TIMEOUT_S`, the data plane's own table
places the session (the same ranking) and counts it (``omni_router_affinity_local_placements``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from router.gateway.data_planes.messages import Place
from router.gateway.fleet.registry import Worker
from router.gateway.metrics import AffinityStats
from router.gateway.routing.affinity import session_row

#: How long a session's placement waits for the control process's table.
PLACE_TIMEOUT_S = 0.5


class SessionPins:
    """A data plane's copies of the control process's pins (see the module docstring)."""

    def __init__(
        self,
        *,
        ttl_s: float,
        max_sessions: int,
        post: Callable[[str], None],
        stats: AffinityStats,
        clock: Callable[[], float] = time.monotonic,
    ):
        # The table's pin was refreshed when it answered, at most PLACE_TIMEOUT_S before the copy is made.
        self._ttl_s = max(0.0, ttl_s - PLACE_TIMEOUT_S)
        self._max = max_sessions
        self._post = post
        self._stats = stats
        self._clock = clock
        self._pins: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self._used: set[int] = set()
        self._waiting: dict[int, asyncio.Future[str | None]] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._pins)

    async def choose(self, key: str, candidates: Sequence[Worker], retry: bool) -> Worker | None:
        """The worker for ``key`` among ``candidates`` as the router's one table has it; ``None`` when the
        control process did not answer in time (the caller's own table decides)."""
        row = session_row(key)
        copied = self._pins.get(row)
        if copied is not None and not retry:
            worker_id, expires = copied
            now = self._clock()
            if expires > now:
                for worker in candidates:
                    if worker.id == worker_id:
                        self._pins[row] = (worker_id, now + self._ttl_s)
                        self._pins.move_to_end(row)
                        self._used.add(row)
                        self._stats.hits += 1
                        return worker
        placed = await self._ask(key, [w.id for w in candidates], retry)
        for worker in candidates:
            if worker.id == placed:
                self._copy(row, worker.id)
                return worker
        return None

    async def _ask(self, key: str, candidates: list[str], retry: bool) -> str | None:
        ask_id = next(self._ids)
        answer: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._waiting[ask_id] = answer
        self._post(Place(id=ask_id, session=key, candidates=candidates, retry=retry).model_dump_json())
        try:
            return await asyncio.wait_for(answer, PLACE_TIMEOUT_S)
        except TimeoutError:
            return None
        finally:
            self._waiting.pop(ask_id, None)

    def answered(self, ask_id: int, worker_id: str | None) -> None:
        """The control process's answer to one of this process's questions."""
        waiting = self._waiting.pop(ask_id, None)
        if waiting is not None and not waiting.done():
            waiting.set_result(worker_id)

    def forget(self, rows: Iterable[int]) -> None:
        """The control process moved or evicted these pins: the next turn of each asks it again."""
        for row in rows:
            self._pins.pop(row, None)

    def take_used(self) -> list[int]:
        """The rows served from a copy since the last call (the control process refreshes their pins)."""
        used, self._used = self._used, set()
        return list(used)

    def _copy(self, row: int, worker_id: str) -> None:
        self._pins[row] = (worker_id, self._clock() + self._ttl_s)
        self._pins.move_to_end(row)
        while len(self._pins) > self._max:
            self._pins.popitem(last=False)
