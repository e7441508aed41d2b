"""Which weights the fleet serves, the versions it served before, and which workers hold which.

After every successful weight change (an update from disk or over a group, a
version label, a memory resume) the router appends one *fleet entry* to a bounded
history (:data:`HISTORY_LIMIT`): the version label the workers that succeeded report,
a sequence number one above the previous entry's, when, and the checksum of the
weights when every one of them reported the same. Labels may repeat or be absent;
the sequence number never does, so staleness is counted in entries, never in labels.

Each holder is recorded by process instance (every omni-worker process has its own
``instance_id``) with the entry it received. A worker is *verified* on an entry
while it is the same process and reports the same label; a worker whose process
restarted since (it came back with its boot checkpoint), one added to the fleet
since (a late join), one whose label changed behind the router's back, or one whose
weights are ``partial`` or ``released`` holds weights the router never recorded: it
is *pending* under every version policy (:mod:`router.gateway.routing.version_policy`). It
still receives admin broadcasts, and the next broadcast that brings it to a recorded
version makes it eligible again.

An update of part of the fleet (``targets``) moves only its targets: the others keep
their entries (and become stale by one), the targets that failed lose theirs.

The record is ``fleet_weights.json`` in the router's state store (``--state-dir``,
written atomically off the event loop; :mod:`router.gateway.state`), so a router
restart does not forget which weights are current. A record written before the
history existed (one version and ``holders`` as worker → instance) reads as a
one-entry history. Before the first weight change there is no record, and every
worker's boot weights count as the fleet's.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, Field, ValidationError, model_validator

from router.contract import endpoints as ep
from router.contract.admin import UpdateWeightsFromDiskRequest
from router.contract.base import WireRequest
from router.contract.fleet import FleetVersionEntry
from router.contract.vllm_rl import CollectiveRpcRequest
from router.contract.weight_sync import reports_checksum
from router.gateway.state.durable import DurableRecord, as_record

log = logging.getLogger(__name__)

FLEET_FILE = "fleet_weights.json"

#: Fleet entries kept; a holder of an older entry stays verified (``any`` admits it), it is only unnamed.
HISTORY_LIMIT = 64

#: Weight states in which a worker holds no whole recorded version.
_NOT_WHOLE = frozenset({"partial", "released", "writing"})


#: One version the fleet moved to (the wire model ``GET /fleet/versions`` shows is the stored one).
FleetEntry = FleetVersionEntry


class Holder(BaseModel):
    """The entry one worker process received."""

    instance_id: str
    sequence: int
    weight_version: str | None = None


class FleetRecord(BaseModel):
    """The fleet's versions, oldest first (never empty), and who holds which."""

    history: list[FleetEntry] = Field(min_length=1)
    holders: dict[str, Holder] = Field(default_factory=dict)
    """Worker id → the process that received a recorded version, and which."""

    @model_validator(mode="before")
    @classmethod
    def _one_entry_history(cls, data: Any) -> Any:
        """A record written before the history existed: its one version is entry 1, its holders hold it."""
        if not isinstance(data, dict) or "history" in data:
            return data
        version = data.get("weight_version")
        holders = data.get("holders") or {}
        return {
            "history": [{"sequence": 1, "weight_version": version, "changed_at": data.get("changed_at", 0.0)}],
            "holders": {
                wid: {"instance_id": inst, "sequence": 1, "weight_version": version} if isinstance(inst, str) else inst
                for wid, inst in holders.items()
            },
        }

    @property
    def latest(self) -> FleetEntry:
        return self.history[-1]

    @property
    def weight_version(self) -> str | None:
        """The label of the fleet's current weights."""
        return self.history[-1].weight_version

    @property
    def changed_at(self) -> float:
        return self.history[-1].changed_at


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


#: The sequence a worker stands on when there is no record yet: its boot weights are the fleet's.
BOOT_SEQUENCE = 0


