"""One receive of a distributed weight update on every TP rank of this worker.

A :class:`ReceiveSession` is one update's receive: rank 0's :class:`BucketReceiver`, the
follower ranks' own receives (:mod:`worker.tp.transfer`), and the pipeline transaction the
buckets are written in. :class:`Receives` plans (checks), starts and finishes sessions; the
protocol adapters decide when, and own the transaction: two-phase and single-phase
(:mod:`worker.transfer.group.two_phase`, :mod:`worker.transfer.group.single_phase`) begin one per receive, vLLM's
(:mod:`worker.transfer.vllm.engine`) writes several receives into the one it opened.

Invariants:

- Metadata is checked against the model before anything is posted: a refused start posts no
  receive on any rank (:class:`~worker.update_pipeline.UpdateRefused`), and undoes the transaction it began.
- Every rank receives its own copy of every bucket; rank 0 waits for the followers' outcomes
  before it reports a streaming receive as successful.
- Atomic: the staged buckets' announced checksums are verified before anything is taken or
  written; the buffers are released whatever the outcome.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TypeVar

from router.contract.bucket_layout import BucketLayout
from router.contract.budget import HOP_MARGIN_S
from router.contract.weight_sync import TensorListMeta
from router.dataplane.buckets import NamedTensors
from router.dataplane.formats import BucketFormat
from router.dataplane.group import GroupError, WeightUpdateGroup
from worker.engine.model_worker import ModelWorker
from worker.engine.results import Committed
from worker.engine.weight_ops import CommitOptions
from worker.ranks import Stage, StageResult
from worker.tp import transfer as tp_transfer
from worker.transfer.group.receiver import BucketReceiver, ReceiveBuffers, ReceiveOutcome, ReceiveState
from worker.transfer.validation import (
    ChecksumMismatch,
    MetadataError,
    announced_checksums,
    validate_buckets,
    verify_bucket,
    verify_staged,
)
from worker.update_pipeline import UpdateFailed, UpdatePipeline, UpdateRefused, UpdateTransaction

T = TypeVar("T")

#: Past the receive deadline, the time the receive loop gets to notice it and report.
RECEIVE_GRACE_S = 5.0
#: The pipeline action of every distributed update.
SYNC_ACTION = "update_weights_from_distributed"
#: How long the follower ranks get to drop their receive.
CANCEL_WAIT_S = 10.0
#: SGLang's words for a failed update that left the weights partial (both SGLang adapters say them).
PARTIAL_NOTE = " The full weights of the ModelRunner are partially updated. Please discard the whole weights."


@dataclass(frozen=True, slots=True)
class ReceiveRequest:
    """What a protocol call asks the controller to receive (``start_receive``): the buckets it announced, the
    group they come over and their format, and the call's own options."""

    buckets: Sequence[TensorListMeta]
    group_name: str
    fmt: BucketFormat
    atomic: bool
    abort_all: bool
    weight_version: str | None
    timeout_s: float | None


@dataclass(eq=False)
class ReceiveSession:
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

    def wait_s(self) -> float:
        """How long to wait for the receive: to its deadline, plus a grace for the loop to report."""
        return max(self.txn.deadline - time.monotonic(), 0.0) + RECEIVE_GRACE_S

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started


@dataclass(frozen=True, slots=True)
class ReceivePlan:
    """Announced buckets checked against the model: what each rank will receive, before anything is posted."""

    layouts: list[BucketLayout]
    names: tuple[str, ...]
    checksums: tuple[str | None, ...]
    fmt: BucketFormat


