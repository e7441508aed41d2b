"""At a pause broadcast, every process that routes drops its requests the next version makes stale.

The pause operations (SGLang's ``/pause_generation`` in every mode, vLLM's ``/pause``, AReaL's
``/areal_pause_generation``, and the same through the RL API) call :func:`drop_stale` once their
targets are fenced and before the pause is sent: the requests in flight on those targets whose
weight-version policy would not keep their start version once the next version is published are
aborted on their workers and answered 409 (:mod:`router.gateway.routing.stale` has the rule). The
pause then reaches workers that no longer run them, so an ``in_place`` or ``retract`` pause never
holds or recomputes them.

Every process that proxies generation holds its own requests: the control process (one process, or
the connections handed to it) drops its own; each data-plane process is asked over its link and
answers how many it dropped (:class:`DataPlanes`). Every wait is bounded: a data plane that has not
answered within the bound is logged and the pause goes on without it (its requests are then held or
aborted by the pause as before: the pause is never held up by a process that cannot drop).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

from router.contract import areal_endpoints as aep
from router.contract import endpoints as ep
from router.gateway.fleet.registry import Worker, WorkerRegistry
from router.gateway.routing.stale import StaleRequests

log = logging.getLogger(__name__)

#: The admin routes that pause generation (the routes whose broadcast drops stale requests first).
PAUSES = frozenset({ep.PAUSE_GENERATION.path, ep.PAUSE.path, aep.AREAL_PAUSE_GENERATION.path})
#: How long a drop waits for the workers' answers to its aborts, when no data plane sets the bound.
DEFAULT_WAIT_S = 5.0


class DataPlanes(Protocol):
    """The data-plane processes, as the drop reaches them (:class:`~router.gateway.data_planes.hub.DataPlaneHub`)."""

    async def drop_stale(self, next_sequence: int, workers: list[str], wait_s: float) -> int:
        """Ask every data plane to drop its stale requests on ``workers``; the sum of what those that answered
        within ``wait_s`` dropped."""
        ...


class StaleAtPause:
    """The drop of one router (see the module docstring)."""

    def __init__(
        self,
        registry: WorkerRegistry,
        local: StaleRequests,
        planes: DataPlanes | None = None,
        wait_s: float = DEFAULT_WAIT_S,
    ):
        self._registry = registry
        self._local = local
        self._planes = planes
        self.wait_s = wait_s
        """The bound on the whole drop; this process's own aborts, and each data plane's, wait 0.8 of it, so their
        answers come back within it."""

    async def drop(self, targets: Sequence[Worker]) -> int:
        """Drop the stale requests on ``targets`` in every process; how many were dropped."""
        next_sequence = self._registry.fleet.latest_sequence + 1
        ids = [w.id for w in targets]
        inner = 0.8 * self.wait_s
        local = self._local.drop(next_sequence, ids, inner)
        if self._planes is None:
            return await local
        counts = await asyncio.gather(local, self._planes.drop_stale(next_sequence, ids, self.wait_s))
        return sum(counts)


async def drop_stale(stale: StaleAtPause | None, path: str, targets: Sequence[Worker]) -> None:
    """Before a pause on ``path`` is sent to ``targets``: drop what it makes stale (nothing for other routes)."""
    if stale is None or path not in PAUSES:
        return
    dropped = await stale.drop(targets)
    if dropped:
        log.info("%s: %d stale request(s) dropped before the pause", path, dropped)
