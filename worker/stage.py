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
from collections.abc import AsyncIterator, Callable
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

    async def run(self, action: str, op: RankOp, timeout_s: float) -> StageResult:
        """Run ``op`` on every rank's scheduler thread and aggregate; raises
        :class:`AdminTimeout`, or :class:`SchedulerUnavailable` when a rank's thread is gone."""
        if not self.alive:
            raise SchedulerUnavailable(f"{action}: the scheduler thread is not running")
        if self.peers is not None:
            return await self._run_everywhere(action, op, timeout_s)
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

    async def _run_everywhere(self, action: str, op: RankOp, timeout_s: float) -> StageResult:
        """Tensor parallel: rank 0's scheduler thread sends ``op`` to the followers, runs it, awaits theirs."""
        assert self.peers is not None
        fut = self.leader.submit_admin(functools.partial(_everywhere, action, op, self.leader, self.peers, timeout_s))
        try:
            results = await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s + TP_MARGIN_S)
        except TimeoutError:
            fut.cancel()
            raise AdminTimeout(action, timeout_s) from None
        return aggregate(action, results)

    def describe(self, action: str, op: RankOp) -> StageResult:
        """Aggregate a read-only ``op`` evaluated right here (no scheduler round trip),
        so status queries answer even while a long admin operation holds the thread;
        a follower rank answers from the state it last reported."""
        return aggregate(action, [op(rank) for rank in self.views()])


#: Beyond an operation's own bound: rank 0 waits for the followers within the bound, then answers.
TP_MARGIN_S = 5.0


def _everywhere(action: str, op: RankOp, leader: Scheduler, peers: TPPeers, timeout_s: float) -> list[OpResult]:
    """On rank 0's scheduler thread: the followers and rank 0 run ``op``; one result per rank, in rank order.

    A follower that cannot take the operation, fails or does not answer within
    ``timeout_s`` yields a failed result naming it (and the worker is then unhealthy)."""
    try:
        peers.send_op(action, op)
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
