"""SGLang's two-phase weight update: prepare, complete, abort, and the prepared update's expiry.

``/prepare_weights_update`` checks everything and posts the receive before the trainer
broadcasts; ``/complete_weights_update`` waits for the receive, applies and commits;
``/abort_weights_update`` drops a prepared update the trainer will not broadcast. Each update is
one transaction of the worker's update pipeline (:mod:`worker.update_pipeline`), begun by the prepare
through the controller's shared :meth:`~worker.transfer.group.controller.WeightSyncController.start_receive`
(which refuses before anything is received), and held in between:

* **Streaming** (default): buckets are applied as they arrive, double-buffered.
  Generation is held (an ``in_place`` pause, lifted at a successful complete if
  this update set it) and the weights are ``writing`` from the first applied
  bucket until complete succeeds. On failure the worker stays paused and the
  weights ``partial`` until the whole model has been rewritten by later updates
  or reloaded from disk.
* **Atomic**: buckets are staged; complete applies them in one scheduler step
  with a rollback copy of exactly the tensors it overwrites, so a failure keeps
  the old weights bit for bit and generation may continue.
* The visible ``weight_version`` changes only after a successful apply.
* **Abort**: a broadcast already posted cannot be withdrawn, so if the receive
  was still waiting the group is marked broken ("a prepared receive was aborted")
  and every later prepare or update on it is refused until it is destroyed and
  re-initialized; the receive thread drops whatever still lands and ends by its
  deadline at the latest. Nothing applied yet (the normal case): success, weights
  and version untouched, generation as before the prepare. Buckets already applied
  (streaming, trainer already sending): failure with ``weights_partial``, and the
  worker stays paused.
* **At most one prepared update**, held from prepare to complete or abort
  (:mod:`worker.transfer.group.held`). It holds the worker's writer lock in between, so
  nobody may hold it forever: one never completed nor aborted ends by itself, as a
  failed receive would, once its receive window, the receive loop's grace and an
  apply have passed. While its receive runs every new receive is refused; one whose
  receive ended but that was never completed is ended to make room (:meth:`TwoPhase.make_room`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from functools import partial
from typing import TYPE_CHECKING, Protocol, TypeVar

from router.contract.admin import WeightsEffect
from router.contract.budget import APPLY_S
from router.contract.weight_sync import (
    AbortWeightsUpdateRequest,
    AbortWeightsUpdateResponse,
    CompleteWeightsUpdateRequest,
    CompleteWeightsUpdateResponse,
    PrepareWeightsUpdateRequest,
    PrepareWeightsUpdateResponse,
    RankChecksum,
)
from router.dataplane.formats import for_load_format
from router.dataplane.group import WeightUpdateGroup
from worker.engine.results import effect_of
from worker.ranks import AdminBusy
from worker.transfer.group.held import Held
from worker.transfer.group.receive_session import PARTIAL_NOTE, ReceiveRequest, Receives, ReceiveSession
from worker.transfer.group.table import group_note
from worker.update_pipeline import UpdateFailed, UpdatePipeline, UpdateRefused

if TYPE_CHECKING:
    from worker.engine.model_worker import ModelWorker

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How long an abort, or the expiry, waits for another weight-sync call on this worker (an abort
#: has no ``timeout_s``; it must not wait out a complete's whole receive to learn it cannot run).
ABORT_WAIT_S = 10.0
ABORTED = "a prepared receive was aborted"


class TwoPhasePorts(Protocol):
    """What the two-phase calls use of the weight-sync controller (:mod:`worker.transfer.group.controller`)."""

    @property
    def updates(self) -> UpdatePipeline: ...

    @property
    def receives(self) -> Receives: ...

    @property
    def worker(self) -> ModelWorker: ...

    def holding(
        self, action: str, *, timeout_s: float | None = ..., wait_s: float = ...
    ) -> AbstractAsyncContextManager[None]: ...

    async def start_receive(self, ask: ReceiveRequest) -> ReceiveSession: ...

    async def in_thread(self, fn: Callable[[], T]) -> T: ...


class TwoPhase:
    """The prepared update (at most one) and the three calls over it."""

    def __init__(self, sync: TwoPhasePorts):
        self._sync = sync
        self._held: Held[ReceiveSession] = Held("prepared-update-expiry")

    @property
    def prepared(self) -> ReceiveSession | None:
        """The update prepared and not yet completed, aborted or expired."""
        return self._held.current

    # -- the three calls -----------------------------------------------------------------------

    async def prepare(self, req: PrepareWeightsUpdateRequest) -> PrepareWeightsUpdateResponse:
        async with self._sync.holding("prepare_weights_update", timeout_s=req.timeout_s):
            try:
                ask = ReceiveRequest(
                    req.buckets,
                    req.group_name,
                    for_load_format(req.load_format),
                    atomic=req.atomic,
                    abort_all=req.abort_all_requests,
                    weight_version=req.weight_version,
                    timeout_s=req.timeout_s,
                )
                update = await self._sync.start_receive(ask)
            except UpdateRefused as exc:
                return PrepareWeightsUpdateResponse(status="error", message=str(exc))
            # Nobody may hold the worker's weights forever: an update never completed nor aborted
            # ends by itself once its receive window, the receive loop's grace and an apply have passed.
            life = update.wait_s() + APPLY_S
            expires_at = time.monotonic() + life
            self._held.hold(update, expires_at=lambda: expires_at, end=partial(self._expire, life_s=life))
            mode = "atomic" if req.atomic else "streaming"
            return PrepareWeightsUpdateResponse(
                status="ready", message=f"Started recv loop for {req.num_buckets} buckets ({mode})"
            )

    async def complete(self, req: CompleteWeightsUpdateRequest) -> CompleteWeightsUpdateResponse:
        async with self._sync.holding("complete_weights_update", timeout_s=req.timeout_s):
            update = self._held.current
            if update is None or update.group.name != req.group_name:
                return CompleteWeightsUpdateResponse(
                    success=False,
                    weights="intact",
                    message=f"no weight update was prepared for group {req.group_name!r}",
                )
            self._held.detach(update)
            receives = self._sync.receives
            version = req.weight_version if req.weight_version is not None else update.weight_version
            wait_s = req.timeout_s if req.timeout_s is not None else update.wait_s()
            outcome = await self._sync.in_thread(partial(update.receiver.wait, wait_s))
            if outcome.ok and not update.atomic:
                outcome = await receives.followers_received(update, outcome)
            if not outcome.ok:
                await receives.cancel_followers(outcome.error or "the receive failed")
                effect = await self._sync.updates.fail(update.txn)
                partial_now = effect == "partial" or self._sync.worker.weights_partial
                note = PARTIAL_NOTE if partial_now else ""
                return CompleteWeightsUpdateResponse(
                    success=False,
                    weights=effect,
                    num_buckets_received=outcome.buckets_received,
                    message=f"{outcome.error}.{note}",
                    weights_partial=partial_now,
                    elapsed_s=update.elapsed_s(),
                )
            try:
                result = await receives.finish(
                    update, weight_version=version, flush_cache=req.flush_cache, checksum=req.return_checksum
                )
            except UpdateRefused as exc:
                message = f"received weights not applied (previous weights kept): {exc}"
                return self._not_applied(update, outcome.buckets_received, message, "intact")
            except UpdateFailed as exc:
                kept = "previous weights kept" if exc.effect == "intact" else "the weights are partial"
                message = f"applying the received weights failed, {kept}: {exc}"
                return self._not_applied(update, outcome.buckets_received, message, exc.effect)
            committed = result.data
            response = CompleteWeightsUpdateResponse(
                success=result.success,
                weights=effect_of(committed),
                num_buckets_received=outcome.buckets_received,
                elapsed_s=update.elapsed_s(),
                weight_version=self._sync.worker.weight_version,
                message=result.message
                if not result.success
                else f"Applied weights from {outcome.buckets_received} buckets",
            )
            if committed is not None and committed.checksum is not None:
                response.checksum = committed.checksum
                response.rank_checksums = [
                    RankChecksum(rank=i, checksum=str(o.data.checksum if o.data is not None else None))
                    for i, o in enumerate(result.outcomes)
                ]
            return response

    async def abort(self, req: AbortWeightsUpdateRequest) -> AbortWeightsUpdateResponse:
        """Drop the prepared update of ``req.group_name`` (see the module docstring)."""
        async with self._sync.holding("abort_weights_update", wait_s=ABORT_WAIT_S):
            update = self._held.current
            if update is None or update.group.name != req.group_name:
                other = f" (the prepared one is for group {update.group.name!r})" if update is not None else ""
                return AbortWeightsUpdateResponse(
                    success=False,
                    weights="intact",
                    weights_partial=bool(self._sync.worker.weights_partial),
                    message=f"no prepared weight update for group {req.group_name!r} to abort{other}",
                )
            self._held.detach(update)
            update.txn.failed.set()  # bucket applies not yet run are refused from here on
            update.receiver.cancel(ABORTED, broken_reason=ABORTED)
            update.receiver.release()
            await self._sync.receives.cancel_followers(ABORTED, broken_reason=ABORTED)
            outcome = update.receiver.outcome()
            applied = update.txn.buckets_applied
            effect = await self._sync.updates.fail(update.txn)
        group = update.group
        note = group_note(group)
        if applied:
            return AbortWeightsUpdateResponse(
                success=False,
                weights=effect,
                weights_partial=effect == "partial",
                message=f"Aborted the weight update for group {group.name!r}, but {applied} bucket(s) had already been "
                "applied: the weights are partially updated; the worker stays paused and serves nothing until a "
                f"full update or a reload from disk replaces them.{note}",
            )
        partial_now = self._sync.worker.weights_partial
        earlier = " The weights were already partially updated by an earlier failed update." if partial_now else ""
        return AbortWeightsUpdateResponse(
            success=True,
            weights="intact",
            weights_partial=partial_now,
            message=f"Dropped the prepared weight update for group {group.name!r} ({outcome.buckets_received} of "
            f"{outcome.buckets_expected} bucket(s) received, none applied); weights and weight_version "
            f"unchanged.{earlier}{note}",
        )

    # -- the prepared update, seen from the controller -----------------------------------------

    async def make_room(self) -> None:
        """Before any new receive: raise :class:`UpdateRefused` while the prepared update's receive runs;
        end one whose receive ended but that was never completed (its writer lock is released)."""
        current = self._held.current
        if current is None:
            return
        if not current.receiver.state.finished:
            raise UpdateRefused("a weight update is already in progress; call /complete_weights_update first")
        log.warning("discarding a weight update that was never completed (%s)", current.receiver.state.value)
        self._held.detach(current)
        await self._sync.updates.fail(current.txn)

    def cancel_on(self, group: WeightUpdateGroup, reason: str) -> None:
        """``group`` is going away: a prepared update on it fails and its receive is dropped; it stays
        held, so its complete, abort or expiry still answers for it."""
        update = self._held.current
        if update is not None and update.group is group:
            update.txn.failed.set()
            update.receiver.cancel(reason)

    def close(self) -> None:
        """Worker shutdown: the prepared update fails and releases the writer lock at once."""
        update = self._held.current
        if update is not None:
            self._held.detach(update)
            update.txn.failed.set()
            update.receiver.cancel("the worker is shutting down")
            update.txn.end()

    # -- expiry --------------------------------------------------------------------------------

    async def _expire(self, update: ReceiveSession, *, life_s: float) -> bool:
        """The held update's expiry: end it (``False``: another call holds the lock; tried again later)."""
        try:
            async with self._sync.holding("ending an expired weight update", wait_s=ABORT_WAIT_S):
                if self._held.current is not update:
                    return True
                self._held.detach(update)
                await self._end_expired(update, life_s)
                return True
        except AdminBusy:
            return False

    async def _end_expired(self, update: ReceiveSession, life_s: float) -> None:
        log.warning(
            "weight update for group %r was neither completed nor aborted within %.0fs; ending it",
            update.group.name,
            life_s,
        )
        update.txn.failed.set()
        reason = "no /complete_weights_update or /abort_weights_update before the update's deadline"
        update.receiver.cancel(reason)
        update.receiver.release()
        await self._sync.receives.cancel_followers(reason)
        await self._sync.updates.fail(update.txn)

    def _not_applied(
        self, update: ReceiveSession, received: int, message: str, effect: WeightsEffect
    ) -> CompleteWeightsUpdateResponse:
        return CompleteWeightsUpdateResponse(
            success=False,
            weights=effect,
            num_buckets_received=received,
            elapsed_s=update.elapsed_s(),
            message=message,
            weights_partial=self._sync.worker.weights_partial,
        )
