"""The answers of admin calls broadcast to the fleet.

A broadcast's answer (:class:`FleetAnswer`) is the answer a single worker gives,
with each field holding the value every worker agrees on (where they disagree,
the field's default), plus the router's envelope: ``path``, ``worker_count`` and
``results``, one :class:`WorkerResult` per worker holding that worker's own
parsed answer. A client written for one worker's answer therefore reads the same
names with the same types through the router; per-worker detail sits beside them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

from pydantic import Field

from router.contract.admin import ServerInfo, WeightsCheckerResult
from router.contract.base import Explained, WireResponse
from router.contract.fleet import RankAssignment
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

R = TypeVar("R", bound=WireResponse)
#: A worker's answer in a :class:`WorkerResult`, covariant: a result of any route is a ``WorkerResult[WireResponse]``.
A_co = TypeVar("A_co", bound=WireResponse, covariant=True)

#: Fields of a worker's answer that describe that worker alone; never lifted into the fleet's answer.
PER_WORKER_FIELDS = frozenset({"success", "message", "status", "rank_results", "error"})


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
    timings: dict[str, float] | None = Field(default=None, exclude_if=lambda v: v is None)
    """Milliseconds per phase of the operation (lock_wait, fence_barrier, journal_write, fan_out,
    slowest_worker, settle, verification, total; the router's ``router/gateway/admin/timings.py``)."""

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
    # Pydantic keeps a model's field values in its ``__dict__``: read there, nothing is copied or iterated.
    values_of = [vars(b) for b in bodies]
    first, reported = values_of[0], bodies[0].model_fields_set
    agreed: dict[str, Any] = {}
    for name in model.model_fields:
        if name in PER_WORKER_FIELDS or name not in reported:
            continue
        value = first[name]
        if all(v[name] == value for v in values_of[1:]):
            agreed[name] = value
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
