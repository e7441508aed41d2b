"""Rank assignment for one weight-update group spanning the trainer and every worker.

The trainer is rank 0 (or holds ranks ``0 .. rank_offset-1``); each worker
takes ``tp_size`` consecutive ranks starting at its own ``rank_offset``, in
registry order. Giving every worker the caller's single ``rank_offset`` (what a
plain SGLang router would forward) makes ranks collide and hangs the
rendezvous, so the router rewrites it per worker.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from router.gateway.admin.broadcast import AdminCall
from router.contract.errors import BadRequest, Unavailable
from router.contract.fleet import GroupInitResponse, RankPlanRequest, WorldSizeResponse
from router.contract.web.parsing import parse_model

if TYPE_CHECKING:
    from router.gateway.admin.broadcast import AdminBroadcaster, Outcome
    from router.gateway.admin.operations import Operation

DEFAULT_RANK_OFFSET = 1


@dataclass(frozen=True, slots=True)
class RankSlot:
    """The ranks one worker holds in the group: ``rank_offset .. rank_offset + tp_size - 1``."""

    worker_id: str
    url: str
    rank_offset: int
    tp_size: int


def total_worker_ranks(tp_sizes: Sequence[int | None]) -> int:
    return sum(1 if t is None else t for t in tp_sizes)


def plan_ranks(
    workers: Sequence[tuple[str, str, int | None]],
    *,
    world_size: int,
    rank_offset: int | None = None,
) -> list[RankSlot]:
    """Assign ranks to ``(id, url, tp_size)`` workers, or raise naming the right world size.

    Raises 503 when a worker's ``tp_size`` is unknown (it has not answered
    ``/model_info`` yet) and 400 when ``world_size`` disagrees with the plan;
    both before any worker is asked to join.
    """
    if not workers:
        raise Unavailable("no live workers to build a weight-update group with")
    unknown = [wid for wid, _, tp in workers if tp is None]
    if unknown:
        raise Unavailable(f"tp_size not yet known for worker(s) {', '.join(unknown)}; retry once they answer /model_info")
    start = DEFAULT_RANK_OFFSET if rank_offset is None else rank_offset
    if start < 1:
        raise BadRequest("rank_offset must be >= 1: rank 0 is the trainer's")
    slots: list[RankSlot] = []
    next_rank = start
    for wid, url, tp in workers:
        assert tp is not None
        slots.append(RankSlot(worker_id=wid, url=url, rank_offset=next_rank, tp_size=tp))
        next_rank += tp
    if world_size != next_rank:
        total = next_rank - start
        raise BadRequest(
            f"world_size {world_size} does not match the fleet: {len(workers)} worker(s) hold {total} rank(s) "
            f"starting at rank_offset {start}, so world_size must be {next_rank}",
            expected_world_size=next_rank,
        )
    return slots


class GroupInitializer:
    """``/init_weights_update_group`` through the router: plan, then one concurrent init per worker.

    The group's rendezvous needs every rank at once, so the per-worker calls go
    out together; a worker whose init fails or times out keeps every target
    disabled (fail closed) until an operator re-enables it.
    """

    PATH = "/init_weights_update_group"

    def __init__(self, broadcaster: "AdminBroadcaster", op: "Operation"):
        self._b = broadcaster
        self._op = op

    async def world_size(self) -> WorldSizeResponse:
        targets = self._b.live_targets()
        await self._b.refresh_versions([w for w in targets if w.tp_size is None])
        slots = plan_ranks(
            [(w.id, w.url, w.tp_size) for w in targets],
            world_size=DEFAULT_RANK_OFFSET + total_worker_ranks([w.tp_size for w in targets]),
        )
        return WorldSizeResponse(
            world_size=sum(s.tp_size for s in slots),
            workers=[{"id": s.worker_id, "url": s.url, "tp_size": s.tp_size, "rank_offset": s.rank_offset} for s in slots],
        )

    async def init(self, data: dict[str, Any], headers: dict[str, str]) -> "Outcome":
        plan = parse_model(RankPlanRequest, data)
        start = time.perf_counter()
        outcome_label = "error"
        await self._b.gate.acquire(self._op.name)
        try:
            targets = self._b.live_targets()
            await self._b.refresh_versions([w for w in targets if w.tp_size is None])
            slots = plan_ranks(
                [(w.id, w.url, w.tp_size) for w in targets], world_size=plan.world_size, rank_offset=plan.rank_offset
            )
            bodies = {s.worker_id: json.dumps({**data, "rank_offset": s.rank_offset}).encode() for s in slots}
            call = AdminCall(
                method="POST", path=self.PATH, headers=headers,
                body_for=lambda w: bodies[w.id], timeout_s=self._op.timeout_for(data),
            )  # fmt: skip
            fence = self._b.fence(targets, self.PATH)
            results = await self._b.fan_out(targets, call, fence=fence, stage="group init")
            ranks = [{"worker": s.worker_id, "url": s.url, "rank_offset": s.rank_offset, "tp_size": s.tp_size} for s in slots]
            outcome = self._b.settle(self.PATH, results, fence, GroupInitResponse, ranks=ranks)
            outcome_label = "success" if outcome.ok else "failure"
            return outcome
        finally:
            self._b.gate.release()
            self._b.metrics.observe_admin(self._op.name, outcome_label, time.perf_counter() - start)