class FleetWeights:
    """The record, and the rule that decides which recorded version, if any, a worker holds."""

    def __init__(self, state: DurableRecord | Path | None):
        self._stored = as_record(state, FLEET_FILE)
        self.unreadable: str | None = None
        """Why the stored record could not be read at start (it exists but does not parse, or reading it
        failed): until an operator vouches for the fleet (:meth:`vouch`) or an update records the workers
        anew, no worker holds a recorded version."""
        self._record: FleetRecord | None = None
        self._by_label: dict[str | None, int] = {}
        self.latest_sequence = BOOT_SEQUENCE
        self.floors: dict[str, int | None] = {}
        """The version policies' lowest admitted sequence for the current record, by policy text
        (:mod:`router.gateway.routing.version_policy`); emptied whenever the record changes."""
        self.record = self._load()

    @property
    def record(self) -> FleetRecord | None:
        return self._record

    @record.setter
    def record(self, record: FleetRecord | None) -> None:
        """Every reader of the record goes through here (a data plane assigns the control's copy), so the
        indexes routing reads per request are rebuilt once per change, never per request."""
        self._record = record
        self.latest_sequence = BOOT_SEQUENCE if record is None else record.latest.sequence
        # Label → the latest entry with that label (a reused label means its latest use).
        self._by_label = {} if record is None else {e.weight_version: e.sequence for e in record.history}
        self.floors = {}

    def sequence_of(self, label: str) -> int | None:
        """The latest entry labelled ``label``, or ``None`` when the history has none."""
        return self._by_label.get(label)

    def reload(self) -> None:
        """Read the record again (blocking: a new leader takes over what the previous one wrote)."""
        self.record = self._load()

    def _load(self) -> FleetRecord | None:
        self.unreadable = None
        try:
            data = self._stored.load()
            return None if data is None else FleetRecord.model_validate_json(data)
        except (OSError, ValueError, ValidationError) as exc:
            self.unreadable = f"{type(exc).__name__}: {exc}"[:500]
            # Without the record no worker can be shown to hold a recorded version: trust none.
            log.error(
                "fleet weights record in %s is unreadable (%s); every worker is pending until an update",
                self._stored.location,
                exc,
            )
            return FleetRecord(history=[FleetEntry(sequence=1, changed_at=time.time())], holders={})

    def verified_sequence(self, worker_id: str, reported: ReportedWeights) -> int | None:
        """The fleet entry this worker provably holds (same process, same label as recorded), or ``None``.

        Routing asks this for candidates of every request, so ``reported`` is read in place
        (the registry passes the worker itself) rather than copied into a model."""
        if reported.weight_state in _NOT_WHOLE:
            return None
        record = self._record
        if record is None:
            return BOOT_SEQUENCE
        holder = record.holders.get(worker_id)
        if holder is None or reported.instance_id is None or holder.instance_id != reported.instance_id:
            return None
        if holder.weight_version is not None and reported.weight_version != holder.weight_version:
            return None
        return holder.sequence

    def why_unverified(self, worker_id: str, reported: ReportedWeights) -> tuple[str, str]:
        """Why a worker holds no recorded version: (``pending`` or ``unversioned``, the reason in words)."""
        if reported.weight_state in _NOT_WHOLE:
            return "pending", f"its weights are {reported.weight_state}"
        if reported.instance_id is None:
            return "unversioned", "it has not reported its weights yet"
        if self.unreadable is not None:
            return "pending", (
                f"the fleet-weights record in {self._stored.location} could not be read ({self.unreadable}): an "
                "operator who vouches for the fleet resolves it (POST /weight_update_journal/resolve), or an update "
                "through the router records the workers anew"
            )
        record = self._record
        holder = None if record is None else record.holders.get(worker_id)
        if holder is None or holder.instance_id != reported.instance_id:
            return (
                "pending",
                "it has not received the fleet's weights (it joined or restarted since the last weight update)",
            )
        return "pending", (
            f"it serves weight_version {reported.weight_version!r}, the router recorded {holder.weight_version!r} "
            "(its weights changed behind the router)"
        )

    def why_not_serving(self, worker_id: str, reported: ReportedWeights) -> str | None:
        """Why this worker cannot serve the fleet's current weights (``latest-only``), or ``None`` when it can."""
        sequence = self.verified_sequence(worker_id, reported)
        if sequence is None:
            return self.why_unverified(worker_id, reported)[1]
        if sequence < self.latest_sequence:
            return self.describe_stale(sequence)
        return None

    def describe_stale(self, sequence: int) -> str:
        record = self._record
        label = next((e.weight_version for e in record.history if e.sequence == sequence), None) if record else None
        latest = record.weight_version if record else None
        return (
            f"it holds fleet version {sequence} ({label!r}), {self.latest_sequence - sequence} behind "
            f"the fleet's {self.latest_sequence} ({latest!r})"
        )

    async def changed(
        self,
        holders: Iterable[tuple[str, WorkerWeights]],
        targets: Collection[str] | None = None,
        *,
        checksum: str | None = None,
        bystanders: Iterable[tuple[str, WorkerWeights]] = (),
        source_path: str | None = None,
        relabel_of: Collection[str] | None = None,
    ) -> None:
        """A weight change succeeded on ``holders``: they hold a new fleet entry.

        ``targets``: the ids of every worker the change was sent to. Holders of workers outside it
        keep their entries; targets that did not succeed lose theirs. ``None``: the change was
        meant for the whole fleet, and every other holder is dropped (pending until an update).
        ``bystanders``: the workers outside ``targets`` as they report now; read only for the first
        change, when there is no record yet: their boot weights were the fleet's, so they are
        recorded on a boot entry (:data:`BOOT_SEQUENCE`) one version behind, not left pending.
        ``source_path``: the checkpoint the new weights were loaded from (:func:`checkpoint_of`).
        ``relabel_of``: the change only set a new label (``/update_weight_version``), and these are the targets
        that held recorded weights before it: a new label vouches for no weights, so any other target stays
        pending. When it reached exactly the workers that hold the latest entry, and all of them, it names that
        entry anew instead of adding one: vLLM's update is a reload followed by a relabel, and a worker left out
        of both must be one version stale, not two."""
        previous = self._record
        reports = [(wid, w) for wid, w in holders if w.instance_id is not None]
        if relabel_of is not None:
            reports = [(wid, w) for wid, w in reports if wid in relabel_of]
        if not reports:
            return
        versions = Counter(w.weight_version for _, w in reports)
        version = versions.most_common(1)[0][0]
        if relabel_of is not None and previous is not None and _names_latest_anew(previous, reports, targets):
            await self._save(_relabelled(previous, reports, version))
            return
        if previous is None and targets is not None:
            previous = _boot_record(bystanders, set(targets))
        sequence = (previous.latest.sequence if previous is not None else BOOT_SEQUENCE) + 1
        entry = FleetEntry(
            sequence=sequence,
            weight_version=version,
            changed_at=time.time(),
            checksum=checksum,
            source_path=source_path,
        )
        kept: dict[str, Holder] = {}
        if targets is not None and previous is not None:
            moved = set(targets)
            kept = {wid: h for wid, h in previous.holders.items() if wid not in moved}
        for wid, w in reports:
            kept.pop(wid, None)
            if w.weight_version == version and w.instance_id:
                kept[wid] = Holder(instance_id=w.instance_id, sequence=sequence, weight_version=version)
        history = [*(previous.history if previous is not None else []), entry][-HISTORY_LIMIT:]
        await self._save(FleetRecord(history=history, holders=kept))

    async def _save(self, record: FleetRecord) -> None:
        self.record = record
        # The in-memory record decides routing whether or not the store takes it now.
        await self._stored.save(record.model_dump_json(indent=1).encode())

    async def vouch(self, reports: Iterable[tuple[str, WorkerWeights]]) -> bool:
        """An operator vouches for the fleet while the stored record is unreadable: the workers as they report
        now become a new record (those on the most common label hold it; the rest stay pending). False when
        there was nothing to replace."""
        if self.unreadable is None:
            return False
        self.record = None
        self.unreadable = None
        await self.changed(reports)
        return True

    async def discarded(self, worker_ids: Collection[str]) -> None:
        """These workers' weights were freed without a copy: they hold no recorded version any more (after the
        wake they are pending until an update or a catch-up loads the fleet's weights). No new entry is made."""
        record = self._record
        if record is None or not any(wid in record.holders for wid in worker_ids):
            return
        holders = {wid: h for wid, h in record.holders.items() if wid not in worker_ids}
        await self._save(FleetRecord(history=record.history, holders=holders))

    async def caught_up(self, worker_id: str, weights: WorkerWeights, sequence: int) -> bool:
        """A worker loaded the weights of entry ``sequence`` from a verified holder: record it as a holder.

        Refused (``False``, nothing recorded) when the fleet moved past ``sequence`` meanwhile, or when
        the worker's report does not show the entry's weights whole (label, state, a known process).
        No new entry is made: the fleet's weights did not change, one more worker holds them."""
        record = self._record
        if record is None or record.latest.sequence != sequence or weights.instance_id is None:
            return False
        label = record.latest.weight_version
        if weights.weight_state in _NOT_WHOLE or (label is not None and weights.weight_version != label):
            return False
        holders = {
            **record.holders,
            worker_id: Holder(instance_id=weights.instance_id, sequence=sequence, weight_version=label),
        }
        updated = FleetRecord(history=record.history, holders=holders)
        self.record = updated
        await self._stored.save(updated.model_dump_json(indent=1).encode())
        return True


