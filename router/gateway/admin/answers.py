"""The router's answer to a broadcast: per-worker results folded into one fleet answer.

Every field of the route's response model holds the value all workers agree on
(see :func:`router.contract.fleet_answers.agreed_fields`); ``success`` is true only when
every target succeeded; ``message`` says who failed and why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from router.contract.base import WireRequest, WireResponse
from router.contract.fleet_answers import FleetAnswer, WorkerResult, agreed_fields
from router.gateway.admin.operations import Operation
from router.gateway.admin.timings import PhaseTimes

Resp = TypeVar("Resp", bound=WireResponse)


@dataclass(slots=True)
class Outcome(Generic[Resp]):
    """A finished fleet operation: the HTTP status and the answer for the caller (each worker's a ``Resp``),
    and where the operation spent its time (complete once the operation has ended)."""

    status: int
    answer: FleetAnswer[Resp]
    timings: PhaseTimes | None = None

    @property
    def ok(self) -> bool:
        return self.answer.success


def summarize(failed: Sequence[WorkerResult[WireResponse]]) -> str:
    """One line per failed worker: its id, its status and why."""
    return "; ".join(
        f"{r.worker} ({r.status_code if r.status_code is not None else 'no response'}): {r.reason()[:300]}"
        for r in failed
    )


def fleet_answer(
    op: Operation[WireRequest, Resp],
    results: Sequence[WorkerResult[Resp]],
    message: str,
    *,
    success: bool | None = None,
    **fields: Any,
) -> FleetAnswer[Resp]:
    """Fold ``results`` into ``op``'s answer model; ``fields`` (route-specific) override the agreed ones."""
    model = op.answer_model()
    agreed = agreed_fields(op.endpoint.response, [r.body for r in results])
    ok = all(r.success for r in results) if success is None else success
    return model.model_validate(
        {
            **agreed,
            **fields,
            "success": ok,
            "message": message,
            "path": op.path,
            "worker_count": len(results),
            "results": results,
        }
    )
