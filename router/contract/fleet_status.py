"""``GET /fleet/status``: the fleet at a glance, with the router's verdict on each worker.

The router judges which workers are in rotation, and why the others are not, once
(``router.gateway.status.verdict``); ``omni-router status`` and the fleet page (``GET /dashboard``)
show this answer instead of judging the registry themselves.
"""

from __future__ import annotations

from typing import Literal

from router.contract.base import WireResponse
from router.contract.fleet import FleetVersions, JournalView, LeaderView, WorkerRecord

ExitCode = Literal[0, 1, 2]
"""The fleet summed up, as ``omni-router status`` exits with it."""
ALL_ROUTABLE: ExitCode = 0
SOME_OUT: ExitCode = 1
NONE_ROUTABLE: ExitCode = 2
"""Also none registered; ``omni-router status`` exits with it too when the router cannot be read."""


class WorkerStatus(WorkerRecord):
    """A registry record (as ``GET /workers`` has it) with the router's verdict beside its fields."""

    routable: bool
    """Takes generation traffic (under the default version policy, ``latest-only``)."""
    fenced: bool
    """Disabled as a target of the unresolved (or running) weight update in the journal."""
    out_of_rotation: str | None = None
    """Why it takes no generation traffic; ``None`` while it does."""


class LastUpdate(WireResponse):
    """The last operation that changed the fleet's weights through this router, and where it spent its time."""

    operation: str
    """The operation's name (``update_weights_from_disk``, ``complete_weights_update``, ...)."""
    operation_id: str
    """Its id in the router's log and on every call it sent (``X-Omni-Operation-Id``)."""
    outcome: str
    """``success``, ``refused`` (nothing changed), ``failure`` or ``error``."""
    ended_at: float
    """When it ended (Unix time, the router's clock)."""
    timings: dict[str, float]
    """Milliseconds per phase, as its answer's ``timings`` said them."""


class FleetStatus(WireResponse):
    """Every worker judged, with the journal and the fleet's versions they were judged with.

    Read at one moment: the verdicts, ``journal`` and ``versions`` agree with each other."""

    workers: list[WorkerStatus]
    """In the registry's order."""
    journal: JournalView
    """What ``GET /weight_update_journal`` answers: the unresolved update, if any, and where it is kept."""
    resolve_hint: str | None = None
    """How an operator clears the journal's entry, while there is one."""
    versions: FleetVersions
    """What ``GET /fleet/versions`` answers."""
    leader: LeaderView
    """This replica's role (``single`` without leader election), as ``GET /leader`` has it."""
    exit_code: ExitCode
    """0: every worker is routable; 1: some worker is out of rotation; 2: none is routable, or none is registered."""
    summary: str
    """The verdict on the whole fleet, in words."""
    read_at: float
    """When the router read it (Unix time, the router's clock): ages are shown against it."""
    last_update: LastUpdate | None = None
    """The last weight change through this router since it started (``None``: none yet)."""