def _names_latest_anew(
    record: FleetRecord, reports: list[tuple[str, WorkerWeights]], targets: Collection[str] | None
) -> bool:
    """A relabel that reached every holder of the latest entry, and only them, each still the same process."""
    latest = record.latest.sequence
    holding = {wid: h for wid, h in record.holders.items() if h.sequence == latest}
    reported = dict(reports)
    if set(reported) != set(holding) or (targets is not None and set(targets) != set(reported)):
        return False
    labels = {w.weight_version for w in reported.values()}
    return len(labels) == 1 and all(holding[wid].instance_id == w.instance_id for wid, w in reported.items())


def _relabelled(record: FleetRecord, reports: list[tuple[str, WorkerWeights]], version: str | None) -> FleetRecord:
    latest = record.latest.model_copy(update={"weight_version": version, "changed_at": time.time()})
    holders = dict(record.holders)
    for wid, w in reports:
        assert w.instance_id is not None
        holders[wid] = Holder(instance_id=w.instance_id, sequence=latest.sequence, weight_version=version)
    return FleetRecord(history=[*record.history[:-1], latest], holders=holders)


def _boot_record(bystanders: Iterable[tuple[str, WorkerWeights]], targets: set[str]) -> FleetRecord | None:
    """Before the first change every worker's boot weights count as the fleet's: the untargeted ones,
    each on its own reported label, as the boot entry's holders (``None`` when there are none)."""
    boot = {
        wid: Holder(instance_id=w.instance_id, sequence=BOOT_SEQUENCE, weight_version=w.weight_version)
        for wid, w in bystanders
        if wid not in targets and w.instance_id is not None and w.weight_state not in _NOT_WHOLE
    }
    if not boot:
        return None
    label = Counter(h.weight_version for h in boot.values()).most_common(1)[0][0]
    entry = FleetEntry(sequence=BOOT_SEQUENCE, weight_version=label, changed_at=time.time())
    return FleetRecord(history=[entry], holders=boot)


