"""SGLang 0.5.23's weight-update bracket: ``/begin_weight_update`` … ``/end_weight_update``.

Newer SGLang refuses distributed and tensor updates outside a begin/end pair,
and miles calls both around every sync; slime (pinned to SGLang 0.5.15) calls
neither. This worker accepts the bracket and reports it but does not require
it, so both trainers work unchanged. A second begin while one is open is
refused, as SGLang refuses it; an end without a begin is accepted, since there
is nothing to finalise (weights are applied as they arrive, or at complete).
SGLang calls the bracket a "weight-update session"; here it is the bracket, since
nothing else in the project is one.
"""

from __future__ import annotations

from router.contract.weight_sync import BeginWeightUpdateRequest, EndWeightUpdateRequest, WeightSyncResponse


class UpdateBracket:
    """Whether a begin/end bracket is open, and for which selector."""

    def __init__(self) -> None:
        self.selector: str | None = None

    @property
    def is_open(self) -> bool:
        return self.selector is not None

    def begin(self, req: BeginWeightUpdateRequest) -> WeightSyncResponse:
        if req.selector == "draft":
            return WeightSyncResponse(
                success=False, message="this worker serves no draft model; selector 'draft' has nothing to update"
            )
        if self.is_open:
            return WeightSyncResponse(
                success=False, message="a weight-update bracket is already open; call end_weight_update() first"
            )
        self.selector = req.selector
        return WeightSyncResponse(success=True, message=f"weight-update bracket opened (selector={req.selector})")

    def end(self, req: EndWeightUpdateRequest) -> WeightSyncResponse:
        was_open, self.selector = self.is_open, None
        message = "weight-update bracket closed" if was_open else "no weight-update bracket was open"
        return WeightSyncResponse(success=True, message=message)
