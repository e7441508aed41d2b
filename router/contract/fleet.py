"""Router-only wire messages: worker records and registry requests, the fleet's weight versions,
weight-update groups, the journal, and the leader and storage views.

The answers of admin calls broadcast to the fleet are in :mod:`router.contract.fleet_answers`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from router.contract.admin import ModelInfo, WeightVersionResult
from router.contract.base import WireRequest, WireResponse

HealthState = Literal["healthy", "unhealthy", "dead"]
#: The inference server behind a worker URL: this project's omni-worker, vLLM, or SGLang
#: (docs/engines.md says what the router reads and relays for each).
EngineName = Literal["omni", "vllm", "sglang"]
ENGINE_NAMES: tuple[EngineName, ...] = ("omni", "vllm", "sglang")


WorkerSource = Literal["static", "api", "discovery"]
CatchUpState = Literal["copying", "failed", "retired"]


class CatchUpStatus(WireResponse):
    """Where the router's catch-up of a pending worker from a peer stands (``--sync-joiners peer``)."""

    state: CatchUpState
    """``copying``: a load from ``source`` is in flight; ``failed``: the last one failed, retried at
    ``next_try_at``; ``retired``: ``--max-rejoin-attempts`` loads of this process failed, and the router no
    longer tries (the worker stays pending until it restarts or an update brings it the fleet's weights)."""
    source: str | None = None
    """The id of the worker the weights are (or were last) copied from."""
    attempts: int = 0
    """Failed attempts since the worker became pending (reset when its process changes)."""
    last_error: str | None = None
    next_try_at: float | None = None
    """When the next attempt may start (Unix time); ``None`` once retired."""
    detail: str | None = None
    """The state in words where it needs them: why a retired worker is no longer tried."""


class WorkerRecord(WireResponse):
    """One worker as the registry sees it."""

    id: str
    url: str
    health: HealthState
    disabled: bool
    inflight: int
    engine: EngineName | None = None
    """The server behind the URL (``None`` until the router has told: it is then not routable)."""
    engine_detail: str | None = None
    """What the router found about the engine: why it could not tell it, or what the server lacks."""
    weight_version: str | None = None
    tp_size: int | None = None
    weight_state: str | None = None
    instance_id: str | None = None
    pending: str | None = None
    """Why the worker takes no generation traffic although healthy: it does not hold the fleet's weights."""
    fleet_sequence: int | None = None
    """The fleet version (sequence number) the router recorded this worker on; ``None``: weights it never
    recorded (restarted, joined since, changed behind the router); 0 before the first weight change."""
    staleness: int | None = None
    """How many fleet versions behind the current one it is (0: current)."""
    paused: bool = False
    """Its generation is paused by the router's last pause broadcast (requests to it wait until it continues)."""
    reported_paused: bool | None = None
    """Whether the worker itself says its generation is paused (``None``: it does not say). Paused while the
    router has not paused it, it takes no traffic until the router has continued it."""
    asleep: bool = False
    """Its memory is released by the router's last sleep or release broadcast."""
    source: WorkerSource = "static"
    """How it was registered: ``--worker-urls`` (static), ``POST /workers`` (api) or service discovery."""
    pod: str | None = None
    """The pod it runs in (``namespace/name``), for discovered workers."""
    departed: str | None = None
    """Why discovery no longer lists it (removed from the registry once no update holds the lock)."""
    catch_up: CatchUpStatus | None = None
    """The router's catch-up from a peer, while the worker is pending for want of the fleet's weights."""


class WorkerList(WireResponse):
    workers: list[WorkerRecord]


class FleetVersionEntry(WireResponse):
    """One weight version the fleet moved to, as the router recorded it after a successful weight change."""

    sequence: int
    """One above the previous entry's: staleness counts these, never labels (which may repeat or be absent)."""
    weight_version: str | None = None
    changed_at: float = 0.0
    checksum: str | None = None
    """The checksum of the weights as applied, when every worker that took them reported the same one."""
    source_path: str | None = None
    """The checkpoint these weights were loaded from (an update from disk, vLLM's ``reload_weights``), kept
    across a relabel: a worker that joins later can load the same weights from it (catch-up from a path)."""


class WorkerVersionStanding(WireResponse):
    """Which recorded version one worker holds, as the router verified it (same process, same label)."""

    weight_version: str | None = None
    fleet_sequence: int | None = None
    """``None``: weights the router never recorded (the worker is eligible under no version policy)."""
    staleness: int | None = None
    paused: bool = False
    asleep: bool = False


class FleetVersions(WireResponse):
    """``GET /fleet/versions``: the fleet's recorded versions (oldest first, bounded) and who holds which."""

    sequence: int
    """The current entry's sequence (0 before the first weight change: every worker's boot weights count)."""
    weight_version: str | None = None
    version_policy: str
    """The router's default policy (``--version-policy``); a request may ask for another (``X-Version-Policy``)."""
    history: list[FleetVersionEntry] = Field(default_factory=list)
    workers: dict[str, WorkerVersionStanding] = Field(default_factory=dict)


