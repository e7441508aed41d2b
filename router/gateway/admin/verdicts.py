"""What each worker's answer to a fenced operation means for that worker.

Every worker says what a call left its weights as (``weights``: ``intact``,
``updated`` or ``partial``; ``join_attempted`` for a group init). From the
answers of all targets the router decides, per worker, whether it may go back
into routing or must stay fenced because its weights may differ from the fleet's:

- it succeeded: restored;
- it refused before touching anything (``weights: intact``; for a group init,
  refused before any join began): restored, unless other targets of a
  weight-writing operation succeeded, so that this one holds the previous
  weights while the fleet moved on. A worker whose weights were already partial
  before the call (``weights_partial: true``: a failed update, or weights released
  without a copy) is restored too: the refusal changed nothing, and such a worker
  is kept out of routing by its ``weight_state`` (pending), not by this fence;
- anything else (no usable answer, ``partial``, an answer that does not say,
  a join that failed or timed out): kept fenced until an operator resolves it.

When no target succeeded and every one refused, nothing changed anywhere: the
router answers with the workers' own 4xx status and message.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from router.contract import endpoints as ep
from router.contract.admin import WeightsReport
from router.contract.base import WireResponse
from router.contract.fleet_answers import WorkerResult
from router.contract.weight_sync import JoinReport
from router.gateway.admin.operations import AnyOperation


@dataclass(frozen=True, slots=True)
class Verdict:
    """The fence's fate per worker, and how the operation as a whole ended."""

    kept: tuple[str, ...]
    """Workers that stay out of routing: their weights may differ from the fleet's."""
    all_refused: bool
    """No target succeeded and every one refused without touching anything."""
    refusal_status: int
    """The status to answer an all-refused operation with: the workers' own, when they agree."""


def refused_untouched(op: AnyOperation, result: WorkerResult[WireResponse]) -> bool:
    """``result`` is a refusal that changed nothing on its worker (whatever state its weights were in before)."""
    body = result.body
    if result.success or body is None or not (400 <= (result.status_code or 0) < 500):
        return False
    if op.path == ep.INIT_WEIGHTS_UPDATE_GROUP.path:
        return isinstance(body, JoinReport) and body.join_attempted is False
    # An answer that says nothing of the weights (no :class:`WeightsReport`) may have touched them.
    return isinstance(body, WeightsReport) and body.weights == "intact"


def judge(op: AnyOperation, results: Sequence[WorkerResult[WireResponse]]) -> Verdict:
    fleet_moved = op.endpoint.writes_weights and any(r.success for r in results)
    kept = tuple(r.worker for r in results if not r.success and (fleet_moved or not refused_untouched(op, r)))
    all_refused = bool(results) and all(refused_untouched(op, r) for r in results)
    statuses = Counter(r.status_code for r in results if r.status_code is not None)
    status = statuses.most_common(1)[0][0] if len(statuses) == 1 else 400
    return Verdict(kept=kept, all_refused=all_refused, refusal_status=status or 400)
