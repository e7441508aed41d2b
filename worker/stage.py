"""Stage: one pipeline stage and the ranks that serve it.

A stage has one scheduler (rank 0's) and, with tensor parallelism, follower
ranks in their own processes (:mod:`worker.tp`). An admin operation runs on
every rank (rank 0's scheduler thread sends it to the followers, runs it, and
waits for theirs, bounded) and the per-rank outcomes are folded into one
:class:`StageResult` that always carries ``rank_results``: one entry per rank,
a lost or late rank named in a failed one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from worker.engine.admin_ops import OpResult
from worker.engine.scheduler import Scheduler
from worker.engine.weight_state import WeightState
from worker.tp.peers import TPPeers, TPRankLost

log = logging.getLogger(__name__)

RankOp = Callable[[Scheduler], OpResult]


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


@dataclass
class StageResult:
    """The stage-level aggregate of one admin operation."""

    action: str
    success: bool
    message: str
    data: dict[str, Any] = field(default_factory=dict)
    rank_results: list[dict[str, Any]] = field(default_factory=list)
    rank_data: list[dict[str, Any]] = field(default_factory=list)
    """Every rank's full ``data`` (``data`` itself is the leader's)."""

    def body(self, **extra: Any) -> dict[str, Any]:
        """The JSON response body: ``{success, message, <leader's data>, rank_results}``."""
        return {
            "success": self.success,
            "message": self.message,
            **self.data,
            **extra,
            "rank_results": self.rank_results,
        }


def _rank_result(rank: int, tp_size: int, result: OpResult) -> dict[str, Any]:
    # Scalars only: bulky per-rank payloads (checksums) are reported once, by the caller.
    scalars = {k: v for k, v in result.data.items() if isinstance(v, (str, int, float, bool)) or v is None}
    return {
        "rank": rank,
        "role": "tp",
        "tp_rank": rank,
        "tp_size": tp_size,
        "success": result.success,
        "message": result.message,
        **scalars,
    }


def aggregate(action: str, results: list[OpResult]) -> StageResult:
    """All ranks must succeed; messages are joined with ``" | "`` as SGLang merges DP results."""
    messages = list(dict.fromkeys(r.message for r in results if r.message))
    return StageResult(
        action=action,
        success=all(r.success for r in results),
        message=" | ".join(messages),
        data=dict(results[0].data) if results else {},
        rank_results=[_rank_result(i, len(results), r) for i, r in enumerate(results)],
        rank_data=[r.data for r in results],
    )


class Stage:
    """A named stage: rank 0's scheduler, and the follower ranks of a tensor-parallel worker."""

    def __init__(self, name: str, ranks: list[Scheduler], peers: TPPeers | None = None):
        if not ranks:
            raise ValueError("a stage needs at least one rank")
        if peers is not None and len(ranks) != 1:
            raise ValueError("a tensor-parallel stage has one scheduler (rank 0's); its followers are its peers")
        self.name = name
        self.ranks = ranks
        self.peers = peers

    @property
    def leader(self) -> Scheduler:
        return self.ranks[0]

    @property
    def tp_size(self) -> int:
        return len(self.ranks) if self.peers is None else self.peers.size

    def views(self) -> list[Any]:
        """Every rank as status reads see it: the schedulers, and each follower's last reported state."""
        if self.peers is None:
            return list(self.ranks)
        return [self.leader, *(FollowerView(f.state) for f in self.peers.followers)]

    def start(self) -> None:
        for rank in self.ranks:
            rank.start()

    def stop(self, timeout: float = 10.0) -> None:
        for rank in self.ranks:
            rank.stop(timeout)
        if self.peers is not None:
            self.peers.close(timeout)

    @property
    def alive(self) -> bool:
        return all(rank.alive for rank in self.ranks) and (self.peers is None or self.peers.alive)

    async def run(self, action: str, op: RankOp, timeout_s: float, follower_op: RankOp | None = None) -> StageResult:
        """Run ``op`` on every rank's scheduler thread and aggregate; raises
        :class:`AdminTimeout`, or :class:`SchedulerUnavailable` when a rank's thread is gone.

        ``follower_op``, when given, is what the follower ranks run instead (their own received
        buckets rather than rank 0's, say)."""
        if not self.alive:
            raise SchedulerUnavailable(f"{action}: the scheduler thread is not running")
        if self.peers is not None:
            return await self._run_everywhere(action, op, timeout_s, follower_op)
        futures = [rank.submit_admin(functools.partial(op, rank)) for rank in self.ranks]
        waiters = [asyncio.wrap_future(f) for f in futures]
        try:
            outcomes = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), timeout_s)
        except TimeoutError:
            for f in futures:
                f.cancel()  # only stops ops that have not started yet
            raise AdminTimeout(action, timeout_s) from None
        results = []
        for outcome in outcomes:
            if isinstance(outcome, OpResult):
                results.append(outcome)
            else:
                if not isinstance(outcome, (ValueError, RuntimeError)):
                    log.error("admin op %s raised", action, exc_info=outcome)
                results.append(OpResult(False, f"{action} failed: {type(outcome).__name__}: {outcome}"))
        return aggregate(action, results)

    async def _run_everywhere(
        self, action: str, op: RankOp, timeout_s: float, follower_op: RankOp | None
    ) -> StageResult:
        """Tensor parallel: rank 0's scheduler thread sends ``op`` to the followers, runs it, awaits theirs."""
        assert self.peers is not None
        run = functools.partial(_everywhere, action, op, follower_op or op, self.leader, self.peers, timeout_s)
        return aggregate(action, await self._on_leader(action, run, timeout_s))

    async def followers(self, action: str, ops: RankOp | Sequence[RankOp], timeout_s: float) -> list[OpResult]:
        """Run an operation on the follower ranks only (``ops``: one for all, or one per follower in rank
        order); each follower's result. Ordered with forward steps like every other operation."""
        if self.peers is None:
            return []
        peers = self.peers
        per_rank = list(ops) if isinstance(ops, Sequence) else [ops] * len(peers.followers)

        def run() -> list[OpResult]:
            try:
                peers.send_ops(action, per_rank)
                return peers.await_op(action, timeout_s)
            except (TPRankLost, TypeError) as exc:
                return [OpResult(False, str(exc))] * len(per_rank)

        return await self._on_leader(action, run, timeout_s)

    def submit_everywhere(self, action: str, local: Callable[[], Any], follower_op: RankOp, timeout_s: float) -> Any:
        """From any thread: a future for ``local()`` run on rank 0's scheduler thread while the followers run
        ``follower_op``; it fails when any follower's result is a failure (a streamed bucket, say)."""
        assert self.peers is not None
        return self.leader.submit_admin(
            functools.partial(_with_followers, action, local, follower_op, self.peers, timeout_s)
        )

    async def _on_leader(self, action: str, fn: Callable[[], Any], timeout_s: float) -> Any:
        fut = self.leader.submit_admin(fn)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s + TP_MARGIN_S)
        except TimeoutError:
            fut.cancel()
            raise AdminTimeout(action, timeout_s) from None

    def describe(self, action: str, op: RankOp) -> StageResult:
        """Aggregate a read-only ``op`` evaluated right here (no scheduler round trip),
        so status queries answer even while a long admin operation holds the thread;
        a follower rank answers from the state it last reported."""
        return aggregate(action, [op(rank) for rank in self.views()])


