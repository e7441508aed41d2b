"""Where one admin operation spent its time, phase by phase, for its answer, its log line and the metrics.

The phases of :class:`~router.gateway.admin.locked.AdminRun`, in the order they run:

- ``lock_wait``: waiting for the admin update lock (0 for an operation that takes none);
- ``fence_barrier``: until every process that routes requests applied the fence on the targets;
- ``journal_write``: until the fence's journal entry was durable (it runs beside the barrier, so the
  two overlap: the fence holds once both have returned);
- ``fan_out``: the call sent to every target and every answer read;
- ``slowest_worker``: the slowest target's own time within the fan-out (the rest of ``fan_out`` is
  the router's);
- ``settle``: the fence settled from the answers (lowered, or kept on the targets that failed);
- ``verification``: the targets' weights read back after a weight change and the fleet's record written.

A phase an operation does not run is left out. ``total`` is the whole operation, from the lock's
request to the answer, so what the router added is ``total - slowest_worker``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

#: The phases, in the order they run (the answer lists them so).
PHASES = (
    "lock_wait",
    "fence_barrier",
    "journal_write",
    "fan_out",
    "slowest_worker",
    "settle",
    "verification",
    "total",
)


class PhaseTimes:
    """Seconds per phase of one operation (see the module docstring)."""

    __slots__ = ("_seconds", "_started")

    def __init__(self) -> None:
        self._started = time.perf_counter()
        self._seconds: dict[str, float] = {}

    def add(self, phase: str, seconds: float) -> None:
        """Count ``seconds`` to ``phase`` (a phase run twice, such as two fan-outs, adds up)."""
        self._seconds[phase] = self._seconds.get(phase, 0.0) + seconds

    @contextlib.contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - started)

    def finish(self) -> None:
        """The operation ended: its total, from its start."""
        self._seconds["total"] = time.perf_counter() - self._started

    def seconds(self) -> dict[str, float]:
        """Each phase run, in the order of :data:`PHASES`."""
        return {p: self._seconds[p] for p in PHASES if p in self._seconds}

    def milliseconds(self) -> dict[str, float]:
        """:meth:`seconds` in milliseconds, rounded to the microsecond (the answer's ``timings``)."""
        return {p: round(s * 1000.0, 3) for p, s in self.seconds().items()}

    def server_timing(self) -> str:
        """The ``Server-Timing`` header's value (W3C Server Timing: ``name;dur=<ms>``)."""
        return ", ".join(f"{p};dur={ms:g}" for p, ms in self.milliseconds().items())

    def log_fields(self) -> str:
        return " ".join(f"{p}={ms:.1f}ms" for p, ms in self.milliseconds().items())
