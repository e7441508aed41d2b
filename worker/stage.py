"""Stage: one pipeline stage and the ranks that serve it.

A stage holds a list of rank schedulers (tensor parallelism would add ranks;
today there is one). An admin operation runs on every rank's scheduler thread
and the per-rank outcomes are folded into one :class:`StageResult` that always
carries ``rank_results``, so callers already see the shape TP will produce.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from worker.engine.admin_ops import OpResult
from worker.engine.scheduler import Scheduler

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
    """A named stage and its rank schedulers (rank 0 is the leader)."""

    def __init__(self, name: str, ranks: list[Scheduler]):
        if not ranks:
            raise ValueError("a stage needs at least one rank")
        self.name = name
        self.ranks = ranks

    @property
    def leader(self) -> Scheduler:
        return self.ranks[0]

    @property
    def tp_size(self) -> int:
        return len(self.ranks)

    def start(self) -> None:
        for rank in self.ranks:
            rank.start()

    def stop(self, timeout: float = 10.0) -> None:
        for rank in self.ranks:
            rank.stop(timeout)

    @property
    def alive(self) -> bool:
        return all(rank.alive for rank in self.ranks)

    async def run(self, action: str, op: RankOp, timeout_s: float) -> StageResult:
        """Run ``op`` on every rank's scheduler thread and aggregate; raises
        :class:`AdminTimeout`, or :class:`SchedulerUnavailable` when a rank's thread is gone."""
        if not self.alive:
            raise SchedulerUnavailable(f"{action}: the scheduler thread is not running")
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

    def describe(self, action: str, op: RankOp) -> StageResult:
        """Aggregate a read-only ``op`` evaluated right here (no scheduler round trip),
        so status queries answer even while a long admin operation holds the thread."""
        return aggregate(action, [op(rank) for rank in self.ranks])
