"""What the control process and the data-plane processes say to each other (one WebSocket each).

Control → data plane: :class:`RoutingSnapshot` (versioned; acknowledged; with the leader gate's
state under ``--leader-election``), :class:`Placed` (the answer to a :class:`Place`), :class:`Unpinned`, :class:`LoadElsewhere`
(the other processes' requests in flight per worker, for ``least_inflight``), :class:`ScrapeRequest`,
:class:`DropStale` (a pause is about to be sent: :mod:`router.gateway.admin.stale_at_pause`).
Data plane → control: :class:`Ack`, :class:`LoadReport`, :class:`WorkerRestarted`, :class:`ScrapeAnswer`,
:class:`Place` and :class:`PinsUsed` (the control process owns the one session table:
:mod:`.session_pins`), :class:`StaleDropped`.
Each is parsed once, at the socket, into one of these models.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from router.contract.fleet import EngineName, HealthState, LeaderRole
from router.contract.fleet_adapters import FleetAdapterTable
from router.gateway.fleet.weights import FleetRecord


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorkerView(_Message):
    """What routing needs to know of one worker (the fields ``WorkerRegistry.is_routable`` reads)."""

    id: str
    url: str
    engine: EngineName | None
    health: HealthState
    disabled: bool
    departed: str | None
    weight_version: str | None
    weight_state: str | None
    instance_id: str | None
    tp_size: int | None
    paused: bool = False
    reported_paused: bool | None = None
    asleep: bool = False


class GateView(_Message):
    """The control process's leader gate (``--leader-election``), so a data plane answers as it would.

    Times are on ``time.monotonic()``, which on Linux is CLOCK_MONOTONIC: one clock for every process
    on the host, so a data plane closes at the very moment its control process's leadership ends,
    whether or not another snapshot reaches it first."""

    role: LeaderRole
    holder: str | None
    identity: str
    open_until: float | None
    """When the leader's last renewal stops counting (its renew deadline); ``None``: it has not renewed."""
    free_at: float
    """When the lease could be taken as seen by the control process (0: nobody holds it): the Retry-After."""


class RoutingSnapshot(_Message):
    type: Literal["snapshot"] = "snapshot"
    version: int
    workers: list[WorkerView]
    fleet: FleetRecord | None
    gate: GateView | None = None
    """``None`` without leader election: the data planes serve whenever their control process does."""
    adapters: FleetAdapterTable | None = None
    """The fleet's LoRA adapters and their holders (``None``: none loaded)."""


class LoadElsewhere(_Message):
    type: Literal["load"] = "load"
    inflight: dict[str, int]
    """Worker id → requests in flight on it through the *other* data-plane processes."""


class ScrapeRequest(_Message):
    type: Literal["scrape"] = "scrape"
    id: int


class DropStale(_Message):
    """Before a pause: drop the requests in flight on ``workers`` that version ``next_sequence`` makes stale
    (:mod:`router.gateway.routing.stale`), waiting ``wait_s`` at most for their aborts, then answer."""

    type: Literal["drop_stale"] = "drop_stale"
    id: int
    next_sequence: int
    workers: list[str]
    wait_s: float


class StaleDropped(_Message):
    """The answer to :class:`DropStale`: how many requests this process dropped."""

    type: Literal["stale_dropped"] = "stale_dropped"
    id: int
    dropped: int


class Placed(_Message):
    """Where the control process's session table put a session (:class:`Place`); ``None``: nowhere known."""

    type: Literal["placed"] = "placed"
    id: int
    worker: str | None


class Place(_Message):
    """A data plane asks the control process's session table where a session goes (``--session-affinity``)."""

    type: Literal["place"] = "place"
    id: int
    session: str
    candidates: list[str]
    """The ids of the workers the request may go to, as this data plane's snapshot has them."""
    retry: bool


class PinsUsed(_Message):
    """Sessions a data plane served from its copies of their pins since its last report (their pins live on)."""

    type: Literal["pins_used"] = "pins_used"
    rows: list[int]


class Unpinned(_Message):
    """Pins the control process's table moved or evicted: every data plane drops its copies of them."""

    type: Literal["unpinned"] = "unpinned"
    rows: list[int]


class Ack(_Message):
    type: Literal["ack"] = "ack"
    version: int


class LoadReport(_Message):
    type: Literal["load_report"] = "load_report"
    inflight: dict[str, int]
    """Worker id → requests in flight on it through this process (only non-zero counts)."""
    adapters: dict[str, int] = {}
    """LoRA adapter name → requests naming it in flight through this process (only non-zero counts)."""


class WorkerRestarted(_Message):
    """A worker answered from another process than its last probe saw (the instance check):
    the control process learns at once instead of at the next probe."""

    type: Literal["restarted"] = "restarted"
    worker: str
    instance_id: str


class ScrapeAnswer(_Message):
    type: Literal["scrape_answer"] = "scrape_answer"
    id: int
    text: str
    """This process's metrics in the Prometheus text format."""


ToDataPlaneMessage = RoutingSnapshot | LoadElsewhere | ScrapeRequest | Placed | Unpinned | DropStale
ToControlMessage = Ack | LoadReport | WorkerRestarted | ScrapeAnswer | Place | PinsUsed | StaleDropped
ToDataPlane = Annotated[ToDataPlaneMessage, Field(discriminator="type")]
ToControl = Annotated[ToControlMessage, Field(discriminator="type")]

TO_DATA_PLANE: TypeAdapter[ToDataPlaneMessage] = TypeAdapter(ToDataPlane)
TO_CONTROL: TypeAdapter[ToControlMessage] = TypeAdapter(ToControl)
