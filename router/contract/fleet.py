"""Router-only wire messages: worker records, registry requests, broadcast results.

Workers never see these; the router answers with them and the trainer client
reads them. Messages that workers also speak (generate, admin, weight sync)
live in the sibling modules.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator

from router.contract.base import WireRequest, WireResponse


class _Strict(WireRequest):
    """No coercion: ``"yes"`` where a bool belongs is a 400."""

    model_config = ConfigDict(extra="ignore", strict=True)

HealthState = Literal["healthy", "unhealthy", "dead"]


class WorkerRecord(WireResponse):
    """One worker as the registry sees it."""

    id: str
    url: str
    health: HealthState
    disabled: bool
    inflight: int
    weight_version: str | None = None
    tp_size: int | None = None


class WorkerList(WireResponse):
    workers: list[WorkerRecord]


class AddWorkerRequest(_Strict):
    """``POST /workers`` (and the legacy ``POST /add_worker?url=``)."""

    url: str = Field(min_length=1)
    disabled: bool = False


class UpdateWorkerRequest(_Strict):
    """``PUT /workers/{id}``: today only the operator's ``disabled`` flag can change."""

    disabled: bool


class WorkerUrlQuery(_Strict):
    """The legacy routes take the worker as ``?url=``."""

    url: str = Field(min_length=1)


class WorkerResult(WireResponse):
    """What one worker answered to one broadcast admin call.

    ``body`` holds the worker's parsed reply when it answered at all;
    ``error`` says why there is no usable reply (connection refused, timeout).
    """

    worker: str
    url: str
    success: bool
    status_code: int | None = None
    body: Any = None
    error: str | None = None
    elapsed_ms: float


class BroadcastResponse(WireResponse):
    """The router's reply to a broadcast admin call: 200 when every target succeeded, else 502."""

    success: bool
    message: str
    path: str
    worker_count: int
    results: list[WorkerResult]


class PrepareResponse(BroadcastResponse):
    """``/prepare_weights_update`` through the router: ``ready`` only when every target is.

    On ``error``, ``aborts`` holds the answers of the ready workers told to drop their receive.
    """

    status: Literal["ready", "error"]
    aborts: list[WorkerResult] = Field(default_factory=list)


class CompleteResponse(BroadcastResponse):
    """``/complete_weights_update`` through the router, with what each worker says it applied."""

    num_buckets_received: dict[str, int | None]
    checksums: dict[str, str | None]
    checksums_match: bool | None
    """``None`` when some worker reported no checksum."""


class GroupInitResponse(BroadcastResponse):
    """``/init_weights_update_group`` through the router, with the rank each worker was given."""

    ranks: list[dict[str, Any]]


class WorldSizeResponse(WireResponse):
    """``GET /get_world_size``: ranks held by workers, the trainer's rank 0 excluded."""

    world_size: int
    workers: list[dict[str, Any]] = Field(default_factory=list)


class RankPlanRequest(_Strict):
    """The two fields of ``/init_weights_update_group`` that the router plans ranks from.

    The rest of the body is forwarded to every worker untouched, so the router
    does not need (or re-declare) the full message.
    """

    world_size: int = Field(ge=2)
    rank_offset: int | None = Field(default=None, ge=0)

    @field_validator("world_size", "rank_offset", mode="before")
    @classmethod
    def _no_bools(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError("must be an integer")
        return value


class JournalResolveRequest(_Strict):
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


class JournalView(WireResponse):
    pending: JournalState | None = None
