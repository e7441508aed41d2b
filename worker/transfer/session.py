"""The worker's weight-sync controller: groups, and at most one update in flight.

The HTTP handlers call one method each; all policy lives here:

* **Never block the event loop.** Joining a group and waiting for a receive run
  on this controller's threads; bucket applies run on the scheduler thread
  (between forward steps) through ``scheduler.submit_admin``.
* **Refuse before receiving.** Metadata is checked against the model
  (:mod:`worker.transfer.validation`), and the lifecycle rules (weights not
  released; generation paused, or nothing active, or ``abort_all_requests``)
  are checked on the scheduler thread, before a receive is posted. A refused
  prepare starts nothing, so the trainer never broadcasts into the void.
* **Streaming** (default): buckets are applied as they arrive, double-buffered.
  Generation is held (an ``in_place`` pause, lifted at a successful complete if
  this update set it) and ``weights_partial`` is raised from the first applied
  bucket until complete succeeds. On failure the worker stays paused and
  partial until the whole model has been rewritten by later updates or
  reloaded from disk.
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
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Optional

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
    UpdateWeightsFromDistributedRequest,
    WeightSyncResponse,
)
from worker.stage import held
from worker.transfer.applier import FinishResult, ModelApplier
from worker.transfer.bracket import UpdateBracket
from router.dataplane.buckets import NamedTensors
from router.contract.budget import DEFAULT_GROUP_TIMEOUT_S, DEFAULT_RECEIVE_TIMEOUT_S
from router.dataplane.group import GroupError, WeightUpdateGroup, init_weight_update_group
from worker.transfer.receiver import BucketReceiver, ReceiveBuffers
from worker.transfer.validation import MetadataError, validate_buckets

if TYPE_CHECKING:
    from worker.coordinator import Coordinator

log = logging.getLogger(__name__)

#: Scheduler-thread steps (checks, a bucket's copy) are short; this only guards a stuck thread.
SCHEDULER_STEP_TIMEOUT_S = 120.0
#: How long an abort waits for another weight-sync call on this worker before answering 503.
ABORT_WAIT_S = 10.0
#: Past the receive deadline, the time the receive loop gets to notice it and report.
RECEIVE_GRACE_S = 5.0
#: The admin-lock action of every weight-sync step that touches the model.
SYNC_ACTION = "update_weights_from_distributed"
ABORTED = "a prepared receive was aborted"
PARTIAL_NOTE = " The full weights of the ModelRunner are partially updated. Please discard the whole weights."


@dataclass(eq=False)
class _Update:
    """One prepared two-phase update (or a running single-phase one)."""

    group: WeightUpdateGroup
    receiver: BucketReceiver
    atomic: bool
    weight_version: Optional[str]
    abort_all_requests: bool
    deadline: float
    names: list[str]
    started: float = field(default_factory=time.monotonic)
    #: Set once the update failed: queued bucket applies are skipped.
    failed: threading.Event = field(default_factory=threading.Event)
    paused_by_update: bool = False
    partial_before: bool = False

    def wait_s(self) -> float:
        """How long to wait for the receive: to its deadline, plus a grace for the loop to report."""
        return max(self.deadline - time.monotonic(), 0.0) + RECEIVE_GRACE_S


class WeightSyncController:
    """Per-worker weight-sync state behind the six weight-sync routes."""

    def __init__(self, coordinator: "Coordinator", *, group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
                 receive_timeout_s: float = DEFAULT_RECEIVE_TIMEOUT_S):
        self.coordinator = coordinator
        self.group_timeout_s = group_timeout_s
        self.receive_timeout_s = receive_timeout_s
        self.applier = ModelApplier(coordinator.scheduler)
        self.bracket = UpdateBracket()
        self._groups: dict[str, WeightUpdateGroup] = {}
        self._joining: set[str] = set()
        self._update: Optional[_Update] = None
        self._buffers = ReceiveBuffers()
        self._lock = asyncio.Lock()
        # Joins and receive waits block for up to their timeouts: they get their own threads.
        self._threads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="weight-sync")

    # -- groups --------------------------------------------------------------------------------

    async def init_group(self, req: InitWeightsUpdateGroupRequest) -> WeightSyncResponse:
        name = req.group_name
        if name in self._groups or name in self._joining:
            return _fail(f"Failed to initialize custom process group: group {name!r} already exists; destroy it first.")
        if self.coordinator.stage.tp_size != 1:
            return _fail("Failed to initialize custom process group: weight sync supports tp_size 1 only.")
        device = self.coordinator.worker.device
        backend = req.backend or ("nccl" if device.type == "cuda" else "gloo")
        self._joining.add(name)
        try:
            group = await self._in_thread(
                partial(
                    init_weight_update_group,
                    master_address=req.master_address,
                    master_port=req.master_port,
                    rank=req.rank_offset,  # + tp_rank, which is 0
                    world_size=req.world_size,
                    group_name=name,
                    backend=backend,
                    timeout_s=req.timeout_s or self.group_timeout_s,
                )
            )
        except GroupError as exc:
            return _fail(f"Failed to initialize custom process group: {exc}.")
        finally:
            self._joining.discard(name)
        self._groups[name] = group
        return WeightSyncResponse(success=True, message="Succeeded to initialize custom process group.")

    async def destroy_group(self, req: DestroyWeightsUpdateGroupRequest) -> WeightSyncResponse:
        group = self._groups.pop(req.group_name, None)
        if group is None:
            return _fail("The group to be destroyed does not exist.")
        update = self._update
        if update is not None and update.group is group:
            update.failed.set()
            update.receiver.cancel("the weight-update group was destroyed")
        await self._in_thread(group.destroy)
        return WeightSyncResponse(success=True, message="Succeeded to destroy custom process group.")

    # -- two phase -----------------------------------------------------------------------------

    async def prepare(self, req: PrepareWeightsUpdateRequest) -> PrepareWeightsUpdateResponse:
        async with self._lock:
            try:
                update = await self._start(req.buckets, req.group_name, flattened=req.load_format == "flattened_bucket",
                                           atomic=req.atomic, abort_all=req.abort_all_requests,
                                           weight_version=req.weight_version, timeout_s=req.timeout_s)
            except _Refused as exc:
                return PrepareWeightsUpdateResponse(status="error", message=str(exc))
            self._update = update
            mode = "atomic" if req.atomic else "streaming"
            return PrepareWeightsUpdateResponse(
                status="ready", message=f"Started recv loop for {req.num_buckets} buckets ({mode})"
            )

    async def complete(self, req: CompleteWeightsUpdateRequest) -> CompleteWeightsUpdateResponse:
        async with self._lock:
            update = self._update
            if update is None or update.group.name != req.group_name:
                return CompleteWeightsUpdateResponse(
                    success=False, message=f"no weight update was prepared for group {req.group_name!r}"
                )
            self._update = None
            version = req.weight_version if req.weight_version is not None else update.weight_version
            wait_s = req.timeout_s if req.timeout_s is not None else update.wait_s()
            outcome = await self._in_thread(partial(update.receiver.wait, wait_s))
            if not outcome.ok:
                update.failed.set()
                partial_now = await self._on_scheduler(lambda: self.applier.after_failure(update.atomic))
                note = PARTIAL_NOTE if partial_now else ""
                return CompleteWeightsUpdateResponse(
                    success=False, num_buckets_received=outcome.buckets_received, message=f"{outcome.error}.{note}",
                    weights_partial=partial_now, elapsed_s=time.monotonic() - update.started,
                )
            result = await self._finish(update, weight_version=version, flush_cache=req.flush_cache,
                                        checksum=req.return_checksum)
            response = CompleteWeightsUpdateResponse(
                success=result.success, num_buckets_received=outcome.buckets_received,
                elapsed_s=time.monotonic() - update.started, weight_version=self.coordinator.worker.weight_version,
                message=result.message if not result.success else f"Applied weights from {outcome.buckets_received} buckets",
            )
            if result.checksum is not None:
                response.checksum = result.checksum
                response.rank_checksums = [RankChecksum(rank=0, checksum=result.checksum)]
            return response

    async def abort(self, req: AbortWeightsUpdateRequest) -> AbortWeightsUpdateResponse:
        """Drop the prepared update of ``req.group_name`` (see the module docstring)."""
        busy = ("abort_weights_update: another weight-sync call (a complete or a single-phase update) "
                "is still running on this worker")
        async with held(self._lock, ABORT_WAIT_S, busy):
            update = self._update
            if update is None or update.group.name != req.group_name:
                other = f" (the prepared one is for group {update.group.name!r})" if update is not None else ""
                return AbortWeightsUpdateResponse(
                    success=False, weights_partial=bool(self.coordinator.worker.weights_partial),
                    message=f"no prepared weight update for group {req.group_name!r} to abort{other}",
                )
            self._update = None
            update.failed.set()  # bucket applies not yet run are refused from here on
            update.receiver.cancel(ABORTED, broken_reason=ABORTED)
            update.receiver.release()
            outcome = update.receiver.outcome()
            applied, partial_now = await self._on_scheduler_exclusive(
                partial(self.applier.after_abort, resume=update.paused_by_update)
            )
        group = update.group
        group_note = _group_note(group)
        if applied:
            return AbortWeightsUpdateResponse(
                success=False, weights_partial=partial_now,
                message=f"Aborted the weight update for group {group.name!r}, but {applied} bucket(s) had already been "
                        "applied: the weights are partially updated; the worker stays paused and serves nothing until a "
                        f"full update or a reload from disk replaces them.{group_note}",
            )
        earlier = " The weights were already partially updated by an earlier failed update." if partial_now else ""
        return AbortWeightsUpdateResponse(
            success=True, weights_partial=partial_now,
            message=f"Dropped the prepared weight update for group {group.name!r} ({outcome.buckets_received} of "
                    f"{outcome.buckets_expected} bucket(s) received, none applied); weights and weight_version "
                    f"unchanged.{earlier}{group_note}",
        )

    # -- single phase --------------------------------------------------------------------------

    async def update_from_distributed(self, req: UpdateWeightsFromDistributedRequest) -> WeightSyncResponse:
        """SGLang's call: receive one bucket while the request is open, then apply it
        in one scheduler step (with rollback) and flush as requested."""
        async with self._lock:
            try:
                update = await self._start([req], req.group_name, flattened=req.load_format == "flattened_bucket",
                                           atomic=True, abort_all=req.abort_all_requests,
                                           weight_version=req.weight_version, timeout_s=req.timeout_s)
            except _Refused as exc:
                return _fail(f"Failed to update parameter online: {exc}.")
            outcome = await self._in_thread(partial(update.receiver.wait, update.wait_s()))
            if not outcome.ok:
                await self._on_scheduler(self.applier.mark_partial)
                return _fail(f"Failed to update parameter online: {outcome.error}.{PARTIAL_NOTE}")
            result = await self._finish(update, weight_version=req.weight_version, flush_cache=req.flush_cache,
                                        checksum=False)
            if not result.success:
                return _fail(f"Failed to update parameter online: {result.message}")
            message = "Succeeded to update parameter online."
            if req.weight_version is not None:
                message += f" Weight version updated to {req.weight_version}."
            return WeightSyncResponse(success=True, message=message)

    # -- shared steps --------------------------------------------------------------------------

    async def _start(self, buckets: list[Any], group_name: str, *, flattened: bool, atomic: bool, abort_all: bool,
                     weight_version: Optional[str], timeout_s: Optional[float]) -> _Update:
        """Check everything, prepare the scheduler, start the receive; raise :class:`_Refused`."""
        current = self._update
        if current is not None:
            if not current.receiver.state.finished:
                raise _Refused("a weight update is already in progress; call /complete_weights_update first")
            log.warning("discarding a weight update that was never completed (%s)", current.receiver.state.value)
            self._update = None
        group = self._groups.get(group_name)
        if group is None:
            raise _Refused(f"Process group {group_name!r} not initialized; call /init_weights_update_group first")
        if not group.alive:
            raise _Refused(f"group {group_name!r} is broken ({group.broken_reason}); destroy and re-initialize it")
        model = self.coordinator.worker.model
        try:
            layouts = validate_buckets(buckets, model.checkpoint_spec(), flattened=flattened,
                                       is_ignored=model.is_ignored_weight)
        except MetadataError as exc:
            raise _Refused(str(exc)) from None
        timeout = timeout_s or self.receive_timeout_s
        admitted = await self._on_scheduler_exclusive(partial(self.applier.admit, abort_all=abort_all, hold=not atomic))
        if admitted.error is not None:
            raise _Refused(admitted.error)
        update = _Update(group=group, receiver=None, atomic=atomic, weight_version=weight_version,  # type: ignore[arg-type]
                         abort_all_requests=abort_all, deadline=time.monotonic() + timeout,
                         names=[s.name for layout in layouts for s in layout.slots],
                         paused_by_update=admitted.paused_by_update, partial_before=admitted.partial_before)
        update.receiver = BucketReceiver(
            group, layouts, load_format="flattened_bucket" if flattened else "per_tensor",
            apply=None if atomic else partial(self._submit_apply, update), device=self.coordinator.worker.device,
            buffers=self._buffers,
        )
        try:
            await self._in_thread(partial(update.receiver.start, timeout))
        except GroupError as exc:
            if admitted.paused_by_update:
                await self._on_scheduler(self.applier.release_hold)
            raise _Refused(str(exc)) from None
        return update

    def _submit_apply(self, update: _Update, index: int, named: NamedTensors) -> "Future[object]":
        """Receive thread → scheduler thread: apply one streamed bucket between steps."""
        return self.coordinator.scheduler.submit_admin(lambda: self.applier.apply_bucket(named, update.failed))

    async def _finish(self, update: _Update, *, weight_version: Optional[str], flush_cache: bool,
                      checksum: bool) -> FinishResult:
        """After a successful receive: finish ``update`` on the scheduler thread (atomic:
        apply its staged buckets), then drop its buffers."""
        staged: NamedTensors = [t for _, named in update.receiver.staged() for t in named] if update.atomic else []
        try:
            return await self._on_scheduler_exclusive(partial(
                self.applier.finish, names=update.names, staged=staged, atomic=update.atomic,
                abort_all=update.abort_all_requests, weight_version=weight_version, flush_cache=flush_cache,
                resume=update.paused_by_update, partial_before=update.partial_before, checksum=checksum,
            ))
        finally:
            update.receiver.release()

    async def _on_scheduler(self, fn: Any) -> Any:
        return await self.coordinator.run_on_scheduler(fn, SCHEDULER_STEP_TIMEOUT_S, action="weight_sync")

    async def _on_scheduler_exclusive(self, fn: Any) -> Any:
        """``fn`` on the scheduler thread inside the coordinator's admin section, so it
        cannot interleave with a disk update, a pause or a memory release."""
        async with self.coordinator.admin_section(SYNC_ACTION, SCHEDULER_STEP_TIMEOUT_S):
            return await self._on_scheduler(fn)

    async def _in_thread(self, fn: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn)

    async def close(self) -> None:
        """Cancel any update and leave every group (worker shutdown)."""
        if self._update is not None:
            self._update.failed.set()
            self._update.receiver.cancel("the worker is shutting down")
            self._update = None
        groups, self._groups = list(self._groups.values()), {}
        for group in groups:
            await self._in_thread(group.destroy)
        self._threads.shutdown(wait=False, cancel_futures=True)


class _Refused(Exception):
    """An update refused before any receive was posted."""


def _group_note(group: WeightUpdateGroup) -> str:
    """What the caller must do with ``group`` before the next update, if anything."""
    if group.pg is None:
        return f" Group {group.name!r} was destroyed: call /init_weights_update_group before the next update."
    if group.broken_reason is not None:
        return (f" Group {group.name!r} is out of step with the trainer ({group.broken_reason}): destroy it and call "
                "/init_weights_update_group again before the next update.")
    return ""


def _fail(message: str) -> WeightSyncResponse:
    return WeightSyncResponse(success=False, message=message)
