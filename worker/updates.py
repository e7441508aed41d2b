"""The one weight-update pipeline every source of weights goes through.

A disk reload, SGLang's single-phase distributed update and both modes of the
two-phase protocol are all one :class:`UpdateTransaction`::

    begin    check every rank (refusal: nothing changed); streaming updates also
             take the worker at once (abort requests if asked, hold generation)
    stage    the source's own work, weights untouched: read a checkpoint, receive
             buckets (a streaming update applies each bucket as it lands instead)
    take     abort requests if asked and wait until their callers have their
             answers, with the previous weight_version (atomic updates)
    apply    write everything in one scheduler step, rolling back on failure
    commit   weight state, weight_version, flush, pause, checksum
    fail     what failed leaves the weights intact, or partial (never served)

One transaction runs at a time: :meth:`UpdatePipeline.begin` takes the worker's
writer lock (a caller waiting longer than its bound gets 503 naming the holder),
and :meth:`UpdateTransaction.end` (called by commit, fail and cancel) is the one
place it is released. The weights' own states are those of
:mod:`worker.engine.weight_state`; the steps that touch the model run on the
scheduler threads (:mod:`worker.engine.weight_ops`), inside the coordinator's
admin section so that they never interleave with a pause or a memory release.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from router.contract.budget import APPLY_S, CLEANUP_S
from router.contract.budget import HOP_MARGIN_S as WRITER_WAIT_S
from router.dataplane.buckets import NamedTensors
from worker.engine import weight_ops
from worker.engine.weight_ops import CommitOptions
from worker.engine.weight_state import WeightsEffect
from worker.stage import AdminBusy, StageResult

if TYPE_CHECKING:
    from worker.coordinator import Coordinator


class UpdateRefused(Exception):
    """The update was refused before anything was written; the message is for the caller."""


class UpdateFailed(Exception):
    """Writing the weights failed; ``effect`` says whether they are intact or partial."""

    def __init__(self, message: str, effect: WeightsEffect):
        super().__init__(message)
        self.effect = effect


@dataclass(eq=False)
class UpdateTransaction:
    """One weight update, from :meth:`UpdatePipeline.begin` to its end."""

    action: str
    abort_all: bool
    streaming: bool
    deadline: float
    """``time.monotonic()`` by which the update's own work (read, receive) must end."""
    after_deadline_s: float
    """Time the steps after the deadline still get (a receive may use its whole window; the apply follows)."""
    lock: asyncio.Lock
    paused_by_update: bool = False
    num_aborted: int = 0
    """Requests this update aborted (``abort_all_requests``)."""
    buckets_applied: int = 0
    """Streamed buckets written so far (counted before each copy: a copy that fails midway wrote too)."""
    failed: threading.Event = field(default_factory=threading.Event)
    """Set once the update failed: streamed buckets still queued are refused."""
    ended: bool = False

    def step_s(self) -> float:
        return max(self.deadline - time.monotonic(), 0.0) + self.after_deadline_s

    def extend(self, window_s: float) -> None:
        """Let the update's own work run ``window_s`` more from now (a later call of an update held
        across calls, as vLLM's ``/update_weights``); a deadline is never brought forward."""
        self.deadline = max(self.deadline, time.monotonic() + window_s)

    def end(self) -> None:
        """Release the worker's writer lock; the only place it is released."""
        if not self.ended:
            self.ended = True
            self.lock.release()