class RemovedWorker(WireResponse):
    """``DELETE /workers/{id}``."""

    removed: WorkerRecord


class AddWorkerRequest(WireRequest):
    """``POST /workers`` (and the legacy ``POST /add_worker?url=``)."""

    url: str = Field(min_length=1, max_length=2048)
    disabled: bool = False
    engine: EngineName | Literal["auto"] | None = None
    """The server behind the URL; ``None``: the router's ``--worker-engine`` (``auto``: detected)."""


class UpdateWorkerRequest(WireRequest):
    """``PUT /workers/{id}``: today only the operator's ``disabled`` flag can change."""

    disabled: bool


class WorkerUrlQuery(WireRequest):
    """The legacy routes take the worker as ``?url=``."""

    url: str = Field(min_length=1, max_length=2048)


class RankAssignment(WireResponse):
    """The ranks one worker holds in a weight-update group: ``rank_offset .. rank_offset + tp_size - 1``."""

    worker: str
    url: str
    rank_offset: int
    tp_size: int


class GroupMembership(WireResponse):
    """A weight-update group the router built, and whether the fleet still matches it."""

    group_name: str
    world_size: int
    """The group's world size, the trainer's ranks included (what its init asked for)."""
    members: list[RankAssignment]
    matches_fleet: bool
    """False once a worker joined, left, died or restarted since: updates on it are refused (409)."""
    changes: list[str] = Field(default_factory=list)


class WorldSizeResponse(WireResponse):
    """``GET /get_world_size``: ranks held by workers, the trainer's rank 0 excluded."""

    world_size: int
    workers: list[RankAssignment] = Field(default_factory=list)
    groups: list[GroupMembership] = Field(default_factory=list)
    """The groups the router built; a trainer rebuilds one whose ``matches_fleet`` is false."""

    def group(self, name: str) -> GroupMembership | None:
        return next((g for g in self.groups if g.group_name == name), None)


class WorkerVersion(WireResponse):
    id: str
    url: str
    weight_version: str | None = None


class FleetModelInfo(ModelInfo):
    """``/model_info`` through the router: the first worker's info with the fleet's common version."""

    worker_count: int
    workers: list[WorkerVersion]


class FleetWeightVersion(WeightVersionResult):
    """``/get_weight_version`` through the router: the version every worker holds."""

    worker_count: int


class JournalResolveRequest(WireRequest):
    """``POST /weight_update_journal/resolve``: the operator vouches the fleet is consistent."""

    acknowledge: bool


class JournalTarget(WireResponse):
    id: str
    url: str
    previous_disabled: bool


class JournalState(WireResponse):
    """The durable record of an update whose outcome is not known-good."""

    state: Literal["in_flight", "failed"]
    path: str
    started_at: float
    targets: list[JournalTarget]
    failed: list[str] = Field(default_factory=list)
    reason: str = ""


#: On every refusal by a router replica that is not the leader (``--leader-election``), with the value
#: :data:`STANDBY_ROLE`: nothing ran there, so a client may send the same call again (to the leader).
ROUTER_ROLE_HEADER = "X-Omni-Router-Role"
STANDBY_ROLE = "standby"

LeaderRole = Literal["single", "standby", "taking_over", "leader", "stepped_down"]


class LeaderView(WireResponse):
    """Which router replica serves the admin routes (``GET /leader``, and ``leader`` in ``/health``).

    ``single``: no leader election, this replica serves; ``standby``: another replica holds the lease;
    ``taking_over``: this one holds it and is re-reading the durable state; ``leader``: it serves;
    ``stepped_down``: it lost the lease and is exiting."""

    role: LeaderRole
    holder: str | None = None
    """The lease holder as this replica last saw it (``None``: none seen, or no leader election)."""
    identity: str | None = None
    """This replica's identity in the election (its pod name)."""


class StorageView(WireResponse):
    """Whether the store of the router's durable records holds what memory holds.

    ``healthy: false`` means some records were not written (a read-only or full volume):
    the router keeps deciding from memory, which fails closed, and writes them again
    until the store takes them; a restart meanwhile would read older records."""

    healthy: bool
    location: str
    unsaved: list[str] = Field(default_factory=list)
    error: str = ""


class JournalView(WireResponse):
    pending: JournalState | None = None
    storage: StorageView | None = None
    """``None`` without a state store (memory only)."""


class JournalResolved(WireResponse):
    """The answer of ``POST /weight_update_journal/resolve``: the workers given back their previous flag."""

    success: bool
    resolved: bool
    workers: list[WorkerRecord] = Field(default_factory=list)
    fleet_record_rebuilt: bool = False
    """The fleet-weights record was unreadable and the workers, as they report now, were recorded anew."""
