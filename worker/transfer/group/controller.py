"""The worker's weight-sync controller: groups, one call at a time, and the start of every receive.

It owns what the protocol adapters share:

* the weight-update groups (:mod:`worker.transfer.group.table`): init, adopt, destroy;
* the call lock (:meth:`WeightSyncController.holding`): one weight-sync call at a time on this
  worker. It is the first lock in the worker's lock order, stated once in :mod:`worker.coordinator`
  with the rule that a call's own ``timeout_s`` caps its wait for it;
* the start of every SGLang receive (:meth:`WeightSyncController.start_receive`), and the threads
  that joins and receive waits run on;
* shutdown (:meth:`WeightSyncController.close`).

The protocols are adapters over it: SGLang's two-phase prepare/complete/abort and the prepared
update's expiry (:mod:`worker.transfer.group.two_phase`, :attr:`WeightSyncController.two_phase`), SGLang's
single-phase call (:mod:`worker.transfer.group.single_phase`, :attr:`WeightSyncController.single_phase`),
and vLLM's start/update/finish (:mod:`worker.transfer.vllm.engine`). One receive on every rank is
:mod:`worker.transfer.group.receive_session`.

Every update is a transaction of the worker's one update pipeline (:mod:`worker.update_pipeline`), so the
rules below are the pipeline's, stated for the distributed sources:

* **Never block the event loop.** Joining a group and waiting for a receive run
  on this controller's threads; model steps run on the scheduler thread.
* **Refuse before receiving.** Metadata is checked against the model
  (:mod:`worker.transfer.validation`) and the pipeline checks the worker
  (weights not released; generation paused, or nothing active, or
  ``abort_all_requests``) before a receive is posted. A refused prepare starts
  nothing, so the trainer never broadcasts into the void.
* **At most one update in flight.** A receive starts only once the prepared
  two-phase update is out of the way (:meth:`~worker.transfer.group.two_phase.TwoPhase.make_room`);
  the pipeline's writer lock holds off every other update.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from router.contract.budget import DEFAULT_GROUP_TIMEOUT_S, DEFAULT_RECEIVE_TIMEOUT_S, HOP_MARGIN_S
from router.contract.weight_sync import (
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    WeightSyncResponse,
)
from router.dataplane.group import WeightUpdateGroup
from worker.ranks import held
from worker.transfer.group.bracket import UpdateBracket
from worker.transfer.group.receive_session import SYNC_ACTION, ReceiveRequest, Receives, ReceiveSession
from worker.transfer.group.single_phase import SinglePhase
from worker.transfer.group.table import GroupTable
from worker.transfer.group.two_phase import TwoPhase
from worker.update_pipeline import UpdateRefused

if TYPE_CHECKING:
    from worker.coordinator import Coordinator
    from worker.engine.model_worker import ModelWorker

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How long a weight-sync call waits for one still running (a complete waiting for its receive),
#: unless its own ``timeout_s`` is shorter.
SYNC_LOCK_WAIT_S = HOP_MARGIN_S


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
        self.two_phase = TwoPhase(self)
        """``/prepare_weights_update``, ``/complete_weights_update``, ``/abort_weights_update``."""
        self.single_phase = SinglePhase(self)
        """``/update_weights_from_distributed``."""

    @property
    def worker(self) -> ModelWorker:
        """Rank 0's model worker (weights, version, state)."""
        return self.coordinator.worker

    def group(self, name: str) -> WeightUpdateGroup | None:
        return self.groups.get(name)

    @property
    def receive_state(self) -> str | None:
        """The prepared update's receive state (``/health``'s ``receive``), or ``None`` when none is prepared."""
        update = self.two_phase.prepared
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
            return WeightSyncResponse(success=False, message="The group to be destroyed does not exist.")
        self.two_phase.cancel_on(group, "the weight-update group was destroyed")
        await self.groups.leave(group)
        return WeightSyncResponse(success=True, message="Succeeded to destroy custom process group.")

    # -- shared steps --------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def holding(
        self, action: str, *, timeout_s: float | None = None, wait_s: float = SYNC_LOCK_WAIT_S
    ) -> AsyncIterator[None]:
        """This controller's lock for one call. The wait for it is ``wait_s``, capped by the call's own
        ``timeout_s`` when it has one (the lock-order rule of :mod:`worker.coordinator`); past it the
        caller gets 503 naming the call that holds the lock (a complete waits for its receive, so it
        may hold it long) and the wait that was used."""
        if timeout_s is not None:
            wait_s = min(wait_s, timeout_s)
        holder = self._lock_holder or "another weight-sync call"
        busy = f"{action}: {holder} is still running on this worker (waited {wait_s:g}s)"
        async with held(self._lock, wait_s, busy):
            self._lock_holder = action
            try:
                yield
            finally:
                self._lock_holder = None

    async def start_receive(self, ask: ReceiveRequest) -> ReceiveSession:
        """Check everything, begin the pipeline's transaction, start the receive; raise :class:`UpdateRefused`
        (nothing posted, the transaction undone)."""
        await self.two_phase.make_room()
        name = ask.group_name
        group = self.groups.get(name)
        if group is None:
            raise UpdateRefused(f"Process group {name!r} not initialized; call /init_weights_update_group first")
        if not group.alive:
            raise UpdateRefused(f"group {name!r} is broken ({group.broken_reason}); destroy and re-initialize it")
        plan = self.receives.plan(ask.buckets, ask.fmt)
        window = ask.timeout_s or self.receive_timeout_s
        txn = await self.updates.begin(SYNC_ACTION, abort_all=ask.abort_all, streaming=not ask.atomic, timeout_s=window)
        try:
            return await self.receives.start(
                txn, group, plan, atomic=ask.atomic, window_s=window, weight_version=ask.weight_version
            )
        except UpdateRefused:
            await self.updates.end_refused(txn)
            raise

    async def in_thread(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn)

    async def close(self) -> None:
        """Cancel any update and any rendezvous in progress, and leave every group (worker shutdown)."""
        self._closing.set()
        self.two_phase.close()
        await self.groups.close()
        self._threads.shutdown(wait=False, cancel_futures=True)
