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
then waits for the snapshots being sent to peers to end, cutting those that outlast
the lease wait (:mod:`worker.peer.lease`),
and :meth:`UpdateTransaction.end` (called by commit, fail and cancel) is the one
place it is released. The weights' own states are those of
:mod:`worker.engine.weight_state`; the steps that touch the model run on the
scheduler threads (:mod:`worker.engine.weight_ops`), inside the coordinator's
admin section so that they never interleave with a pause or a memory release.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from router.contract.admin import WeightsEffect
from router.contract.budget import APPLY_S, CLEANUP_S
from router.contract.budget import HOP_MARGIN_S as WRITER_WAIT_S
from router.dataplane.buckets import NamedTensors
from worker.engine import weight_ops
from worker.engine.results import Applied, Committed, Ended, Taken, effect_of
from worker.engine.scheduler import Scheduler
from worker.engine.weight_ops import CommitOptions
from worker.peer.lease import ReadLeases
from worker.ranks import AdminBusy, RankOp, Stage, StageResult


class PipelinePorts(Protocol):
    """What the pipeline uses of the worker (the coordinator provides it; the pipeline never sees more)."""

    @property
    def scheduler(self) -> Scheduler: ...

    @property
    def stage(self) -> Stage: ...

    def admin_section(self, action: str, timeout_s: float) -> AbstractAsyncContextManager[None]:
        """The worker's admin lock, held for one step."""
        ...

    async def admin(
        self, action: str, op: RankOp, timeout_s: float, follower_op: RankOp | None = None
    ) -> StageResult[Any]:
        """``op`` on every rank, aggregated."""
        ...

    async def wait_returned(self, rids: list[str], timeout_s: float) -> None:
        """Until the callers of ``rids`` have their answers (bounded)."""
        ...


class UpdateRefused(Exception):
    """The update was refused before anything was written; the message is for the caller."""


class UpdateFailed(Exception):
    """Writing the weights failed; ``effect`` says whether they are intact or partial."""

    def __init__(self, message: str, effect: WeightsEffect):
        super().__init__(message)
        self.effect = effect


class TxnPhase(enum.StrEnum):
    """Where an :class:`UpdateTransaction` is (see :data:`_NEXT` for the allowed steps)."""

    BEGINNING = "beginning"
    """The writer lock is held; the ranks are being checked (or, streaming, taken)."""
    CHECKED = "checked"
    """Atomic: every rank may be written; the source's own work (read, receive) runs now."""
    HOLDING = "holding"
    """Streaming: the worker is taken and generation held; buckets apply as they land."""
    TAKEN = "taken"
    """Atomic: requests aborted if asked, right before the write."""
    APPLIED = "applied"
    """Atomic: written in one scheduler step."""
    COMMITTED = "committed"
    ENDED = "ended"
    """Ended without a commit (refused, failed, aborted or closed)."""


#: The phase machine::
#:
#:     BEGINNING ─► CHECKED ─take─► TAKEN ─apply─► APPLIED ─commit─► COMMITTED
#:         └──────► HOLDING (streamed buckets apply here) ──commit──► COMMITTED
#:     any phase before COMMITTED ─fail / mark_partial / end─► ENDED
_NEXT: dict[TxnPhase, frozenset[TxnPhase]] = {
    TxnPhase.BEGINNING: frozenset({TxnPhase.CHECKED, TxnPhase.HOLDING}),
    TxnPhase.CHECKED: frozenset({TxnPhase.TAKEN}),
    TxnPhase.TAKEN: frozenset({TxnPhase.APPLIED}),
    TxnPhase.APPLIED: frozenset({TxnPhase.COMMITTED}),
    TxnPhase.HOLDING: frozenset({TxnPhase.COMMITTED}),
    TxnPhase.COMMITTED: frozenset(),
    TxnPhase.ENDED: frozenset(),
}


class TransactionError(RuntimeError):
    """A step out of order (a bug in the caller, not a caller's mistake): names the step that must come first."""


