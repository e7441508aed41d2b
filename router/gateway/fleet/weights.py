"""Which weights the fleet serves, and which workers hold them.

After every successful weight change (an update from disk or over a group, a
version label, a memory resume) the router records the version the workers
that succeeded report, and each of them by process instance (every omni-worker
process has its own ``instance_id``). A worker may take generation traffic only
while it holds those weights: a worker on another version, one whose process
restarted since (it came back with its boot checkpoint), one added to the fleet
since (a late join), or one whose weights are ``partial`` or ``released`` is
*pending*: it still receives admin broadcasts, and the next broadcast that
brings it to the fleet's weights makes it routable again.

The record is ``fleet_weights.json`` in the router's state store (``--state-dir``,
written atomically off the event loop; :mod:`router.gateway.state`), so a router
restart does not forget which weights are current.
Before the first weight change there is no record, and every worker's boot
weights count as the fleet's.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, Field, ValidationError

from router.gateway.state.durable import DurableRecord, as_record

log = logging.getLogger(__name__)

FLEET_FILE = "fleet_weights.json"


class FleetRecord(BaseModel):
    """The fleet's current weights: their version label and who holds them."""

    weight_version: str | None = None
    changed_at: float = 0.0
    holders: dict[str, str] = Field(default_factory=dict)
    """Worker id → the ``instance_id`` of the process that received the current weights."""


class WorkerWeights(BaseModel):
    """What one worker last reported about its weights."""

    weight_version: str | None = None
    weight_state: str | None = None
    instance_id: str | None = None


class ReportedWeights(Protocol):
    """What a worker last said of its weights: a :class:`WorkerWeights`, or the registry's worker itself."""

    @property
    def weight_version(self) -> str | None: ...
    @property
    def weight_state(self) -> str | None: ...
    @property
    def instance_id(self) -> str | None: ...


class FleetWeights:
    """The record, and the rule that decides whether a worker holds the fleet's weights."""

    def __init__(self, state: DurableRecord | Path | None):
        self._stored = as_record(state, FLEET_FILE)
        self.record: FleetRecord | None = self._load()

    def reload(self) -> None:
        """Read the record again (blocking: a new leader takes over what the previous one wrote)."""
        self.record = self._load()

    def _load(self) -> FleetRecord | None:
        try:
            data = self._stored.load()
            return None if data is None else FleetRecord.model_validate_json(data)
        except (OSError, ValueError, ValidationError) as exc:
            # Without the record no worker can be shown to hold the current weights: trust none.
            log.error(
                "fleet weights record in %s is unreadable (%s); every worker is pending until an update",
                self._stored.location,
                exc,
            )
            return FleetRecord(weight_version=None, changed_at=time.time(), holders={})

    def why_not_serving(self, worker_id: str, reported: ReportedWeights) -> str | None:
        """Why this worker cannot serve the fleet's weights, or ``None`` when it can.

        Routing asks this for every candidate of every request, so ``reported`` is read in place
        (the registry passes the worker itself) rather than copied into a model."""
        if reported.weight_state in ("partial", "released", "writing"):
            return f"its weights are {reported.weight_state}"
        record = self.record
        if record is None:
            return None
        if reported.instance_id is None:
            return "it has not reported its weights yet"
        if record.holders.get(worker_id) != reported.instance_id:
            return "it has not received the fleet's weights (it joined or restarted since the last weight update)"
        if record.weight_version is not None and reported.weight_version != record.weight_version:
            return f"it serves weight_version {reported.weight_version!r}, the fleet {record.weight_version!r}"
        return None

    async def changed(self, holders: Iterable[tuple[str, WorkerWeights]]) -> None:
        """A weight change succeeded on ``holders``: they now define the fleet's weights."""
        reports = [(wid, w) for wid, w in holders if w.instance_id is not None]
        if not reports:
            return
        versions = Counter(w.weight_version for _, w in reports)
        version = versions.most_common(1)[0][0]
        record = FleetRecord(
            weight_version=version,
            changed_at=time.time(),
            holders={wid: w.instance_id for wid, w in reports if w.weight_version == version and w.instance_id},
        )
        self.record = record
        # The in-memory record decides routing whether or not the store takes it now.
        await self._stored.save(record.model_dump_json(indent=1).encode())
