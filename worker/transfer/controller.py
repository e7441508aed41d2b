"""The worker's weight-sync controller: groups, and at most one update in flight.

The HTTP handlers call one method each. This module holds the protocol
adapters (SGLang's single-phase call, the two-phase prepare/complete/abort) and
the prepared update's expiry; the groups are :mod:`worker.transfer.groups`, one
receive on every rank is :mod:`worker.transfer.receive_session`, and vLLM's
start/update/finish is :mod:`worker.transfer.vllm_engine`. The controller's call
lock is the first in the worker's lock order (:mod:`worker.coordinator`).

Every update is a transaction of the worker's one update pipeline
(:mod:`worker.updates`), so the rules below are the pipeline's, stated for the
distributed sources:

* **Never block the event loop.** Joining a group and waiting for a receive run
  on this controller's threads; model steps run on the scheduler thread.
* **Refuse before receiving.** Metadata is checked against the model
  (:mod:`worker.transfer.validation`) and the pipeline checks the worker
  (weights not released; generation paused, or nothing active, or
  ``abort_all_requests``) before a receive is posted. A refused prepare starts
  nothing, so the trainer never broadcasts into the void.
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
* **Abort** (``/abort_weights_update``): drops a prepared update that the
  trainer will not broadcast. A broadcast already posted cannot be withdrawn,
  so if the receive was still waiting the group is marked broken ("a prepared
  receive was aborted") and every later prepare or update on it is refused
  until it is destroyed and re-initialized; the receive thread drops whatever
  still lands and ends by its deadline at the latest. Nothing applied yet (the
  normal case): success, weights and version untouched, generation as before
  the prepare. Buckets already applied (streaming, trainer already sending):
  failure with ``weights_partial``, and the worker stays paused.
* Single phase (SGLang's call): one bucket, staged and applied in one step. A
  refusal there cannot stop a trainer that broadcasts right after its HTTP
  call (slime does); its broadcast then waits until the trainer's own timeout.
  That race is what the two-phase protocol removes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from router.contract.admin import WeightsEffect
from router.contract.budget import APPLY_S, DEFAULT_GROUP_TIMEOUT_S, DEFAULT_RECEIVE_TIMEOUT_S, HOP_MARGIN_S
from router.contract.weight_sync import (
    AbortWeightsUpdateRequest,
    AbortWeightsUpdateResponse,
    CompleteWeightsUpdateRequest,
    CompleteWeightsUpdateResponse,
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    PrepareWeightsUpdateRequest,
    PrepareWeightsUpdateResponse,
    RankChecksum,
    TensorListMeta,
    UpdateWeightsFromDistributedRequest,
    WeightSyncResponse,
)
from router.dataplane.formats import BucketFormat, for_load_format
from router.dataplane.group import WeightUpdateGroup
from worker.engine.results import effect_of
from worker.stage import AdminBusy, held
from worker.transfer.bracket import UpdateBracket
from worker.transfer.groups import GroupTable, group_note
from worker.transfer.held import Held
from worker.transfer.receive_session import SYNC_ACTION, Receives, ReceiveSession
from worker.transfer.receiver import ReceiveOutcome
from worker.updates import UpdateFailed, UpdateRefused

if TYPE_CHECKING:
    from worker.coordinator import Coordinator

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How long an abort waits for another weight-sync call on this worker before answering 503.
ABORT_WAIT_S = 10.0
#: How long any other weight-sync call waits for one still running (a complete waiting for its receive).
SYNC_LOCK_WAIT_S = HOP_MARGIN_S
ABORTED = "a prepared receive was aborted"
PARTIAL_NOTE = " The full weights of the ModelRunner are partially updated. Please discard the whole weights."


class WeightSyncController:
    """Per-worker weight-sync state behind the weight-sync routes."""

    def __init__(
        self,
        coordinator: Coordinator,
        *,
        group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
        receive_timeout_s: float = DEFAULT_RECEIVE_TIMEOUT_S,
    ):
        self.coordinator = coordinator
        self.updates = coordinator.updates
        self.group_timeout_s = group_timeout_s
        self.receive_timeout_s = receive_timeout_s
        self.bracket = UpdateBracket()
        self._held: Held[ReceiveSession] = Held("prepared-update-expiry")
        self._lock = asyncio.Lock()
        self._lock_holder: str | None = None
        # Joins and receive waits block for up to their timeouts: they get their own threads.
        self._threads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="weight-sync")
        # Set at shutdown: a rendezvous still waiting for its peers gives up at once.
        self._closing = threading.Event()
        self.receives = Receives(
            coordinator.stage,
            coordinator.worker,
            self.updates,
            in_thread=self.in_thread,
            receive_timeout_s=receive_timeout_s,
        )
        self.groups = GroupTable(
            coordinator.stage,
            default_backend="nccl" if coordinator.worker.device.type == "cuda" else "gloo",
            in_thread=self.in_thread,
            closing=self._closing,
            group_timeout_s=group_timeout_s,
        )

    def group(self, name: str) -> WeightUpdateGroup | None:
        return self.groups.get(name)

    @property
    def receive_state(self) -> str | None:
        """The prepared update's receive state (``/health``'s ``receive``), or ``None`` when none is prepared."""
        update = self._held.current
        return update.receiver.state.value if update is not None else None

    # -- groups --------------------------------------------------------------------------------

    async def init_group(self, req: InitWeightsUpdateGroupRequest) -> WeightSyncResponse:
        return await self.groups.init(req)

    async def adopt_group(self, name: str, join: Callable[[threading.Event], WeightUpdateGroup]) -> WeightSyncResponse:
        """See :meth:`GroupTable.adopt`."""
        return await self.groups.adopt(name, join)

    async def destroy_group(self, req: DestroyWeightsUpdateGroupRequest) -> WeightSyncResponse:
        group = self.groups.pop(req.group_name)
        if group is None:
            return _fail("The group to be destroyed does not exist.")
        update = self._held.current
        if update is not None and update.group is group:
            update.txn.failed.set()
            update.receiver.cancel("the weight-update group was destroyed")
        await self.groups.leave(group)
        return WeightSyncResponse(success=True, message="Succeeded to destroy custom process group.")

    # -- two phase -----------------------------------------------------------------------------

    async def prepare(self, req: PrepareWeightsUpdateRequest) -> PrepareWeightsUpdateResponse:
        async with self.holding("prepare_weights_update"):
            try:
                update = await self.start_receive(
                    req.buckets,
                    req.group_name,
                    for_load_format(req.load_format),
                    atomic=req.atomic,
                    abort_all=req.abort_all_requests,
                    weight_version=req.weight_version,
                    timeout_s=req.timeout_s,
                )
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
        async with self.holding("complete_weights_update"):
            update = self._held.current
            if update is None or update.group.name != req.group_name:
                return CompleteWeightsUpdateResponse(
                    success=False,
                    weights="intact",
                    message=f"no weight update was prepared for group {req.group_name!r}",
                )
            self._detach(update)
            version = req.weight_version if req.weight_version is not None else update.weight_version
            wait_s = req.timeout_s if req.timeout_s is not None else update.wait_s()
            outcome = await self.in_thread(partial(update.receiver.wait, wait_s))
            if outcome.ok and not update.atomic:
                outcome = await self.followers_received(update, outcome)
            if not outcome.ok:
                await self.cancel_followers(outcome.error or "the receive failed")
                effect = await self.updates.fail(update.txn)
                partial_now = effect == "partial" or self.coordinator.worker.weights_partial
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
                result = await self.receives.finish(
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
                weight_version=self.coordinator.worker.weight_version,
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
        async with self.holding("abort_weights_update", wait_s=ABORT_WAIT_S):
            update = self._held.current
            if update is None or update.group.name != req.group_name:
                other = f" (the prepared one is for group {update.group.name!r})" if update is not None else ""
                return AbortWeightsUpdateResponse(
                    success=False,
                    weights="intact",
                    weights_partial=bool(self.coordinator.worker.weights_partial),
                    message=f"no prepared weight update for group {req.group_name!r} to abort{other}",
                )
            self._detach(update)
            update.txn.failed.set()  # bucket applies not yet run are refused from here on
            update.receiver.cancel(ABORTED, broken_reason=ABORTED)
            update.receiver.release()
            await self.cancel_followers(ABORTED, broken_reason=ABORTED)
            outcome = update.receiver.outcome()
            applied = update.txn.buckets_applied
            effect = await self.updates.fail(update.txn)
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
        partial_now = self.coordinator.worker.weights_partial
        earlier = " The weights were already partially updated by an earlier failed update." if partial_now else ""
        return AbortWeightsUpdateResponse(
            success=True,
            weights="intact",
            weights_partial=partial_now,
            message=f"Dropped the prepared weight update for group {group.name!r} ({outcome.buckets_received} of "
            f"{outcome.buckets_expected} bucket(s) received, none applied); weights and weight_version "
            f"unchanged.{earlier}{note}",
        )

    # -- single phase --------------------------------------------------------------------------

    async def update_from_distributed(self, req: UpdateWeightsFromDistributedRequest) -> WeightSyncResponse:
        """SGLang's call: receive one bucket while the request is open, then apply it
        in one scheduler step (with rollback) and flush as requested.

        A receive that fails leaves the weights ``partial``: earlier calls of the same sync
        (one per bucket) may already have been applied, so the whole is a mix."""
        async with self.holding("update_weights_from_distributed"):
            try:
                update = await self.start_receive(
                    [req],
                    req.group_name,
                    for_load_format(req.load_format),
                    atomic=True,
                    abort_all=req.abort_all_requests,
                    weight_version=req.weight_version,
                    timeout_s=req.timeout_s,
                )
            except UpdateRefused as exc:
                return _fail(f"Failed to update parameter online: {exc}.", weights="intact")
            outcome = await self.in_thread(partial(update.receiver.wait, update.wait_s()))
            if not outcome.ok:
                await self.cancel_followers(outcome.error or "the receive failed")
                await self.updates.mark_partial(update.txn)
                return _fail(f"Failed to update parameter online: {outcome.error}.{PARTIAL_NOTE}", weights="partial")
            try:
                result = await self.receives.finish(
                    update, weight_version=req.weight_version, flush_cache=req.flush_cache, checksum=False
                )
            except UpdateRefused as exc:
                return _fail(f"Failed to update parameter online: {exc}", weights="intact")
            except UpdateFailed as exc:
                return _fail(f"Failed to update parameter online: {exc}", weights=exc.effect)
            effect = effect_of(result.data)
            if not result.success:
                return _fail(f"Failed to update parameter online: {result.message}", weights=effect)
            message = "Succeeded to update parameter online."
            if req.weight_version is not None:
                message += f" Weight version updated to {req.weight_version}."
            return WeightSyncResponse(success=True, message=message, weights=effect)

    # -- shared steps --------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def holding(self, action: str, wait_s: float = SYNC_LOCK_WAIT_S) -> AsyncIterator[None]:
        """This controller's lock for one call: a caller waiting longer than ``wait_s`` gets 503
        naming the call that holds it (a complete waits for its receive, so it may hold it long)."""
        holder = self._lock_holder or "another weight-sync call"
        busy = f"{action}: {holder} is still running on this worker (waited {wait_s:g}s)"
        async with held(self._lock, wait_s, busy):
            self._lock_holder = action
            try:
                yield
            finally:
                self._lock_holder = None

    def _detach(self, update: ReceiveSession) -> None:
        """The caller now ends ``update`` (complete, abort, expiry or shutdown)."""
        self._held.detach(update)

    async def _expire(self, update: ReceiveSession, *, life_s: float) -> bool:
        """The held update's expiry: end it (``False``: another call holds the lock; tried again later)."""
        try:
            async with self.holding("ending an expired weight update", wait_s=ABORT_WAIT_S):
                if self._held.current is not update:
                    return True
                self._detach(update)
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
        await self.cancel_followers(reason)
        await self.updates.fail(update.txn)

    def _not_applied(
        self, update: ReceiveSession, received: int, message: str, effect: WeightsEffect
    ) -> CompleteWeightsUpdateResponse:
        return CompleteWeightsUpdateResponse(
            success=False,
            weights=effect,
            num_buckets_received=received,
            elapsed_s=update.elapsed_s(),
            message=message,
            weights_partial=self.coordinator.worker.weights_partial,
        )

    async def start_receive(
        self,
        buckets: Sequence[TensorListMeta],
        group_name: str,
        fmt: BucketFormat,
        *,
        atomic: bool,
        abort_all: bool,
        weight_version: str | None,
        timeout_s: float | None,
    ) -> ReceiveSession:
        """Check everything, begin the pipeline's transaction, start the receive; raise :class:`UpdateRefused`
        (nothing posted, the transaction undone)."""
        current = self._held.current
        if current is not None:
            if not current.receiver.state.finished:
                raise UpdateRefused("a weight update is already in progress; call /complete_weights_update first")
            log.warning("discarding a weight update that was never completed (%s)", current.receiver.state.value)
            self._detach(current)
            await self.updates.fail(current.txn)
        group = self.groups.get(group_name)
        if group is None:
            raise UpdateRefused(f"Process group {group_name!r} not initialized; call /init_weights_update_group first")
        if not group.alive:
            raise UpdateRefused(f"group {group_name!r} is broken ({group.broken_reason}); destroy and re-initialize it")
        plan = self.receives.plan(buckets, fmt)
        window = timeout_s or self.receive_timeout_s
        txn = await self.updates.begin(SYNC_ACTION, abort_all=abort_all, streaming=not atomic, timeout_s=window)
        try:
            return await self.receives.start(
                txn, group, plan, atomic=atomic, window_s=window, weight_version=weight_version
            )
        except UpdateRefused:
            await self.updates.end_refused(txn)
            raise

    async def followers_received(self, update: ReceiveSession, outcome: ReceiveOutcome) -> ReceiveOutcome:
        return await self.receives.followers_received(update, outcome)

    async def cancel_followers(self, reason: str, *, broken_reason: str | None = None) -> None:
        await self.receives.cancel_followers(reason, broken_reason=broken_reason)

    async def in_thread(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn)

    async def close(self) -> None:
        """Cancel any update and any rendezvous in progress, and leave every group (worker shutdown)."""
        self._closing.set()
        update = self._held.current
        if update is not None:
            self._detach(update)
            update.txn.failed.set()
            update.receiver.cancel("the worker is shutting down")
            update.txn.end()
        await self.groups.close()
        self._threads.shutdown(wait=False, cancel_futures=True)


def _fail(message: str, **fields: Any) -> WeightSyncResponse:
    return WeightSyncResponse(success=False, message=message, **fields)
