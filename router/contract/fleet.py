"""Router-only wire messages: worker records, registry requests, and the answers of
admin calls broadcast to the fleet.

A broadcast's answer (:class:`FleetAnswer`) is the answer a single worker gives,
with each field holding the value every worker agrees on (where they disagree,
the field's default), plus the router's envelope: ``path``, ``worker_count`` and
``results``, one :class:`WorkerResult` per worker holding that worker's own
parsed answer. A client written for one worker's answer therefore reads the same
names with the same types through the router; per-worker detail sits beside them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, Literal, TypeVar

from pydantic import Field

from router.contract.admin import ModelInfo, ServerInfo, WeightsCheckerResult, WeightVersionResult
from router.contract.base import Explained, WireRequest, WireResponse
from router.contract.vllm import IsPausedResponse, PauseStatus, VllmResult
from router.contract.vllm_dev import AbortRequestsResult, IsSleepingResponse
from router.contract.vllm_rl import VllmWeightCheckerResult
from router.contract.vllm_server import ResetPrefixCacheResult, VllmConfigView
from router.contract.weight_sync import (
    AbortWeightsUpdateResponse,
    CompleteWeightsUpdateResponse,
    PrepareWeightsUpdateResponse,
    WeightSyncResponse,
)

HealthState = Literal["healthy", "unhealthy", "dead"]
#: The inference server behind a worker URL: this project's omni-worker, vLLM, or SGLang
#: (docs/engines.md says what the router reads and relays for each).
EngineName = Literal["omni", "vllm", "sglang"]
ENGINE_NAMES: tuple[EngineName, ...] = ("omni", "vllm", "sglang")
R = TypeVar("R", bound=WireResponse)
#: A worker's answer in a :class:`WorkerResult`, covariant: a result of any route is a ``WorkerResult[WireResponse]``.
A_co = TypeVar("A_co", bound=WireResponse, covariant=True)

#: Fields of a worker's answer that describe that worker alone; never lifted into the fleet's answer.
PER_WORKER_FIELDS = frozenset({"success", "message", "status", "rank_results", "error"})


WorkerSource = Literal["static", "api", "discovery"]
CatchUpState = Literal["copying", "failed"]


class CatchUpStatus(WireResponse):
    """Where the router's catch-up of a pending worker from a peer stands (``--sync-joiners peer``)."""

    state: CatchUpState
    """``copying``: a load from ``source`` is in flight; ``failed``: the last one failed, retried at ``next_try_at``."""
    source: str | None = None
    """The id of the worker the weights are (or were last) copied from."""
    attempts: int = 0
    """Failed attempts since the worker became pending (reset when its process changes)."""
    last_error: str | None = None
    next_try_at: float | None = None
    """When the next attempt may start (Unix time)."""


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


class WorkerResult(WireResponse, Generic[A_co]):
    """What one worker answered to one broadcast admin call.

    ``body`` is the worker's answer parsed into the route's response model;
    ``error`` says why there is no usable answer (connection refused, timeout,
    an error body, a body that is not the route's response model).
    """

    worker: str
    url: str
    success: bool
    status_code: int | None = None
    body: A_co | None = None
    error: str | None = None
    elapsed_ms: float

    def reason(self) -> str:
        """One line saying why this worker failed (or ``ok``)."""
        if self.error is not None:
            return self.error
        body = self.body
        if body is None:
            return "no answer"
        if isinstance(body, Explained) and body.message:
            return str(body.message)
        return body.model_dump_json()[:300]


class FleetAnswer(WireResponse, Generic[R]):
    """The router's answer to a broadcast admin call: 200 when every target succeeded, else 502."""

    success: bool
    message: str
    path: str
    worker_count: int
    results: list[WorkerResult[R]]

    @property
    def ok(self) -> bool:
        return self.success

    def failed_workers(self) -> list[str]:
        return [r.worker for r in self.results if not r.success]


def agreed_fields(model: type[R], answers: Sequence[R | None]) -> dict[str, Any]:
    """The fields of ``model`` that every answer sets to the same value (per-worker fields left out).

    A field on which the answers disagree, or that some worker did not report, is
    absent: the fleet answer then shows the field's default, and each worker's own
    value stays in its :class:`WorkerResult`.
    """
    bodies = [a for a in answers if a is not None]
    if not bodies or len(bodies) != len(answers):
        return {}
    # Each answer is a ``model``: its fields by name, as pydantic iterates them (no copy of their values).
    fields = [dict(b) for b in bodies]
    agreed: dict[str, Any] = {}
    for name in model.model_fields:
        if name in PER_WORKER_FIELDS:
            continue
        values = [f[name] for f in fields]
        if all(v == values[0] for v in values[1:]) and name in bodies[0].model_fields_set:
            agreed[name] = values[0]
    return agreed


class PrepareFleetAnswer(FleetAnswer[PrepareWeightsUpdateResponse], PrepareWeightsUpdateResponse):
    """``/prepare_weights_update`` through the router: ``ready`` only when every target is.

    On ``error``, ``aborts`` holds the answers of the ready workers told to drop their receive.
    """

    aborts: list[WorkerResult[AbortWeightsUpdateResponse]] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ready"