#: Weight changes that keep the weights the fleet had (a new label, memory restored): the new entry can be read
#: again from wherever the previous one could.
_SAME_WEIGHTS = frozenset(e.path for e in (ep.UPDATE_WEIGHT_VERSION, ep.RESUME_MEMORY_OCCUPATION, ep.WAKE_UP))


def checkpoint_of(path: str, request: WireRequest, record: FleetRecord | None) -> str | None:
    """The checkpoint a weight change sent by ``request`` to route ``path`` loaded the weights from: an
    update from disk's ``model_path``, vLLM's ``reload_weights`` path, the previous entry's for a change that
    keeps the weights; ``None`` for weights that came over a group or in tensors (no file holds them)."""
    if isinstance(request, UpdateWeightsFromDiskRequest):
        return request.model_path
    if isinstance(request, CollectiveRpcRequest):
        return request.checkpoint_path
    if path in _SAME_WEIGHTS and record is not None:
        return record.latest.source_path
    return None


def agreed_checksum(bodies: Iterable[object]) -> str | None:
    """The ``checksum`` every answer reported (SGLang's complete answer with ``return_checksum``), else ``None``."""
    sums = {body.checksum if reports_checksum(body) else None for body in bodies}
    if len(sums) != 1:
        return None
    only = sums.pop()
    return only if isinstance(only, str) else None
