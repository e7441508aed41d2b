"""Stage: one pipeline stage and the ranks that serve it.

A stage has one scheduler (rank 0's) and, with tensor parallelism, follower
ranks in their own processes (:mod:`worker.tp`). An admin operation runs on
every rank (rank 0's scheduler thread sends it to the followers, runs it, and
waits for theirs, bounded) and the per-rank outcomes are folded into one
:class:`StageResult` that always carries every rank's typed outcome: one entry
per rank, a lost or late rank named in a failed one. Outcomes become the route's
response model (:meth:`StageResult.response`, with its ``rank_results``) only at the HTTP edge.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from router.contract.admin import RankResult
from router.contract.base import WireResponse
from worker.engine.results import OpResult, wire_fields
from worker.engine.scheduler import Scheduler
from worker.tp.follower import RankState
from worker.tp.peers import TPPeers, TPRankLost

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R", bound=WireResponse)

RankOp = Callable[[Scheduler], OpResult[Any]]


class AdminTimeout(Exception):
    """An admin operation did not finish in time (it may still complete later)."""

    def __init__(self, action: str, timeout_s: float):
        super().__init__(
            f"{action} did not complete within {timeout_s:g}s; it may still finish on the scheduler thread"
        )
        self.action = action
        self.timeout_s = timeout_s


class AdminBusy(Exception):
    """The worker cannot take this admin operation now (answered with 503)."""


class SchedulerUnavailable(AdminBusy):
    """A rank's scheduler thread is not running."""


@contextlib.asynccontextmanager
async def held(lock: asyncio.Lock, wait_s: float, busy_message: str) -> AsyncIterator[None]:
    """Hold ``lock``, waiting at most ``wait_s`` for it: a caller waiting behind a long
    operation gets :class:`AdminBusy` (a 503) instead of hanging."""
    try:
        await asyncio.wait_for(lock.acquire(), wait_s)
    except TimeoutError:
        raise AdminBusy(busy_message) from None
    try:
        yield
    finally:
        lock.release()


@dataclass(slots=True)
class StageResult(Generic[T]):
    """The stage-level aggregate of one admin operation: every rank's typed outcome, in rank order."""

    action: str
    success: bool
    message: str
    data: T | None = None
    """The leader's payload, as the answer reports it (a caller may replace it with a fuller one)."""
    outcomes: list[OpResult[T]] = field(default_factory=list)

    @property
    def rank_results(self) -> list[RankResult]:
        """One ``rank_results`` entry per rank, with its payload's scalar fields."""
        size = len(self.outcomes)
        return [_rank_result(i, size, r) for i, r in enumerate(self.outcomes)]

    def response(self, model: type[R], **extra: Any) -> R:
        """The JSON edge: the route's response ``model``, ``{success, message, <leader's data>,
        rank_results}`` plus the caller's ``extra`` fields."""
        return model.model_validate(
            {
                "success": self.success,
                "message": self.message,
                **wire_fields(self.data),
                **extra,
                "rank_results": self.rank_results,
            }
        )


def _rank_result(rank: int, tp_size: int, result: OpResult[Any]) -> RankResult:
    # Scalars only: bulky per-rank payloads (a checker's digests) are reported once, by the caller.
    fields = wire_fields(result.data)
    scalars = {k: v for k, v in fields.items() if isinstance(v, (str, int, float, bool)) or v is None}
    return RankResult.model_validate(
        {
            "rank": rank,
            "role": "tp",
            "tp_rank": rank,
            "tp_size": tp_size,
            "success": result.success,
            "message": result.message,
            **scalars,
        }
    )


def aggregate(action: str, results: list[OpResult[T]]) -> StageResult[T]:
    """All ranks must succeed; messages are joined with ``" | "`` as SGLang merges DP results."""
    messages = list(dict.fromkeys(r.message for r in results if r.message))
    return StageResult(
        action=action,
        success=all(r.success for r in results),
        message=" | ".join(messages),
        data=results[0].data if results else None,
        outcomes=list(results),
    )


