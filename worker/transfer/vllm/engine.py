"""vLLM's weight-transfer engine on this worker: init, start, update (×N), finish.

The four calls are one transaction of the worker's update pipeline
(:mod:`worker.update_pipeline`), opened by ``/start_weight_update`` and committed by
``/finish_weight_update``:

* **start** takes the worker's writer lock and holds generation (an ``in_place``
  pause, lifted at finish if start set it). Requests frozen by vLLM's ``keep``
  pause may stay: they resume after the update with the KV computed so far, as in
  vLLM. Any other active request refuses the start (pause first).
* **update** receives into the open transaction and writes each bucket as it
  lands (the weights are ``writing``). Over the group: ``packed`` updates arrive in
  vLLM's packed buffers (:func:`router.contract.vllm.packed_chunks`), each one a
  flattened bucket whose bytes are checked against the announced size; unpacked
  ones as one broadcast per tensor, in order. In shared memory: the project's JSON
  handle message, or vLLM's pickled CUDA IPC handles through the restricted
  unpickler (only with ``--allow-pickled-tensors``). The answer comes after the
  last byte is written on the device, so the producer may reuse its buffers then.
  Metadata that does not fit the model is refused (400) with the update left open
  and unchanged; a receive that fails ends the update: weights ``partial`` if
  anything was written, and the worker stays held until a full update or a reload.
* **finish** commits: ``weight_version``, cache flush (unless requests frozen by
  ``keep`` still hold KV), and the hold lifted.

Calls out of order answer 409 and change nothing. An update nobody finishes ends
by itself once its window has passed (``timeout_s`` of the start, else the
receive default), failing as a receive would. Each call runs inside the
controller's call lock (:meth:`~worker.transfer.group.controller.WeightSyncController.holding`);
a start or an update with a ``timeout_s`` waits for it no longer than that.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from router.contract.budget import APPLY_S
from router.contract.vllm import (
    VLLM_GROUP_NAME,
    FinishWeightUpdateRequest,
    InitWeightTransferEngineRequest,
    StartWeightUpdateRequest,
    TransferParams,
    UpdateWeightsRequest,
    VllmResult,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
    packed_chunks,
)
from router.contract.weight_sync import DestroyWeightsUpdateGroupRequest, InitWeightsUpdateGroupRequest, TensorListMeta
from router.dataplane.buckets import NamedTensors
from router.dataplane.formats import for_load_format
from router.dataplane.group import WeightUpdateGroup
from worker.engine.results import effect_of
from worker.engine.weight_ops import CommitOptions
from worker.ranks import AdminBusy
from worker.tp import transfer as tp_transfer
from worker.transfer.group.controller import WeightSyncController
from worker.transfer.group.held import Held
from worker.transfer.group.receive_session import RECEIVE_GRACE_S
from worker.transfer.handles import vllm_update_info
from worker.update_pipeline import UpdateRefused, UpdateTransaction

log = logging.getLogger(__name__)

ACTION = "vllm_weight_update"
#: Unpacked updates are one broadcast per tensor; the receiver takes them in buckets of at most this many bytes.
UNPACKED_BUCKET_BYTES = 256 * 1024 * 1024

Answer = tuple[int, VllmResult]


@dataclass(eq=False)
class _OpenUpdate:
    txn: UpdateTransaction
    window_s: float
    names: list[str] = field(default_factory=list)
    calls: int = 0


class VllmWeightTransfer:
    """The vLLM routes' state: the engine's group and the update open between start and finish."""

    def __init__(self, controller: WeightSyncController, *, allow_pickled: bool, backend: str = "torch"):
        self.sync = controller
        self.updates = controller.updates
        self.allow_pickled = allow_pickled
        #: ``torch``: a torch.distributed group; ``nccl``: vLLM's own NCCL engine rendezvous (CUDA).
        self.backend = backend
        self.group_name = VLLM_GROUP_NAME
        #: The wire params the group's init fixed (vLLM 0.28+), used by every update that does not
        #: say otherwise; ``None`` when the init sent none.
        self.transfer_params: TransferParams | None = None
        self._held: Held[_OpenUpdate] = Held("vllm-update-expiry")

    @property
    def update_open(self) -> bool:
        return self._held.current is not None

    # -- init ------------------------------------------------------------------------------------

    async def init_engine(self, req: InitWeightTransferEngineRequest) -> Answer:
        """Join the trainer's group as ``/init_weights_update_group`` does; a group of the same name
        is left first (vLLM has no destroy route: a restarted trainer simply initializes again)."""
        info = req.init_info
        if self._held.current is not None:
            return _conflict("a weight update is open: call /finish_weight_update before initializing again")
        if info.nccl_unique_id_b64 is not None and self.backend != "nccl":
            return 400, VllmResult(
                success=False,
                message="nccl_unique_id_b64 is a rendezvous of vLLM's NCCL engine: start the worker with "
                '--weight-transfer-config \'{"backend": "nccl"}\' on CUDA, or send master_address and master_port',
                weights="intact",
            )
        if self.sync.group(info.group_name) is not None:
            await self.sync.destroy_group(DestroyWeightsUpdateGroupRequest(group_name=info.group_name))
        if self.backend == "nccl":
            joined = await self.sync.adopt_group(info.group_name, partial(self._join_vllm_nccl, info))
        else:
            joined = await self.sync.init_group(
                InitWeightsUpdateGroupRequest.model_validate({**info.group_fields(), "group_name": info.group_name})
            )
        if not joined.success:
            return 400, VllmResult(
                success=False, message=joined.message, weights="intact", join_attempted=joined.join_attempted
            )
        self.group_name = info.group_name
        self.transfer_params = info.transfer_params()
        return 200, VllmResult(message="Weight transfer initialized", weights="intact", join_attempted=True)

    def _join_vllm_nccl(self, info: WeightTransferInitInfo, cancel: threading.Event) -> WeightUpdateGroup:
        """vLLM's NCCL engine rendezvous (its trainer hosts the store, or shares the NCCL id), as rank
        ``rank_offset``. Runs on a thread; bounded by the init's timeout, given up once ``cancel`` is set."""
        from worker.transfer.vllm.nccl import join_vllm_nccl_group

        return join_vllm_nccl_group(
            master_address=info.master_address,
            master_port=info.master_port,
            nccl_unique_id_b64=info.nccl_unique_id_b64,
            rank=info.rank_offset,
            world_size=info.world_size,
            device=self.sync.coordinator.worker.device,
            timeout_s=info.timeout_s or self.sync.group_timeout_s,
            group_name=info.group_name,
            cancel=cancel,
        )

    # -- start / update / finish -----------------------------------------------------------------

    async def start(self, req: StartWeightUpdateRequest) -> Answer:
        async with self.sync.holding("start_weight_update", timeout_s=req.timeout_s):
            if self._held.current is not None:
                return _conflict("a weight update is already started: call /finish_weight_update first")
            window = req.timeout_s or self.sync.receive_timeout_s
            try:
                txn = await self.updates.begin(
                    ACTION, abort_all=False, streaming=True, timeout_s=window, allow_frozen=True
                )
            except UpdateRefused as exc:
                return 400, VllmResult(success=False, message=f"Weight update not started: {exc}", weights="intact")
            opened = _OpenUpdate(txn, window)
            self._held.hold(opened, expires_at=lambda: opened.txn.deadline + RECEIVE_GRACE_S, end=self._expire)
            return 200, VllmResult(message="Weight update started", weights="intact")

    async def update(self, req: UpdateWeightsRequest) -> Answer:
        info = req.update_info
        async with self.sync.holding("update_weights", timeout_s=info.timeout_s):
            opened = self._held.current
            if opened is None:
                return _conflict("no weight update is started: call /start_weight_update before /update_weights")
            if info.uses_shared_memory:
                return await self._update_from_handles(opened, info)
            return await self._update_from_group(opened, info)

    async def finish(self, req: FinishWeightUpdateRequest) -> Answer:
        async with self.sync.holding("finish_weight_update"):
            opened = self._held.current
            if opened is None:
                return _conflict("no weight update is started: call /start_weight_update first")
            self._end(opened)
            scheduler = self.sync.coordinator.scheduler
            result = await self.updates.commit(
                opened.txn,
                CommitOptions(
                    names=tuple(opened.names),
                    weight_version=req.weight_version,
                    # Requests frozen by a ``keep`` pause go on with their KV; flushing it would fail.
                    flush_cache=req.flush_cache and scheduler.active_request_count == 0,
                    lift_hold=opened.txn.paused_by_update,
                ),
            )
            effect = effect_of(result.data)
            if not result.success:
                return 400, VllmResult(success=False, message=result.message, weights=effect)
            return 200, VllmResult(
                message="Weight update finished",
                weights=effect,
                weight_version=self.sync.coordinator.worker.weight_version,
                num_updates=opened.calls,
            )

    # -- the two sources -------------------------------------------------------------------------

    async def _update_from_group(self, opened: _OpenUpdate, info: WeightTransferUpdateInfo) -> Answer:
        group = self.sync.group(self.group_name)
        if group is None or not group.alive:
            why = "is not initialized" if group is None else f"is out of step with the trainer ({group.broken_reason})"
            return _refused(f"group {self.group_name!r} {why}: call /init_weight_transfer_engine first")
        try:
            params = info.transfer_params(self.transfer_params)
            buckets = _buckets(info, params)
            # This receive writes into the update opened by /start_weight_update: a refusal leaves it open.
            plan = self.sync.receives.plan(buckets, for_load_format("flattened_bucket" if params.packed else None))
            window = info.timeout_s or opened.window_s
            opened.txn.extend(window)
            receive = await self.sync.receives.start(
                opened.txn, group, plan, atomic=False, window_s=window, weight_version=None
            )
        except (UpdateRefused, ValueError) as exc:
            return _refused(str(exc))
        outcome = await self.sync.in_thread(partial(receive.receiver.wait, receive.wait_s()))
        if outcome.ok:
            outcome = await self.sync.receives.followers_received(receive, outcome)
        receive.receiver.release()
        if not outcome.ok:
            await self.sync.receives.cancel_followers(outcome.error or "the receive failed")
            if params.packed:
                # Buffers of another size than announced also come in another number: the trainer
                # and this worker no longer pair their broadcasts.
                group.mark_broken(f"a packed update failed ({outcome.error})")
            return await self._fail(opened, f"the receive failed: {outcome.error}")
        return self._written(opened, receive.names, f"{outcome.buckets_received} buffer(s)")

    async def _update_from_handles(self, opened: _OpenUpdate, info: WeightTransferUpdateInfo) -> Answer:
        coord = self.sync.coordinator
        model = coord.worker.model
        try:
            stage: Callable[[], NamedTensors] = vllm_update_info.prepare(
                info,
                model.checkpoint_spec(),
                model.is_ignored_weight,
                coord.worker.device,
                allow_pickled=self.allow_pickled,
            )
        except ValueError as exc:
            return _refused(str(exc))
        opened.txn.extend(info.timeout_s or opened.window_s)
        try:
            named = await self.sync.in_thread(stage)
            # Rank 0 maps the memory; tensor-parallel followers get the full tensors through their pipes.
            applied = self.updates.apply_streamed(
                opened.txn, named, follower_op=partial(tp_transfer.apply_given, named=named)
            )
            await asyncio.wait_for(asyncio.wrap_future(applied), opened.txn.step_s())
        except Exception as exc:  # opening or writing failed: what was written is a mix
            return await self._fail(opened, f"loading the shared tensors failed: {type(exc).__name__}: {exc}")
        return self._written(opened, [name for name, _ in named], "shared memory")

    # -- shared steps ----------------------------------------------------------------------------

    def _written(self, opened: _OpenUpdate, names: list[str] | tuple[str, ...], source: str) -> Answer:
        opened.names.extend(names)
        opened.calls += 1
        return 200, VllmResult(message="Weights updated", weights="updated", num_tensors=len(names), source=source)

    async def _fail(self, opened: _OpenUpdate, message: str) -> Answer:
        """End the open update after a failed transfer: what it wrote leaves the weights partial."""
        self._end(opened)
        effect = await self.updates.fail(opened.txn)
        note = (
            " The weights are partially updated: the worker serves nothing until a full update or a reload."
            if effect == "partial"
            else ""
        )
        return 400, VllmResult(success=False, message=f"Weight update failed, {message}.{note}", weights=effect)

    def _end(self, opened: _OpenUpdate) -> None:
        self._held.detach(opened)

    async def _expire(self, opened: _OpenUpdate) -> bool:
        """End an update nobody finished once its window has passed (each call extends it); a call
        still running holds the lock, so the update ends after it at the earliest (``False``: try later)."""
        try:
            async with self.sync.holding("ending an unfinished weight update", wait_s=APPLY_S):
                if self._held.current is not opened:
                    return True
                if time.monotonic() < opened.txn.deadline:
                    return False
                log.warning("vLLM weight update neither finished nor failed within its window; ending it")
                self._end(opened)
                await self.updates.fail(opened.txn)
                return True
        except AdminBusy:
            return False

    async def close(self) -> None:
        opened = self._held.current
        if opened is not None:
            self._end(opened)
            opened.txn.failed.set()
            opened.txn.end()


def _buckets(info: WeightTransferUpdateInfo, params: TransferParams) -> list[TensorListMeta]:
    """The receive's buckets: vLLM's packed buffers, or runs of per-tensor broadcasts."""
    sizes = [info.nbytes(i) for i in range(len(info.names))]
    if params.packed:
        ranges = packed_chunks(sizes, params.buffer_size_bytes)
    else:
        ranges, start, total = [], 0, 0
        for i, size in enumerate(sizes):
            if total and total + size > UNPACKED_BUCKET_BYTES:
                ranges.append(range(start, i))
                start, total = i, 0
            total += size
        ranges.append(range(start, len(sizes)))
    return [
        TensorListMeta.model_validate(
            {
                "names": [info.names[i] for i in r],
                "dtypes": [info.dtype_names[i] for i in r],
                "shapes": [info.shapes[i] for i in r],
            }
        )
        for r in ranges
    ]


def _conflict(message: str) -> Answer:
    return 409, VllmResult(success=False, message=message, weights="intact")


def _refused(message: str) -> Answer:
    return 400, VllmResult(success=False, message=f"Weights not updated: {message}", weights="intact")
