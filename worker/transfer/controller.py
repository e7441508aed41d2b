"""The worker's weight-sync controller: groups, and at most one update in flight.

The HTTP handlers call one method each; every update is a transaction of the
worker's one update pipeline (:mod:`worker.updates`), so the rules below are
the pipeline's, stated for the distributed sources:

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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
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
from router.dataplane.buckets import NamedTensors
from router.dataplane.formats import BucketFormat, for_load_format
from router.dataplane.group import GroupError, WeightUpdateGroup, init_weight_update_group
from worker.engine.weight_ops import CommitOptions
from worker.stage import StageResult, held
from worker.tp import transfer as tp_transfer
from worker.transfer.bracket import UpdateBracket
from worker.transfer.receiver import BucketReceiver, ReceiveBuffers, ReceiveOutcome, ReceiveState
from worker.transfer.validation import (
    ChecksumMismatch,
    MetadataError,
    announced_checksums,
    validate_buckets,
    verify_bucket,
    verify_staged,
)
from worker.updates import UpdateFailed, UpdateRefused, UpdateTransaction

if TYPE_CHECKING:
    from worker.coordinator import Coordinator

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How long an abort waits for another weight-sync call on this worker before answering 503.
ABORT_WAIT_S = 10.0
#: How long any other weight-sync call waits for one still running (a complete waiting for its receive).
SYNC_LOCK_WAIT_S = HOP_MARGIN_S
#: Past the receive deadline, the time the receive loop gets to notice it and report.
RECEIVE_GRACE_S = 5.0
#: The pipeline action of every distributed update.
SYNC_ACTION = "update_weights_from_distributed"
ABORTED = "a prepared receive was aborted"
PARTIAL_NOTE = " The full weights of the ModelRunner are partially updated. Please discard the whole weights."


@dataclass(eq=False)
class _Update:
    """One prepared two-phase update (or a running single-phase one): its transaction and its receive."""

    group: WeightUpdateGroup
    txn: UpdateTransaction
    receiver: BucketReceiver
    atomic: bool
    weight_version: str | None
    names: tuple[str, ...]
    #: Each bucket's announced checksum (``None``: none announced), verified before it is applied.
    checksums: tuple[str | None, ...] = ()
    started: float = field(default_factory=time.monotonic)
    expiry: asyncio.Task[None] | None = None

    def wait_s(self) -> float:
        """How long to wait for the receive: to its deadline, plus a grace for the loop to report."""
        return max(self.txn.deadline - time.monotonic(), 0.0) + RECEIVE_GRACE_S

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started


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
        self._groups: dict[str, WeightUpdateGroup] = {}
        self._joining: set[str] = set()
        self._update: _Update | None = None
        self._buffers = ReceiveBuffers()
        self._lock = asyncio.Lock()
        self._lock_holder: str | None = None
        # Joins and receive waits block for up to their timeouts: they get their own threads.
        self._threads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="weight-sync")
        # Set at shutdown: a rendezvous still waiting for its peers gives up at once.
        self._closing = threading.Event()

    def group(self, name: str) -> WeightUpdateGroup | None:
        return self._groups.get(name)

    @property
    def receive_state(self) -> str | None:
        """The prepared update's receive state (``/health``'s ``receive``), or ``None`` when none is prepared."""
        update = self._update
        return update.receiver.state.value if update is not None else None

    # -- groups --------------------------------------------------------------------------------

    async def init_group(self, req: InitWeightsUpdateGroupRequest) -> WeightSyncResponse:
        name = req.group_name
        if name in self._groups or name in self._joining:
            return _fail(
                f"Failed to initialize custom process group: group {name!r} already exists; destroy it first.",
                join_attempted=False,
            )
        stage = self.coordinator.stage
        if req.rank_offset + stage.tp_size > req.world_size:
            return _fail(
                f"Failed to initialize custom process group: this worker's {stage.tp_size} rank(s) from rank_offset "
                f"{req.rank_offset} do not fit in world_size {req.world_size}.",
                join_attempted=False,
            )
        device = self.coordinator.worker.device
        backend = req.backend or ("nccl" if device.type == "cuda" else "gloo")
        timeout_s = req.timeout_s or self.group_timeout_s
        join: dict[str, Any] = {
            "master_address": req.master_address,
            "master_port": req.master_port,
            "world_size": req.world_size,
        }
        self._joining.add(name)
        try:
            # Every TP rank joins at rank_offset + tp_rank, all at once (the rendezvous needs them all).
            leader = self.in_thread(
                partial(
                    init_weight_update_group,
                    rank=req.rank_offset,
                    group_name=name,
                    backend=backend,
                    timeout_s=timeout_s,
                    **join,
                )
            )
            followers = stage.followers(
                "init_weights_update_group",
                [
                    partial(
                        tp_transfer.join,
                        name=name,
                        rank=req.rank_offset + r,
                        backend=backend,
                        timeout_s=timeout_s,
                        **join,
                    )
                    for r in range(1, stage.tp_size)
                ],
                timeout_s + HOP_MARGIN_S,
            )
            joined, follower_results = await asyncio.gather(leader, followers, return_exceptions=True)
        finally:
            self._joining.discard(name)
        failures = _join_failures(joined, follower_results)
        if failures:
            if isinstance(joined, WeightUpdateGroup):
                await self.in_thread(joined.destroy)
            await stage.followers("destroy_weights_update_group", partial(tp_transfer.destroy, name=name), ABORT_WAIT_S)
            return _fail(f"Failed to initialize custom process group: {failures}.", join_attempted=True)
        assert isinstance(joined, WeightUpdateGroup)
        group = joined
        self._groups[name] = group
        return WeightSyncResponse(
            success=True, message="Succeeded to initialize custom process group.", join_attempted=True
        )

    async def adopt_group(self, name: str, join: Callable[[threading.Event], WeightUpdateGroup]) -> WeightSyncResponse:
        """A group joined by a rendezvous of its own (vLLM's NCCL engine): ``join(cancel)`` blocks, so
        it runs on a thread, bounded by its own timeout and given up when the worker shuts down
        (``cancel`` is set); at tp_size 1 only (no follower joins with it)."""
        if name in self._groups or name in self._joining:
            return _fail(f"group {name!r} already exists; destroy it first.", join_attempted=False)
        if self.coordinator.stage.tp_size != 1:
            return _fail("this rendezvous is served at tp_size 1 only", join_attempted=False)
        self._joining.add(name)
        try:
            group = await self.in_thread(partial(join, self._closing))
        except GroupError as exc:
            return _fail(f"Failed to initialize the weight-transfer group: {exc}.", join_attempted=True)
        finally:
            self._joining.discard(name)
        if self._closing.is_set():  # joined just as the worker began to shut down: leave at once
            await self.in_thread(group.destroy)
            return _fail("the worker is shutting down", join_attempted=True)
        self._groups[name] = group
        return WeightSyncResponse(success=True, message="Succeeded to initialize the group.", join_attempted=True)

    async def destroy_group(self, req: DestroyWeightsUpdateGroupRequest) -> WeightSyncResponse:
        group = self._groups.pop(req.group_name, None)
        if group is None:
            return _fail("The group to be destroyed does not exist.")
        update = self._update
        if update is not None and update.group is group:
            update.txn.failed.set()
            update.receiver.cancel("the weight-update group was destroyed")
        await self.in_thread(group.destroy)
        await self.coordinator.stage.followers(
            "destroy_weights_update_group", partial(tp_transfer.destroy, name=req.group_name), ABORT_WAIT_S
        )
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
            self._update = update
            # Nobody may hold the worker's weights forever: an update never completed nor aborted
            # ends by itself once its receive window, the receive loop's grace and an apply have passed.
            life = update.wait_s() + APPLY_S
            update.expiry = asyncio.get_running_loop().create_task(
                self._expire(update, life), name="prepared-update-expiry"
            )
            mode = "atomic" if req.atomic else "streaming"
            return PrepareWeightsUpdateResponse(
                status="ready", message=f"Started recv loop for {req.num_buckets} buckets ({mode})"
            )

    async def complete(self, req: CompleteWeightsUpdateRequest) -> CompleteWeightsUpdateResponse:
        async with self.holding("complete_weights_update"):
            update = self._update
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
                result = await self._finish(
                    update, weight_version=version, flush_cache=req.flush_cache, checksum=req.return_checksum
                )
            except UpdateRefused as exc:
                message = f"received weights not applied (previous weights kept): {exc}"
                return self._not_applied(update, outcome.buckets_received, message, "intact")
            except UpdateFailed as exc:
                kept = "previous weights kept" if exc.effect == "intact" else "the weights are partial"
                message = f"applying the received weights failed, {kept}: {exc}"
                return self._not_applied(update, outcome.buckets_received, message, exc.effect)
            response = CompleteWeightsUpdateResponse(
                success=result.success,
                weights=result.data.get("weights", "partial"),
                num_buckets_received=outcome.buckets_received,
                elapsed_s=update.elapsed_s(),
                weight_version=self.coordinator.worker.weight_version,
                message=result.message
                if not result.success
                else f"Applied weights from {outcome.buckets_received} buckets",
            )
            checksum = result.data.get("checksum")
            if isinstance(checksum, str):
                response.checksum = checksum
                response.rank_checksums = [
                    RankChecksum(rank=i, checksum=str(d.get("checksum"))) for i, d in enumerate(result.rank_data)
                ]
            return response

    async def abort(self, req: AbortWeightsUpdateRequest) -> AbortWeightsUpdateResponse:
        """Drop the prepared update of ``req.group_name`` (see the module docstring)."""
        async with self.holding("abort_weights_update", wait_s=ABORT_WAIT_S):
            update = self._update
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
        group_note = _group_note(group)
        if applied:
            return AbortWeightsUpdateResponse(
                success=False,
                weights=effect,
                weights_partial=effect == "partial",
                message=f"Aborted the weight update for group {group.name!r}, but {applied} bucket(s) had already been "
                "applied: the weights are partially updated; the worker stays paused and serves nothing until a "
                f"full update or a reload from disk replaces them.{group_note}",
            )
        partial_now = self.coordinator.worker.weights_partial
        earlier = " The weights were already partially updated by an earlier failed update." if partial_now else ""
        return AbortWeightsUpdateResponse(
            success=True,
            weights="intact",
            weights_partial=partial_now,
            message=f"Dropped the prepared weight update for group {group.name!r} ({outcome.buckets_received} of "
            f"{outcome.buckets_expected} bucket(s) received, none applied); weights and weight_version "
            f"unchanged.{earlier}{group_note}",
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
                result = await self._finish(
                    update, weight_version=req.weight_version, flush_cache=req.flush_cache, checksum=False
                )
            except UpdateRefused as exc:
                return _fail(f"Failed to update parameter online: {exc}", weights="intact")
            except UpdateFailed as exc:
                return _fail(f"Failed to update parameter online: {exc}", weights=exc.effect)
            effect = result.data.get("weights", "partial")
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

    def _detach(self, update: _Update) -> None:
        """The caller now ends ``update`` (complete, abort or expiry)."""
        self._update = None
        if update.expiry is not None and update.expiry is not asyncio.current_task():
            update.expiry.cancel()

    async def _expire(self, update: _Update, life_s: float) -> None:
        await asyncio.sleep(life_s)
        async with self.holding("ending an expired weight update", wait_s=ABORT_WAIT_S):
            if self._update is not update:
                return
            self._detach(update)
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
        self, update: _Update, received: int, message: str, effect: WeightsEffect
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
        within: UpdateTransaction | None = None,
    ) -> _Update:
        """Check everything, begin the pipeline's transaction, start the receive; raise :class:`UpdateRefused`.

        ``within``: a streaming transaction already open (vLLM's update between start and finish) that
        this receive writes into; a refusal then leaves it open and unchanged."""
        current = self._update
        if current is not None:
            if not current.receiver.state.finished:
                raise UpdateRefused("a weight update is already in progress; call /complete_weights_update first")
            log.warning("discarding a weight update that was never completed (%s)", current.receiver.state.value)
            self._detach(current)
            await self.updates.fail(current.txn)
        group = self._groups.get(group_name)
        if group is None:
            raise UpdateRefused(f"Process group {group_name!r} not initialized; call /init_weights_update_group first")
        if not group.alive:
            raise UpdateRefused(f"group {group_name!r} is broken ({group.broken_reason}); destroy and re-initialize it")
        model = self.coordinator.worker.model
        try:
            layouts = validate_buckets(
                buckets, model.checkpoint_spec(), flattened=fmt.requires_aligned, is_ignored=model.is_ignored_weight
            )
        except MetadataError as exc:
            raise UpdateRefused(str(exc)) from None
        window = timeout_s or self.receive_timeout_s
        if within is None:
            txn = await self.updates.begin(SYNC_ACTION, abort_all=abort_all, streaming=not atomic, timeout_s=window)
        else:
            txn = within
            txn.extend(window)
        names = tuple(s.name for layout in layouts for s in layout.slots)
        checksums = announced_checksums(buckets)

        def apply(index: int, named: NamedTensors) -> Future[Any]:
            # Streaming: each bucket's checksum is verified in its apply step, before the write;
            # TP followers write their own copy of the same bucket, received by themselves.
            return self.updates.apply_streamed(
                txn,
                named,
                verify=partial(verify_bucket, checksums[index], named),
                follower_op=partial(tp_transfer.apply_bucket, index=index, wait_s=window + HOP_MARGIN_S),
            )

        receiver = BucketReceiver(
            group,
            layouts,
            fmt=fmt,
            device=self.coordinator.worker.device,
            buffers=self._buffers,
            apply=None if atomic else apply,
        )
        started = await self.coordinator.stage.followers(
            SYNC_ACTION,
            partial(
                tp_transfer.start_receive,
                group_name=group_name,
                layouts=layouts,
                load_format=fmt.load_format,
                atomic=atomic,
                window_s=window,
                checksums=checksums,
            ),
            HOP_MARGIN_S,
        )
        if not all(r.success for r in started):
            await self.cancel_followers("another rank could not start its receive")
            if within is None:
                await self.updates.end_refused(txn)
            raise UpdateRefused("; ".join(f"rank {i + 1}: {r.message}" for i, r in enumerate(started) if not r.success))
        try:
            await self.in_thread(partial(receiver.start, window))
        except GroupError as exc:
            await self.cancel_followers(str(exc))
            if within is None:
                await self.updates.end_refused(txn)
            raise UpdateRefused(str(exc)) from None
        return _Update(
            group=group,
            txn=txn,
            receiver=receiver,
            atomic=atomic,
            weight_version=weight_version,
            names=names,
            checksums=checksums,
        )

    async def _finish(
        self, update: _Update, *, weight_version: str | None, flush_cache: bool, checksum: bool
    ) -> StageResult:
        """After a successful receive: atomic updates write their staged buckets; then commit. Drops the buffers."""
        try:
            if update.atomic:
                buckets = update.receiver.staged()
                if any(update.checksums):  # verified before anything is taken or written
                    try:
                        await self.in_thread(partial(verify_staged, buckets, update.checksums))
                    except ChecksumMismatch as exc:
                        raise UpdateFailed(str(exc), "intact") from None
                staged = [t for _, named in buckets for t in named]
                await self.updates.take(update.txn)
                on_followers = partial(
                    tp_transfer.apply_all, abort_all=update.txn.abort_all, require_complete=False, wait_s=HOP_MARGIN_S
                )
                await self.updates.apply(update.txn, staged, require_complete=False, follower_op=on_followers)
        except (UpdateRefused, UpdateFailed):
            await self.updates.fail(update.txn)
            raise
        finally:
            update.receiver.release()
        return await self.updates.commit(
            update.txn,
            CommitOptions(
                names=update.names,
                weight_version=weight_version,
                flush_cache=flush_cache,
                lift_hold=update.txn.paused_by_update,
                checksum=checksum,
            ),
        )

    async def followers_received(self, update: _Update, outcome: ReceiveOutcome) -> ReceiveOutcome:
        """Streaming, after rank 0's receive succeeded: did every follower rank's succeed too?"""
        results = await self.coordinator.stage.followers(
            SYNC_ACTION, partial(tp_transfer.receive_outcome, wait_s=HOP_MARGIN_S), 2 * HOP_MARGIN_S
        )
        failed = [f"rank {i + 1}: {r.message}" for i, r in enumerate(results) if not r.success]
        if not failed:
            return outcome
        return replace(outcome, state=ReceiveState.FAILED, error=f"the receive failed on follower {'; '.join(failed)}")

    async def cancel_followers(self, reason: str, *, broken_reason: str | None = None) -> None:
        """Best effort: the follower ranks drop their receive too (each ends by its deadline anyway)."""
        await self.coordinator.stage.followers(
            SYNC_ACTION, partial(tp_transfer.cancel_receive, reason=reason, broken_reason=broken_reason), ABORT_WAIT_S
        )

    async def in_thread(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn)

    async def close(self) -> None:
        """Cancel any update and any rendezvous in progress, and leave every group (worker shutdown)."""
        self._closing.set()
        update = self._update
        if update is not None:
            self._detach(update)
            update.txn.failed.set()
            update.receiver.cancel("the worker is shutting down")
            update.txn.end()
        groups, self._groups = list(self._groups.values()), {}
        for group in groups:
            # Bounded (DESTROY_TIMEOUT_S): a leave that hangs is abandoned and logged by ``destroy``.
            if await self.in_thread(group.destroy):
                log.info("shutdown: left weight-update group %r (rank %d/%d)", group.name, group.rank, group.world_size)
        self._threads.shutdown(wait=False, cancel_futures=True)


def _group_note(group: WeightUpdateGroup) -> str:
    """What the caller must do with ``group`` before the next update, if anything."""
    if group.pg is None:
        return f" Group {group.name!r} was destroyed: call /init_weights_update_group before the next update."
    if group.broken_reason is not None:
        return (
            f" Group {group.name!r} is out of step with the trainer ({group.broken_reason}): destroy it and call "
            "/init_weights_update_group again before the next update."
        )
    return ""


def _join_failures(leader: object, followers: object) -> str:
    """Why a group init failed on some rank ('' when every rank joined)."""
    problems = []
    if isinstance(leader, BaseException):
        problems.append(f"rank 0: {leader}")
    if isinstance(followers, BaseException):
        problems.append(f"follower ranks: {followers}")
    elif isinstance(followers, list):
        problems += [f"rank {i + 1}: {r.message}" for i, r in enumerate(followers) if not r.success]
    return "; ".join(problems)


def _fail(message: str, **fields: Any) -> WeightSyncResponse:
    return WeightSyncResponse(success=False, message=message, **fields)
