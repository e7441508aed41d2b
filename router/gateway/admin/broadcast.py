"""The generic admin broadcast: any operation of the table without fleet semantics of its own.

Targets are every worker that is not dead, disabled ones included (a disabled
worker must still receive the update that makes it consistent again). The
operation runs in the one shape of :mod:`router.gateway.admin.locked`. An
update over a weight-update group is refused (409) when the fleet no longer
matches the group; a group's destroy goes to its members only. A targeted call
(:attr:`~router.gateway.admin.fanout.AdminCall.only`) locks, fences, journals and settles its
live targets only; one that cannot target a subset (:attr:`Operation.targetable`) is refused
(400) unless it names every live worker.
"""

from __future__ import annotations

from typing import TypeVar

from router.contract import endpoints as ep
from router.contract.base import WireRequest, WireResponse
from router.contract.errors import BadRequest
from router.gateway.admin.answers import Outcome
from router.gateway.admin.fanout import AdminCall
from router.gateway.admin.locked import AdminContext, AdminRun
from router.gateway.admin.operations import Operation
from router.gateway.admin.stale_at_pause import drop_stale
from router.gateway.engines import engine_of
from router.gateway.fleet.groups import group_name_of
from router.gateway.fleet.weights import checkpoint_of

RELABEL = ep.UPDATE_WEIGHT_VERSION.path

Req = TypeVar("Req", bound=WireRequest)
Resp = TypeVar("Resp", bound=WireResponse)


async def broadcast(ctx: AdminContext, op: Operation[Req, Resp], call: AdminCall[Req, Resp]) -> Outcome[Resp]:
    """Lock if serialized, fence if fenced, fan out, settle; refresh versions after a weight change."""
    async with AdminRun.open(op, ctx, only=call.only) as run:
        targets = ctx.live_targets(call.only, serving=op.path)
        if call.only is not None and not op.targetable and len(targets) != len(ctx.live_targets()):
            raise BadRequest(
                f"{op.path} spans every member of the fleet's weight-update group or held update; "
                "it cannot target a subset (target update_weights_from_disk or update_weights_from_tensor instead)"
            )
        group = group_name_of(call.request)
        if op.in_group:
            ctx.groups.check(group, targets)
        if op.ends_group:
            targets = ctx.groups.members_among(group, targets) or targets
        # A relabel vouches for no weights: only targets that held recorded ones keep holding them.
        fleet = ctx.registry.fleet
        vouched = (
            [w.id for w in targets if fleet.verified_sequence(w.id, w) is not None] if op.path == RELABEL else None
        )
        # With --verify-updates changed, what each target held before (read under the lock, before the fence).
        before = await run.read_digests(targets, call.headers) if run.checks_change(call.expect) else None
        await run.fence_targets(targets)
        await drop_stale(ctx.stale, op.path, targets)
        try:
            results = await run.fan_out(targets, call)
        finally:
            if op.ends_group:
                # Whatever the answers, the group no longer has a known membership.
                await ctx.groups.dropped(group)
        checked = await run.verify(results, call.expect, before, call.headers)
        outcome = await run.settle(results, **checked)
        freed = [r.worker for r in results if r.success and _discards_weights(ctx, r.worker, op.path, call.request)]
        if freed:
            await fleet.discarded(freed)
        if op.changes_weights:
            source = checkpoint_of(op.path, call.request, ctx.registry.fleet.record)
            await run.record_weight_change(targets, results, source_path=source, relabel_of=vouched)
        return outcome


def _discards_weights(ctx: AdminContext, worker_id: str, path: str, request: WireRequest) -> bool:
    worker = ctx.registry.find(worker_id)
    engine = engine_of(worker) if worker is not None else None
    return engine is not None and engine.discards_weights(path, request)
