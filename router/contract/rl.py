"""The RL control API of the SGLang Model Gateway (``smg --enable-rl``, ``/v1/rl/*``), as omni-router answers it.

The bodies are smg's, field for field (its ``RlWorkersResponse``, ``RlWorkerEntry``,
``RlCallOutcome``, ``RlFanoutResponse``), so smg's own client (``smg.rl``) reads them unchanged:

- ``GET /v1/rl/workers`` → :class:`RlWorkersResponse` with :data:`RL_PROTOCOL_VERSION`;
- a per-worker engine call → :class:`RlCallOutcome`, its HTTP status the engine's;
- a fan-out → :class:`RlFanoutResponse`: 200 when ``failed`` is empty, 207 otherwise. ``results``
  holds every call that got an answer, whatever its status; ``failed`` every target that did not
  succeed (an engine error status is in both).

Refusals keep omni's one error shape (``{"error": {"message", "type"}}``) with smg's stable error
code as ``error.type`` and again as ``code`` beside it (:class:`RlRefusal`): smg itself answers
``{"error": "<code>", "message": ...}``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from router.contract.base import WireResponse
from router.contract.errors import ApiError, error_body

#: The version of the ``/v1/rl`` contract smg 1.13.0 reports; bumped by smg only for incompatible changes.
RL_PROTOCOL_VERSION = 1

RlErrorCode = Literal[
    "invalid_body",
    "invalid_version",
    "invalid_version_policy",
    "invalid_engine_path",
    "selector_required",
    "invalid_selector",
    "no_workers_match",
    "worker_not_found",
    "unsupported_connection_mode",
    "no_control_endpoint",
    "upstream_unreachable",
    "upstream_timeout",
]

#: Why one fan-out target did not succeed (``RlFailedCall.error``).
RlFailure = Literal["upstream_error", "upstream_unreachable", "upstream_timeout", "unsupported_connection_mode"]


class RlRefusal(ApiError):
    """A ``/v1/rl`` refusal: omni's error shape, carrying smg's stable error code."""

    def __init__(self, status: int, code: RlErrorCode, message: str):
        super().__init__(status, message)
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.code, code=self.code)


class RlCapabilities(WireResponse):
    """What an engine can do for RL control (``source``: ``static``, the engine's built-in row)."""

    source: Literal["static", "label"] = "static"
    pause_modes: list[str] = Field(default_factory=list)
    update_from: list[str] = Field(default_factory=list)
    abort: bool = False
    flush_cache: bool = False
    sleep_wake: bool = False
    reports_weight_version: bool = False


class RlWorkerEntry(WireResponse):
    """One row of ``GET /v1/rl/workers``; ``labels`` carries omni's routing state (``omni.*``)."""

    id: str
    url: str
    base_url: str
    engine: str
    engine_version: str | None = None
    model_id: str
    worker_type: str = "regular"
    connection_mode: str = "http"
    tp_size: int | None = None
    dp_size: int | None = None
    pp_size: int | None = None
    dp_ranks: int = 1
    role: str | None = None
    health: str
    weight_version: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    capabilities: RlCapabilities


class RlWorkersResponse(WireResponse):
    """``GET /v1/rl/workers``."""

    protocol_version: int = RL_PROTOCOL_VERSION
    workers: list[RlWorkerEntry]
    total: int


class RlCallOutcome(WireResponse):
    """One engine call that got an answer, whatever its status; ``body`` is the engine's JSON."""

    worker_id: str
    url: str
    status: int
    latency_ms: int
    body: Any = None


class RlFailedCall(WireResponse):
    """One target that did not succeed; ``status`` is the engine's, when it answered."""

    worker_id: str
    url: str
    error: RlFailure
    message: str
    status: int | None = None


class RlFanoutResponse(WireResponse):
    """A fan-out's answer: 200 when ``failed`` is empty, 207 otherwise."""

    results: dict[str, RlCallOutcome] = Field(default_factory=dict)
    failed: list[RlFailedCall] = Field(default_factory=list)
    total: int = 0
    succeeded: int = 0
    fenced: list[str] = Field(default_factory=list)
    """omni only: the targets the router keeps out of routing because their weights may differ (fail closed)."""