@dataclass(eq=False)
class UpdateTransaction:
    """One weight update, from :meth:`UpdatePipeline.begin` to its end; :attr:`phase` says where it is."""

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
    phase: TxnPhase = TxnPhase.BEGINNING
    ended: bool = field(default=False, init=False)
    """The writer lock is released (the phase is then ``COMMITTED`` or ``ENDED``)."""

    def advance(self, to: TxnPhase) -> None:
        """Move to ``to``, or raise :class:`TransactionError` naming what must come first."""
        if to not in _NEXT[self.phase]:
            before = [p.value for p, nexts in _NEXT.items() if to in nexts]
            raise TransactionError(
                f"{self.action}: cannot go to {to.value} from {self.phase.value}; expected {' or '.join(before)} first"
            )
        self.phase = to

    def require(self, *phases: TxnPhase) -> None:
        if self.phase not in phases:
            expected = " or ".join(p.value for p in phases)
            raise TransactionError(f"{self.action}: the update is {self.phase.value}; expected {expected}")

    def step_s(self) -> float:
        return max(self.deadline - time.monotonic(), 0.0) + self.after_deadline_s

    def extend(self, window_s: float) -> None:
        """Let the update's own work run ``window_s`` more from now (a later call of an update held
        across calls, as vLLM's ``/update_weights``); a deadline is never brought forward."""
        self.deadline = max(self.deadline, time.monotonic() + window_s)

    def end(self) -> None:
        """Release the worker's writer lock; the only place it is released. A transaction that did
        not commit ends ``ENDED``."""
        if not self.ended:
            self.ended = True
            if self.phase is not TxnPhase.COMMITTED:
                self.phase = TxnPhase.ENDED
            self.lock.release()


