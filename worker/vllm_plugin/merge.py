"""One answer from every rank's answer: how a vLLM server reports a weight-sync call.

Every rank of a tensor-parallel vLLM server joins the group, receives and loads on its own, so a
call succeeds only when it succeeded on every rank; each rank's outcome is kept in
``rank_results``, and what the ranks did to the weights is merged so that a mix is never reported
as a consistent state: all ``updated`` is ``updated``, all ``intact`` is ``intact``, anything else
is ``partial`` (some ranks hold new weights, others old ones).
"""

from __future__ import annotations

from collections.abc import Sequence

from router.contract.admin import AdminResult, RankResult, WeightsEffect
from router.contract.weight_sync import (
    AbortWeightsUpdateResponse,
    CompleteWeightsUpdateResponse,
    PrepareWeightsUpdateResponse,
    RankChecksum,
    WeightSyncResponse,
)

Ranked = AdminResult | PrepareWeightsUpdateResponse


def merged_message(answers: Sequence[Ranked]) -> str:
    """The ranks' message when they agree, else each rank's, named."""
    messages = [a.message for a in answers]
    if len(set(messages)) <= 1:
        return messages[0] if messages else ""
    return "; ".join(f"rank {i}: {m}" for i, m in enumerate(messages) if m)


def rank_results(answers: Sequence[Ranked]) -> list[RankResult]:
    size = len(answers)
    return [RankResult(rank=i, tp_rank=i, tp_size=size, success=a.ok, message=a.message) for i, a in enumerate(answers)]


def merged_effect(effects: Sequence[WeightsEffect | None]) -> WeightsEffect | None:
    """``updated`` or ``intact`` when every rank says so; ``None`` when no rank said; else ``partial``."""
    said = set(effects)
    if said == {None}:
        return None
    if len(said) == 1:
        return effects[0]
    return "partial"


def _any_said(flags: Sequence[bool | None]) -> bool | None:
    """``True`` when a rank said so, ``False`` when every rank that said anything said no, ``None`` when none said."""
    said = [f for f in flags if f is not None]
    return any(said) if said else None


def _partial(answers: Sequence[Ranked]) -> bool:
    return any(bool(a.weights_partial) for a in answers)


def merge_group(answers: Sequence[WeightSyncResponse]) -> WeightSyncResponse:
    return WeightSyncResponse(
        success=all(a.success for a in answers),
        message=merged_message(answers),
        join_attempted=_any_said([a.join_attempted for a in answers]),
        weights="intact",
        rank_results=rank_results(answers),
    )


def merge_prepare(answers: Sequence[PrepareWeightsUpdateResponse]) -> PrepareWeightsUpdateResponse:
    return PrepareWeightsUpdateResponse(
        status="ready" if answers and all(a.ok for a in answers) else "error",
        message=merged_message(answers),
        weights="intact",
        weights_partial=_partial(answers),
        rank_results=rank_results(answers),
    )


def merge_complete(answers: Sequence[CompleteWeightsUpdateResponse]) -> CompleteWeightsUpdateResponse:
    first = answers[0]
    success = all(a.success for a in answers)
    checksums = [a.checksum for a in answers]
    return CompleteWeightsUpdateResponse(
        success=success,
        message=merged_message(answers),
        weights=merged_effect([a.weights for a in answers]),
        weights_partial=_partial(answers),
        num_buckets_received=min(a.num_buckets_received for a in answers),
        checksum=first.checksum if success else None,
        rank_checksums=[RankChecksum(rank=i, checksum=str(c)) for i, c in enumerate(checksums)]
        if success and any(c is not None for c in checksums)
        else None,
        weight_version=first.weight_version if success else None,
        elapsed_s=max((a.elapsed_s for a in answers if a.elapsed_s is not None), default=None),
        rank_results=rank_results(answers),
    )


def merge_abort(answers: Sequence[AbortWeightsUpdateResponse]) -> AbortWeightsUpdateResponse:
    return AbortWeightsUpdateResponse(
        success=all(a.success for a in answers),
        message=merged_message(answers),
        weights=merged_effect([a.weights for a in answers]) or "intact",
        weights_partial=_partial(answers),
        rank_results=rank_results(answers),
    )
