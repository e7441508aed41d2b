"""Rank assignment for one weight-update group spanning the trainer and every worker.

The trainer is rank 0 (or holds ranks ``0 .. rank_offset-1``); each worker
takes ``tp_size`` consecutive ranks starting at its own ``rank_offset``, in
registry order. Giving every worker the caller's single ``rank_offset`` (what a
plain SGLang router would forward) makes ranks collide and hangs the
rendezvous, so the router rewrites it per worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.contract import endpoints as ep
from router.contract.errors import BadRequest, Unavailable
from router.contract.fleet import RankAssignment, WorldSizeResponse
from router.contract.weight_sync import DEFAULT_RANK_OFFSET, InitWeightsUpdateGroupRequest
from router.gateway.admin.answers import Outcome
from router.gateway.admin.fanout import AdminCall
from router.gateway.admin.locked import AdminContext, AdminRun
from router.gateway.admin.operations import OPERATIONS

INIT = OPERATIONS[ep.INIT_WEIGHTS_UPDATE_GROUP.path]


@dataclass(frozen=True, slots=True)
class RankSlot:
    """The ranks one worker holds in the group: ``rank_offset .. rank_offset + tp_size - 1``."""

    worker_id: str
    url: str
    rank_offset: int
    tp_size: int

    def assignment(self) -> RankAssignment:
        return RankAssignment(worker=self.worker_id, url=self.url, rank_offset=self.rank_offset, tp_size=self.tp_size)


def total_worker_ranks(tp_sizes: Sequence[int | None]) -> int:
    return sum(1 if t is None else t for t in tp_sizes)


def plan_ranks(
    workers: Sequence[tuple[str, str, int | None]],
    *,
    world_size: int,
    rank_offset: int = DEFAULT_RANK_OFFSET,
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
        raise Unavailable(
            f"tp_size not yet known for worker(s) {', '.join(unknown)}; retry once they answer /model_info"
        )
    if rank_offset < 1:
        raise BadRequest("rank_offset must be >= 1: rank 0 is the trainer's")
    slots: list[RankSlot] = []
    next_rank = rank_offset
    for wid, url, tp in workers:
        assert tp is not None
        slots.append(RankSlot(worker_id=wid, url=url, rank_offset=next_rank, tp_size=tp))
        next_rank += tp
    if world_size != next_rank:
        total = next_rank - rank_offset
        raise BadRequest(
            f"world_size {world_size} does not match the fleet: {len(workers)} worker(s) hold {total} rank(s) "
            f"starting at rank_offset {rank_offset}, so world_size must be {next_rank}",
            expected_world_size=next_rank,
        )
    return slots


class GroupInitializer:
    """``/init_weights_update_group`` through the router: plan, then one concurrent init per worker.

    The group's rendezvous needs every rank at once, so the per-worker calls go
    out together, each with its own ``rank_offset``; a worker whose init fails or
    times out keeps every target disabled (fail closed) until an operator
    re-enables it.
    """

    def __init__(self, ctx: AdminContext):
        self._ctx = ctx

    async def world_size(self) -> WorldSizeResponse:
        """The ranks the live fleet takes now (it changes at once when a worker joins or leaves),
        and whether each group the router built still matches it."""
        targets = self._ctx.live_targets()
        await self._ctx.refresh_versions([w for w in targets if w.tp_size is None])
        slots = plan_ranks(
            [(w.id, w.url, w.tp_size) for w in targets],
            world_size=DEFAULT_RANK_OFFSET + total_worker_ranks([w.tp_size for w in targets]),
        )
        return WorldSizeResponse(
            world_size=sum(s.tp_size for s in slots),
            workers=[s.assignment() for s in slots],
            groups=self._ctx.groups.views(targets),
        )

    async def init(self, req: InitWeightsUpdateGroupRequest, headers: dict[str, str]) -> Outcome:
        async with AdminRun.open(INIT, self._ctx) as run:
            targets = self._ctx.live_targets()
            # Every target's process is read before it joins: the group record names those processes.
            await self._ctx.refresh_versions(targets)
            slots = plan_ranks(
                [(w.id, w.url, w.tp_size) for w in targets], world_size=req.world_size, rank_offset=req.rank_offset
            )
            per_worker = {s.worker_id: req.model_copy(update={"rank_offset": s.rank_offset}) for s in slots}
            call = AdminCall(
                INIT, "POST", req, headers, timeout_s=INIT.router_wait(req), request_for=lambda w: per_worker[w.id]
            )
            await run.fence_targets(targets)
            results = await run.fan_out(targets, call)
            ranks = [s.assignment() for s in slots]
            outcome = await run.settle(results, ranks=ranks)
            if outcome.status == 200:
                await self._ctx.groups.built(req.group_name, req.world_size, ranks, targets)
            else:
                await self._ctx.groups.dropped(req.group_name)
            return outcome