class UpdatePipeline:
    """Runs :class:`UpdateTransaction` s on one worker's ranks (see the module docstring)."""

    def __init__(self, ports: PipelinePorts):
        self._coord = ports
        self._writer = asyncio.Lock()
        self._holder: UpdateTransaction | None = None
        self.leases = ReadLeases(self._writer_busy)
        """Snapshots being sent to peers: an update waits for them (bounded), then cuts them."""

    def _writer_busy(self) -> str | None:
        """Who holds the writer lock, or None."""
        if not self._writer.locked():
            return None
        return self._holder.action if self._holder is not None else "another weight update"

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
        :class:`~worker.ranks.AdminBusy` when another update still holds the
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
            # Below the writer lock: snapshots in flight end, or are cut, before anything is written.
            await self.leases.end_for_writer(timeout_s)
            if streaming:
                # Its buckets apply as they land: take the worker now (take checks first).
                await self._take(txn, hold=True, allow_frozen=allow_frozen, lock_wait_s=timeout_s)
                txn.advance(TxnPhase.HOLDING)
            else:
                checked = await self._step(txn, partial(weight_ops.check, abort_all=abort_all), lock_wait_s=timeout_s)
                if not checked.success:
                    raise UpdateRefused(checked.message)
                txn.advance(TxnPhase.CHECKED)
        except BaseException:
            self._end(txn)
            raise
        return txn

    async def take(self, txn: UpdateTransaction) -> None:
        """Atomic updates, right before the write: abort requests (if asked) and wait for their answers.

        Without ``abort_all_requests`` there is nothing to take: the apply step checks again."""
        txn.require(TxnPhase.CHECKED)
        if txn.abort_all:
            await self._take(txn, hold=False)
        txn.advance(TxnPhase.TAKEN)

    def apply_streamed(
        self,
        txn: UpdateTransaction,
        named: NamedTensors,
        verify: Callable[[], None] | None = None,
        follower_op: RankOp | None = None,
    ) -> Future[Any]:
        """From the receive thread: write one bucket on the scheduler thread between steps,
        after ``verify`` (its checksum) has passed there, while the next bucket is received.
        The follower ranks of a tensor-parallel worker write their own copy (``follower_op``)."""
        txn.require(TxnPhase.HOLDING)
        txn.buckets_applied += 1
        scheduler = self._coord.scheduler
        local = partial(weight_ops.apply_streamed, scheduler, named, txn.failed, verify)
        if follower_op is not None and self._coord.stage.peers is not None:
            return self._coord.stage.submit_everywhere(txn.action, local, follower_op, txn.step_s())
        return scheduler.submit_admin(local)

    async def apply(
        self,
        txn: UpdateTransaction,
        named: NamedTensors,
        *,
        require_complete: bool,
        follower_op: RankOp | None = None,
    ) -> None:
        """Write ``named`` in one scheduler step, or raise :class:`UpdateFailed` (weights intact unless a
        rollback failed); the follower ranks of a tensor-parallel worker run ``follower_op`` instead."""
        txn.require(TxnPhase.TAKEN)
        result = await self._step(
            txn,
            partial(weight_ops.apply_atomic, named=named, abort_all=txn.abort_all, require_complete=require_complete),
            follower_op=follower_op,
        )
        leader: Applied | None = result.data
        if leader is not None:
            txn.num_aborted += leader.num_aborted or 0
        if not result.success:
            # A rank that does not say what it did (it raised, or was lost) counts as partial.
            effects = {effect_of(outcome.data) for outcome in result.outcomes}
            if effects & {"updated", "partial"}:
                # Tensor parallel ranks disagree (one wrote, another rolled back) or a rollback failed:
                # no rank may serve this mix, so every rank is marked partial until a full update.
                await self._step(txn, weight_ops.mark_partial, cleanup=True)
                raise UpdateFailed(result.message, "partial")
            raise UpdateFailed(result.message, "intact")
        txn.advance(TxnPhase.APPLIED)

    async def commit(self, txn: UpdateTransaction, opts: CommitOptions) -> StageResult[Committed]:
        """Record the write (weight state, version, flush, pause, checksum) and end the transaction.

        Only after the write: an atomic update's :meth:`apply`, or a streaming update's hold."""
        txn.require(TxnPhase.APPLIED, TxnPhase.HOLDING)
        try:
            return await self._step(txn, partial(weight_ops.commit, opts=opts))
        finally:
            txn.advance(TxnPhase.COMMITTED)
            self._end(txn)

    async def fail(self, txn: UpdateTransaction) -> WeightsEffect:
        """End an update that will not commit: ``partial`` if it wrote buckets (generation stays held)."""
        txn.failed.set()
        try:
            result: StageResult[Ended] = await self._step(
                txn, partial(weight_ops.fail, lift=txn.paused_by_update), cleanup=True
            )
            # The leader's effect; one it does not report counts as partial.
            return "partial" if effect_of(result.data) == "partial" else "intact"
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

    async def _take(
        self, txn: UpdateTransaction, *, hold: bool, allow_frozen: bool = False, lock_wait_s: float | None = None
    ) -> None:
        taken = await self._step(
            txn,
            partial(weight_ops.take, abort_all=txn.abort_all, hold=hold, allow_frozen=allow_frozen),
            lock_wait_s=lock_wait_s,
        )
        if not taken.success:
            raise UpdateRefused(taken.message)
        data: Taken = taken.data if taken.data is not None else Taken()
        txn.paused_by_update = txn.paused_by_update or data.paused_by_update
        aborted = list(data.aborted_rids)
        txn.num_aborted += len(aborted)
        if aborted:
            # As SGLang's writer lock does: aborted requests are answered, with the
            # previous weight_version, before the weights change.
            await self._coord.wait_returned(aborted, txn.step_s())

    async def _step(
        self,
        txn: UpdateTransaction,
        op: RankOp,
        *,
        cleanup: bool = False,
        follower_op: RankOp | None = None,
        lock_wait_s: float | None = None,
    ) -> StageResult[Any]:
        # A cleanup step runs even after the deadline (an update that timed out must still end).
        bound = max(txn.step_s(), CLEANUP_S) if cleanup else txn.step_s()
        # begin's steps wait for the admin lock no longer than the update's own timeout_s (the rule of
        # worker.coordinator's lock order); the steps after its work may use the time granted after it.
        wait_s = bound if lock_wait_s is None else min(bound, lock_wait_s)
        async with self._coord.admin_section(txn.action, wait_s):
            return await self._coord.admin(txn.action, op, bound, follower_op)

    def _end(self, txn: UpdateTransaction) -> None:
        if self._holder is txn:
            self._holder = None
        txn.end()
