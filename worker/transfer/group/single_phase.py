"""SGLang's single-phase weight update: ``/update_weights_from_distributed``.

One call per bucket: the receive is posted when the call arrives, the bucket is received while
the request is open, then staged and applied in one scheduler step with rollback, and the cache
flushed as asked. Each call is one transaction of the worker's update pipeline
(:mod:`worker.update_pipeline`), begun through the controller's shared
:meth:`~worker.transfer.group.controller.WeightSyncController.start_receive`.

* A refusal cannot stop a trainer that broadcasts right after its HTTP call (slime
  does): its broadcast then waits until the trainer's own timeout. That race is what
  the two-phase protocol (:mod:`worker.transfer.group.two_phase`) removes.
* A receive that fails leaves the weights ``partial``: earlier calls of the same
  sync (one per bucket) may already have been applied, so the whole is a mix.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from functools import partial
from typing import Any, Protocol, TypeVar

from router.contract.weight_sync import UpdateWeightsFromDistributedRequest, WeightSyncResponse
from router.dataplane.formats import for_load_format
from worker.engine.results import effect_of
from worker.transfer.group.receive_session import PARTIAL_NOTE, ReceiveRequest, Receives, ReceiveSession
from worker.update_pipeline import UpdateFailed, UpdatePipeline, UpdateRefused

T = TypeVar("T")

ACTION = "update_weights_from_distributed"
FAILED = "Failed to update parameter online"


class SinglePhasePorts(Protocol):
    """What the single-phase call uses of the weight-sync controller (:mod:`worker.transfer.group.controller`)."""

    @property
    def updates(self) -> UpdatePipeline: ...

    @property
    def receives(self) -> Receives: ...

    def holding(self, action: str, *, timeout_s: float | None = ...) -> AbstractAsyncContextManager[None]: ...

    async def start_receive(self, ask: ReceiveRequest) -> ReceiveSession: ...

    async def in_thread(self, fn: Callable[[], T]) -> T: ...


class SinglePhase:
    """``/update_weights_from_distributed``: one bucket received and applied within one call."""

    def __init__(self, sync: SinglePhasePorts):
        self._sync = sync

    async def update(self, req: UpdateWeightsFromDistributedRequest) -> WeightSyncResponse:
        async with self._sync.holding(ACTION, timeout_s=req.timeout_s):
            try:
                ask = ReceiveRequest(
                    [req],
                    req.group_name,
                    for_load_format(req.load_format),
                    atomic=True,
                    abort_all=req.abort_all_requests,
                    weight_version=req.weight_version,
                    timeout_s=req.timeout_s,
                )
                update = await self._sync.start_receive(ask)
            except UpdateRefused as exc:
                return _fail(f"{FAILED}: {exc}.", weights="intact")
            receives = self._sync.receives
            outcome = await self._sync.in_thread(partial(update.receiver.wait, update.wait_s()))
            if not outcome.ok:
                await receives.cancel_followers(outcome.error or "the receive failed")
                await self._sync.updates.mark_partial(update.txn)
                return _fail(f"{FAILED}: {outcome.error}.{PARTIAL_NOTE}", weights="partial")
            try:
                result = await receives.finish(
                    update, weight_version=req.weight_version, flush_cache=req.flush_cache, checksum=False
                )
            except UpdateRefused as exc:
                return _fail(f"{FAILED}: {exc}", weights="intact")
            except UpdateFailed as exc:
                return _fail(f"{FAILED}: {exc}", weights=exc.effect)
            effect = effect_of(result.data)
            if not result.success:
                return _fail(f"{FAILED}: {result.message}", weights=effect)
            message = "Succeeded to update parameter online."
            if req.weight_version is not None:
                message += f" Weight version updated to {req.weight_version}."
            return WeightSyncResponse(success=True, message=message, weights=effect)


def _fail(message: str, **fields: Any) -> WeightSyncResponse:
    return WeightSyncResponse(success=False, message=message, **fields)
