"""Rank assignment for one weight-update group spanning the trainer and every worker.

The trainer is rank 0 (or holds ranks ``0 .. rank_offset-1``); each worker
takes ``tp_size`` consecutive ranks starting at its own ``rank_offset``, in
registry order. Giving every worker the caller's single ``rank_offset`` (what a
plain SGLang router would forward) makes ranks collide and hangs the
rendezvous, so the router rewrites it per worker.

Both dialects build the group the same way: SGLang's ``/init_weights_update_group``
and vLLM's ``/init_weight_transfer_engine`` (whose fields sit in ``init_info``).
A :class:`GroupJoin` is either request seen as the plan needs it: group name,
world size, first rank, and the body each worker gets with its own offset.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from router.contract.errors import BadRequest, Unavailable
from router.contract.fleet import RankAssignment, WorldSizeResponse
from router.contract.vllm import InitWeightTransferEngineRequest, VllmResult
from router.contract.weight_sync import DEFAULT_RANK_OFFSET, InitWeightsUpdateGroupRequest, WeightSyncResponse
from router.gateway.admin.answers import Outcome
from router.gateway.admin.fanout import AdminCall
from router.gateway.admin.locked import AdminContext, AdminRun
from router.gateway.admin.operations import INIT_GROUP, INIT_WEIGHT_TRANSFER, Operation
from router.gateway.fleet.groups import GroupDialect

#: A group init of either dialect: SGLang's ``/init_weights_update_group``, vLLM's ``/init_weight_transfer_engine``.
JoinRequest = TypeVar("JoinRequest", InitWeightsUpdateGroupRequest, InitWeightTransferEngineRequest)
#: Its answer: both say whether the worker began to join (``join_attempted``).
JoinAnswer = TypeVar("JoinAnswer", WeightSyncResponse, VllmResult)


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


@dataclass(frozen=True, slots=True)
class GroupJoin(Generic[JoinRequest, JoinAnswer]):
    """One group init, whichever dialect asked for it: what the rank plan reads, and each worker's body."""

    op: Operation[JoinRequest, JoinAnswer]
    request: JoinRequest
    dialect: GroupDialect
    group_name: str
    world_size: int
    rank_offset: int
    timeout_s: float | None
    """The caller's bound on the join (the workers' default when ``None``)."""
    with_rank_offset: Callable[[int], JoinRequest]
    """The request one worker gets: the caller's, with that worker's own first rank."""

    @staticmethod
    def sglang(req: InitWeightsUpdateGroupRequest) -> GroupJoin[InitWeightsUpdateGroupRequest, WeightSyncResponse]:
        return GroupJoin(
            op=INIT_GROUP,
            request=req,
            dialect="sglang",
            group_name=req.group_name,
            world_size=req.world_size,
            rank_offset=req.rank_offset,
            timeout_s=req.timeout_s,
            with_rank_offset=lambda offset: req.model_copy(update={"rank_offset": offset}),
        )

    @staticmethod
    def vllm(req: InitWeightTransferEngineRequest) -> GroupJoin[InitWeightTransferEngineRequest, VllmResult]:
        info = req.init_info

        def with_rank_offset(offset: int) -> InitWeightTransferEngineRequest:
            return req.model_copy(update={"init_info": info.model_copy(update={"rank_offset": offset})})

        return GroupJoin(
            op=INIT_WEIGHT_TRANSFER,
            request=req,
            dialect="vllm",
            group_name=info.group_name,
            world_size=info.world_size,
            rank_offset=info.rank_offset,
            timeout_s=info.timeout_s,
            with_rank_offset=with_rank_offset,
        )

    def router_wait(self) -> float:
        return self.op.endpoint.budget.router_wait(self.timeout_s)


class GroupInitializer:
    """``/init_weights_update_group`` through the router: plan, then one concurrent init per worker.

    The group's rendezvous needs every rank at once, so the per-worker calls go
    out together, each with its own ``rank_offset``; a worker whose init fails or
    times out keeps every target disabled (fail closed) until an operator
    re-enables it.
    """

    def __init__(self, ctx: AdminContext) -> None:
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

    async def init(self, join: GroupJoin[JoinRequest, JoinAnswer], headers: dict[str, str]) -> Outcome[JoinAnswer]:
        async with AdminRun.open(join.op, self._ctx) as run:
            targets = self._ctx.live_targets(serving=join.op.path)
            # Every target's process is read before it joins: the group record names those processes.
            await self._ctx.refresh_versions(targets)
            slots = plan_ranks(
                [(w.id, w.url, w.tp_size) for w in targets], world_size=join.world_size, rank_offset=join.rank_offset
            )
            per_worker = {s.worker_id: join.with_rank_offset(s.rank_offset) for s in slots}
            call = AdminCall(
                join.op,
                "POST",
                join.request,
                headers,
                timeout_s=join.router_wait(),
                request_for=lambda w: per_worker[w.id],
            )
            await run.fence_targets(targets)
            results = await run.fan_out(targets, call)
            ranks = [s.assignment() for s in slots]
            # A failed join may leave a half-built group behind: only a refusal before any join began
            # (``join_attempted: false``) leaves its worker as it was.
            joined = [r.worker for r in results if not r.success and _join_attempted(r.body)]
            outcome = await run.settle(results, uncertain=joined, ranks=ranks)
            if outcome.status == 200:
                await self._ctx.groups.built(join.group_name, join.world_size, ranks, targets, dialect=join.dialect)
            else:
                await self._ctx.groups.dropped(join.group_name)
            return outcome


def _join_attempted(body: WeightSyncResponse | VllmResult | None) -> bool:
    """Whether a worker's answer to an init leaves open that it began to join (it says so, or says nothing)."""
    return body is None or body.join_attempted is not False