class CompleteFleetAnswer(FleetAnswer[CompleteWeightsUpdateResponse], CompleteWeightsUpdateResponse):
    """``/complete_weights_update`` through the router. ``num_buckets_received`` and
    ``checksum`` are the fleet's when every worker agrees; ``checksums`` maps each
    worker to the checksum of the weights it applied."""

    checksums: dict[str, str | None] = Field(default_factory=dict)
    checksums_match: bool | None = None
    """``None`` when some worker reported no checksum."""


class RankAssignment(WireResponse):
    """The ranks one worker holds in a weight-update group: ``rank_offset .. rank_offset + tp_size - 1``."""

    worker: str
    url: str
    rank_offset: int
    tp_size: int


class GroupInitFleetAnswer(FleetAnswer[WeightSyncResponse], WeightSyncResponse):
    """``/init_weights_update_group`` through the router, with the ranks each worker was given."""

    ranks: list[RankAssignment] = Field(default_factory=list)


class WeightTransferInitFleetAnswer(FleetAnswer[VllmResult], VllmResult):
    """``/init_weight_transfer_engine`` through the router, with the ranks each worker was given."""

    ranks: list[RankAssignment] = Field(default_factory=list)


class WeightTransferFleetAnswer(FleetAnswer[VllmResult], VllmResult):
    """``/start_weight_update``, ``/update_weights`` and ``/finish_weight_update`` through the router:
    vLLM's ``message`` beside the envelope."""

    update_open: bool = False
    """The router still holds the update (its lock and fence) for more ``/update_weights`` and the finish."""
    fenced: list[str] = Field(default_factory=list)
    """Workers whose part of the update failed: they stay out of routing, also after the finish."""
    weight_version: str | None = None
    """After a finish: the version the fleet now serves."""


class PauseFleetAnswer(FleetAnswer[PauseStatus], PauseStatus):
    """vLLM's ``/pause`` and ``/resume`` through the router: ``status`` is ``paused`` (``resumed``) once
    every worker is."""


class ServerInfoFleetAnswer(FleetAnswer[ServerInfo]):
    """``GET /server_info`` through the router: each worker's answer in ``results``; asked vLLM's way
    (``config_format``), also ``vllm_config`` for the fleet as one vLLM server whose data-parallel
    replicas are the workers that answered."""

    vllm_config: VllmConfigView | str | None = None
    vllm_env: dict[str, Any] | None = None
    system_env: dict[str, Any] | None = None


class ResetPrefixCacheFleetAnswer(FleetAnswer[ResetPrefixCacheResult]):
    """vLLM's ``/reset_prefix_cache`` through the router: answered (200) once every worker answered,
    ``success`` only when every worker reset its cache, as vLLM's data-parallel engine reports it."""


class IsPausedFleetAnswer(FleetAnswer[IsPausedResponse]):
    """``GET /is_paused`` through the router: ``is_paused`` only when every live worker is paused
    (each worker's own answer is in ``results``)."""

    is_paused: bool = False


class IsSleepingFleetAnswer(FleetAnswer[IsSleepingResponse]):
    """``GET /is_sleeping`` through the router: ``is_sleeping`` only when every live worker sleeps (as
    SkyRL reads its servers: all of them)."""

    is_sleeping: bool = False


class AbortRequestsFleetAnswer(FleetAnswer[AbortRequestsResult], AbortRequestsResult):
    """vLLM's ``/abort_requests`` through the router: ``aborted`` sums what every worker ended."""


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


class WeightsCheckerFleetAnswer(FleetAnswer[WeightsCheckerResult], WeightsCheckerResult):
    """``/weights_checker`` through the router. The worker's fields (``checksums`` per
    tensor, ``per_engine_checksum``, ...) hold the fleet's values where every worker
    agrees. With ``checksum``: ``worker_checksums`` maps each worker to its
    engine-level checksum, ``rank_checksums`` to its per-rank checksums, and
    ``identical`` says whether every worker holds the same weights."""

    identical: bool | None = None
    """Every worker holds the same, whole weights (a worker with partial weights makes it false)."""
    partial_workers: list[str] = Field(default_factory=list)
    worker_checksums: dict[str, str | None] = Field(default_factory=dict)
    rank_checksums: dict[str, list[str]] = Field(default_factory=dict)


class VllmWeightCheckerFleetAnswer(FleetAnswer[VllmWeightCheckerResult], VllmWeightCheckerResult):
    """vLLM's ``/weight_checker`` through the router. With ``checksum``: ``checksums`` is the map every worker
    reported when all agree; ``identical`` says whether every worker holds the same weights, key for key (only
    workers of one parallel layout compare: the keys name their ranks), and ``differing`` names the keys on
    which some worker differs or that some worker lacks."""

    identical: bool | None = None
    differing: list[str] = Field(default_factory=list)


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