class Receives:
    """Starts and finishes :class:`ReceiveSession` s on this worker's ranks."""

    def __init__(
        self,
        stage: Stage,
        worker: ModelWorker,
        updates: UpdatePipeline,
        *,
        in_thread: Callable[[Callable[[], Any]], Awaitable[Any]],
        receive_timeout_s: float,
    ):
        self._stage = stage
        self._worker = worker
        self.updates = updates
        self._in_thread = in_thread
        self.receive_timeout_s = receive_timeout_s
        self._buffers = ReceiveBuffers()

    def plan(self, buckets: Sequence[TensorListMeta], fmt: BucketFormat) -> ReceivePlan:
        """Check the announced buckets against the model; raise :class:`UpdateRefused` (nothing posted)."""
        model = self._worker.model
        try:
            layouts = validate_buckets(
                buckets, model.checkpoint_spec(), flattened=fmt.requires_aligned, is_ignored=model.is_ignored_weight
            )
        except MetadataError as exc:
            raise UpdateRefused(str(exc)) from None
        names = tuple(s.name for layout in layouts for s in layout.slots)
        return ReceivePlan(layouts, names, announced_checksums(buckets), fmt)

    async def start(
        self,
        txn: UpdateTransaction,
        group: WeightUpdateGroup,
        plan: ReceivePlan,
        *,
        atomic: bool,
        window_s: float,
        weight_version: str | None,
    ) -> ReceiveSession:
        """Start ``plan``'s receive on every rank, writing into ``txn``; raise :class:`UpdateRefused` when a
        rank cannot start it (the ranks that started drop theirs; ``txn`` is the caller's to undo)."""
        checksums = plan.checksums

        def apply(index: int, named: NamedTensors) -> Future[Any]:
            # Streaming: each bucket's checksum is verified in its apply step, before the write;
            # TP followers write their own copy of the same bucket, received by themselves.
            return self.updates.apply_streamed(
                txn,
                named,
                verify=partial(verify_bucket, checksums[index], named),
                follower_op=partial(tp_transfer.apply_bucket, index=index, wait_s=window_s + HOP_MARGIN_S),
            )

        receiver = BucketReceiver(
            group,
            plan.layouts,
            fmt=plan.fmt,
            device=self._worker.device,
            buffers=self._buffers,
            apply=None if atomic else apply,
        )
        started = await self._stage.followers(
            SYNC_ACTION,
            partial(
                tp_transfer.start_receive,
                group_name=group.name,
                layouts=plan.layouts,
                load_format=plan.fmt.load_format,
                atomic=atomic,
                window_s=window_s,
                checksums=checksums,
            ),
            HOP_MARGIN_S,
        )
        if not all(r.success for r in started):
            await self.cancel_followers("another rank could not start its receive")
            raise UpdateRefused("; ".join(f"rank {i + 1}: {r.message}" for i, r in enumerate(started) if not r.success))
        try:
            await self._in_thread(partial(receiver.start, window_s))
        except GroupError as exc:
            await self.cancel_followers(str(exc))
            raise UpdateRefused(str(exc)) from None
        return ReceiveSession(
            group=group,
            txn=txn,
            receiver=receiver,
            atomic=atomic,
            weight_version=weight_version,
            names=plan.names,
            checksums=checksums,
        )

    async def finish(
        self, update: ReceiveSession, *, weight_version: str | None, flush_cache: bool, checksum: bool
    ) -> StageResult[Committed]:
        """After a successful receive: atomic updates write their staged buckets; then commit. Drops the buffers."""
        try:
            if update.atomic:
                buckets = update.receiver.staged()
                if any(update.checksums):  # verified before anything is taken or written
                    try:
                        await self._in_thread(partial(verify_staged, buckets, update.checksums))
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

    async def followers_received(self, update: ReceiveSession, outcome: ReceiveOutcome) -> ReceiveOutcome:
        """Streaming, after rank 0's receive succeeded: did every follower rank's succeed too?"""
        results = await self._stage.followers(
            SYNC_ACTION, partial(tp_transfer.receive_outcome, wait_s=HOP_MARGIN_S), 2 * HOP_MARGIN_S
        )
        failed = [f"rank {i + 1}: {r.message}" for i, r in enumerate(results) if not r.success]
        if not failed:
            return outcome
        return replace(outcome, state=ReceiveState.FAILED, error=f"the receive failed on follower {'; '.join(failed)}")

    async def cancel_followers(self, reason: str, *, broken_reason: str | None = None) -> None:
        """Best effort: the follower ranks drop their receive too (each ends by its deadline anyway)."""
        await self._stage.followers(
            SYNC_ACTION, partial(tp_transfer.cancel_receive, reason=reason, broken_reason=broken_reason), CANCEL_WAIT_S
        )