class PassiveStage:
    """A stage with no admin-capable scheduler (a tokenizer or detokenizer stage, say): every admin
    operation succeeds as ``skipped`` there, so a pipeline's fan-out needs no special case for it."""

    def __init__(self, name: str):
        self.name = name

    async def run(self, action: str, op: RankOp, timeout_s: float, follower_op: RankOp | None = None) -> StageResult:
        message = f"skipped: stage {self.name!r} has no admin-capable scheduler"
        rank = {"rank": 0, "role": "stage", "tp_rank": 0, "tp_size": 1, "success": True, "message": message}
        return StageResult(
            action=action,
            success=True,
            message=message,
            data={"skipped": True},
            rank_results=[{**rank, "skipped": True}],
            rank_data=[{"skipped": True}],
        )


#: Beyond an operation's own bound: rank 0 waits for the followers within the bound, then answers.
TP_MARGIN_S = 5.0


def _everywhere(
    action: str, op: RankOp, follower_op: RankOp, leader: Scheduler, peers: TPPeers, timeout_s: float
) -> list[OpResult]:
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
        lost = OpResult(False, str(exc))
        return [local, *[lost] * (peers.size - 1)]
    return [local, *remote]


def _with_followers(
    action: str, local: Callable[[], Any], follower_op: RankOp, peers: TPPeers, timeout_s: float
) -> Any:
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


class FollowerView:
    """A follower rank as status reads see it: what it reported after its last operation."""

    def __init__(self, state: dict[str, Any]):
        self.is_paused = bool(state.get("is_paused"))
        self.pause_mode = state.get("pause_mode")
        self.alive = True
        self.worker = SimpleNamespace(
            model_path=state.get("model_path"),
            weight_version=state.get("weight_version"),
            weights_partial=bool(state.get("weights_partial")),
            weights_released=bool(state.get("weights_released")),
            released_tags=frozenset(state.get("released_tags", ())),
            device=state.get("device"),
            dtype_name=state.get("dtype"),
            ledger=SimpleNamespace(state=WeightState(state.get("weight_state", WeightState.SERVING.value))),
        )