class Stage:
    """A named stage: rank 0's scheduler, and the follower ranks of a tensor-parallel worker."""

    def __init__(self, name: str, leader: Scheduler, peers: TPPeers | None = None):
        self.name = name
        self.leader = leader
        """Rank 0's scheduler: it serves generation and sends every admin operation to the followers."""
        self.peers = peers

    @property
    def tp_size(self) -> int:
        return 1 if self.peers is None else self.peers.size

    def states(self) -> list[RankState]:
        """Every rank as status reads see it: rank 0 now, and each follower as it last reported itself."""
        followers = [] if self.peers is None else [f.state for f in self.peers.followers]
        return [RankState.of(self.leader), *followers]

    def start(self) -> None:
        self.leader.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.leader.stop(timeout)
        if self.peers is not None:
            self.peers.close(timeout)

    @property
    def alive(self) -> bool:
        return self.leader.alive and (self.peers is None or self.peers.alive)

    async def run(
        self, action: str, op: RankOp, timeout_s: float, follower_op: RankOp | None = None
    ) -> StageResult[Any]:
        """Run ``op`` on every rank's scheduler thread and aggregate; raises
        :class:`AdminTimeout`, or :class:`SchedulerUnavailable` when a rank's thread is gone.

        ``follower_op``, when given, is what the follower ranks run instead (their own received
        buckets rather than rank 0's, say)."""
        if not self.alive:
            raise SchedulerUnavailable(f"{action}: the scheduler thread is not running")
        if self.peers is not None:
            return await self._run_everywhere(action, op, timeout_s, follower_op)
        future = self.leader.submit_admin(functools.partial(op, self.leader))
        try:
            outcome: OpResult[Any] = await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except TimeoutError:
            future.cancel()  # only stops an op that has not started yet
            raise AdminTimeout(action, timeout_s) from None
        except Exception as exc:
            if not isinstance(exc, (ValueError, RuntimeError)):
                log.error("admin op %s raised", action, exc_info=exc)
            outcome = OpResult(False, f"{action} failed: {type(exc).__name__}: {exc}")
        return aggregate(action, [outcome])

    async def _run_everywhere(
        self, action: str, op: RankOp, timeout_s: float, follower_op: RankOp | None
    ) -> StageResult[Any]:
        """Tensor parallel: rank 0's scheduler thread sends ``op`` to the followers, runs it, awaits theirs."""
        assert self.peers is not None
        run = functools.partial(_everywhere, action, op, follower_op or op, self.leader, self.peers, timeout_s)
        return aggregate(action, await self._on_leader(action, run, timeout_s))

    async def followers(self, action: str, ops: RankOp | Sequence[RankOp], timeout_s: float) -> list[OpResult[Any]]:
        """Run an operation on the follower ranks only (``ops``: one for all, or one per follower in rank
        order); each follower's result. Ordered with forward steps like every other operation."""
        if self.peers is None:
            return []
        peers = self.peers
        per_rank = list(ops) if isinstance(ops, Sequence) else [ops] * len(peers.followers)

        def run() -> list[OpResult[Any]]:
            try:
                peers.send_ops(action, per_rank)
                return peers.await_op(action, timeout_s)
            except (TPRankLost, TypeError) as exc:
                return [OpResult(False, str(exc))] * len(per_rank)

        return await self._on_leader(action, run, timeout_s)

    def submit_everywhere(
        self, action: str, local: Callable[[], T], follower_op: RankOp, timeout_s: float
    ) -> Future[T]:
        """From any thread: a future for ``local()`` run on rank 0's scheduler thread while the followers run
        ``follower_op``; it fails when any follower's result is a failure (a streamed bucket, say)."""
        assert self.peers is not None
        return self.leader.submit_admin(
            functools.partial(_with_followers, action, local, follower_op, self.peers, timeout_s)
        )

    async def _on_leader(self, action: str, fn: Callable[[], T], timeout_s: float) -> T:
        fut = self.leader.submit_admin(fn)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s + TP_MARGIN_S)
        except TimeoutError:
            fut.cancel()
            raise AdminTimeout(action, timeout_s) from None

    def describe(self, action: str, op: Callable[[RankState], OpResult[T]]) -> StageResult[T]:
        """Aggregate a read-only ``op`` evaluated right here (no scheduler round trip),
        so status queries answer even while a long admin operation holds the thread;
        a follower rank answers from the state it last reported."""
        return aggregate(action, [op(rank) for rank in self.states()])


#: Beyond an operation's own bound: rank 0 waits for the followers within the bound, then answers.
TP_MARGIN_S = 5.0


def _everywhere(
    action: str, op: RankOp, follower_op: RankOp, leader: Scheduler, peers: TPPeers, timeout_s: float
) -> list[OpResult[Any]]:
    """On rank 0's scheduler thread: the followers run ``follower_op`` and rank 0 ``op``; one result per
    rank, in rank order.

    A follower that cannot take the operation, fails or does not answer within
    ``timeout_s`` yields a failed result naming it (and the worker is then unhealthy)."""
    try:
        peers.send_op(action, follower_op)
    except Exception as exc:  # not picklable, or a rank already lost: nothing ran anywhere
        return [OpResult(False, f"{action} not run on the tensor-parallel ranks: {exc}")] * peers.size
    try:
        local = op(leader)
    except (ValueError, RuntimeError) as exc:
        local = OpResult(False, f"{action} failed: {type(exc).__name__}: {exc}")
    try:
        remote = peers.await_op(action, timeout_s)
    except TPRankLost as exc:
        lost: OpResult[Any] = OpResult(False, str(exc))
        return [local, *[lost] * (peers.size - 1)]
    return [local, *remote]


def _with_followers(action: str, local: Callable[[], T], follower_op: RankOp, peers: TPPeers, timeout_s: float) -> T:
    """On rank 0's scheduler thread: ``local()`` while the followers run ``follower_op``; raises if any failed."""
    peers.send_op(action, follower_op)
    try:
        value = local()
    finally:
        # Always collect the followers' answers, so the next message on each pipe is the next one sent.
        results = peers.await_op(action, timeout_s)
    failed = [f"rank {i + 1}: {r.message}" for i, r in enumerate(results) if not r.success]
    if failed:
        raise RuntimeError(f"{action} failed on follower rank(s): {'; '.join(failed)}")
    return value