class UpdatePipeline:
    """Runs :class:`UpdateTransaction` s on one worker's ranks (see the module docstring)."""

    def __init__(self, coordinator: Coordinator):
        self._coord = coordinator
        self._writer = asyncio.Lock()
        self._holder: UpdateTransaction | None = None

    async def begin(
        self,
        action: str,
        *,
        abort_all: bool,
        streaming: bool,
        timeout_s: float,
        after_deadline_s: float = APPLY_S,
        allow_frozen: bool = False,
    ) -> UpdateTransaction:
        """Take the writer lock and check every rank; the update's own work must end within ``timeout_s``.

        Raises :class:`UpdateRefused` (nothing changed, lock released) or
        :class:`~worker.stage.AdminBusy` when another update still holds the
        worker after a short wait (a prepared two-phase update holds it until
        its complete or abort).
        """
        deadline = time.monotonic() + timeout_s
        wait_s = min(timeout_s, WRITER_WAIT_S)
        try:
            await asyncio.wait_for(self._writer.acquire(), wait_s)
        except TimeoutError:
            holder = self._holder.action if self._holder is not None else "another weight update"
            raise AdminBusy(
                f"{action}: the weights are being updated by {holder}; it did not end within {wait_s:g}s"
            ) from None
        txn = UpdateTransaction(action, abort_all, streaming, deadline, after_deadline_s, self._writer)
        self._holder = txn
        try:
            if streaming:
                # Its buckets apply as they land: take the worker now (take checks first).
                await self._take(txn, hold=True, allow_frozen=allow_frozen)
            else:
                checked = await self._step(txn, partial(weight_ops.check, abort_all=abort_all))
                if not checked.success:
                    raise UpdateRefused(checked.message)
        except BaseException:
            self._end(txn)
            raise
        return txn

    async def take(self, txn: UpdateTransaction) -> None:
        """Atomic updates, right before the write: abort requests (if asked) and wait for their answers.

        Without ``abort_all_requests`` there is nothing to take: the apply step checks again."""
        if txn.abort_all:
            await self._take(txn, hold=False)

    def apply_streamed(
        self,
        txn: UpdateTransaction,
        named: NamedTensors,
        verify: Callable[[], None] | None = None,
        follower_op: Any = None,
    ) -> Future[Any]:
        """From the receive thread: write one bucket on the scheduler thread between steps,
        after ``verify`` (its checksum) has passed there, while the next bucket is received.
        The follower ranks of a tensor-parallel worker write their own copy (``follower_op``)."""
        txn.buckets_applied += 1
        scheduler = self._coord.scheduler
        local = partial(weight_ops.apply_streamed, scheduler, named, txn.failed, verify)
        if follower_op is not None and self._coord.stage.peers is not None:
            return self._coord.stage.submit_everywhere(txn.action, local, follower_op, txn.step_s())
        return scheduler.submit_admin(local)

    async def apply(
        self, txn: UpdateTransaction, named: NamedTensors, *, require_complete: bool, follower_op: Any = None
    ) -> None:
        """Write ``named`` in one scheduler step, or raise :class:`UpdateFailed` (weights intact unless a
        rollback failed); the follower ranks of a tensor-parallel worker run ``follower_op`` instead."""
        result = await self._step(
            txn,
            partial(weight_ops.apply_atomic, named=named, abort_all=txn.abort_all, require_complete=require_complete),
            follower_op=follower_op,
        )
        txn.num_aborted += sum(int(d.get("num_aborted", 0)) for d in result.rank_data[:1])
        if not result.success:
            effects = {d.get("weights") for d in result.rank_data}
            if effects & {"updated", "partial"}:
                # Tensor parallel ranks disagree (one wrote, another rolled back) or a rollback failed:
                # no rank may serve this mix, so every rank is marked partial until a full update.
                await self._step(txn, weight_ops.mark_partial, cleanup=True)
                raise UpdateFailed(result.message, "partial")
            raise UpdateFailed(result.message, "intact")

    async def commit(self, txn: UpdateTransaction, opts: CommitOptions) -> StageResult:
        """Record the write (weight state, version, flush, pause, checksum) and end the transaction."""
        try:
            return await self._step(txn, partial(weight_ops.commit, opts=opts))
        finally:
            self._end(txn)

    async def fail(self, txn: UpdateTransaction) -> WeightsEffect:
        """End an update that will not commit: ``partial`` if it wrote buckets (generation stays held)."""
        txn.failed.set()
        try:
            result = await self._step(txn, partial(weight_ops.fail, lift=txn.paused_by_update), cleanup=True)
            return "partial" if result.data.get("weights") == "partial" else "intact"
        finally:
            self._end(txn)

    async def mark_partial(self, txn: UpdateTransaction) -> None:
        """End a single-phase update whose receive failed: earlier calls of the sync may have written buckets."""
        txn.failed.set()
        try:
            await self._step(txn, weight_ops.mark_partial, cleanup=True)
        finally:
            self._end(txn)

    async def end_refused(self, txn: UpdateTransaction) -> None:
        """End an update that wrote nothing and will not (its receive could not start): undo its hold."""
        await self.fail(txn)

    # -- internals ---------------------------------------------------------------------------

    async def _take(self, txn: UpdateTransaction, *, hold: bool, allow_frozen: bool = False) -> None:
        taken = await self._step(
            txn, partial(weight_ops.take, abort_all=txn.abort_all, hold=hold, allow_frozen=allow_frozen)
        )
        if not taken.success:
            raise UpdateRefused(taken.message)
        txn.paused_by_update = txn.paused_by_update or bool(taken.data.get("paused_by_update"))
        aborted = list(taken.data.get("aborted_rids", []))
        txn.num_aborted += len(aborted)
        if aborted:
            # As SGLang's writer lock does: aborted requests are answered, with the
            # previous weight_version, before the weights change.
            await self._coord.wait_returned(aborted, txn.step_s())

    async def _step(
        self, txn: UpdateTransaction, op: Any, *, cleanup: bool = False, follower_op: Any = None
    ) -> StageResult:
        # A cleanup step runs even after the deadline (an update that timed out must still end).
        bound = max(txn.step_s(), CLEANUP_S) if cleanup else txn.step_s()
        async with self._coord.admin_section(txn.action, bound):
            return await self._coord.admin(txn.action, op, bound, follower_op)

    def _end(self, txn: UpdateTransaction) -> None:
        if self._holder is txn:
            self._holder = None
        txn.end()
