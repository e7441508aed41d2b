"""The generic admin broadcast: any operation of the table without fleet semantics of its own.

Targets are every worker that is not dead, disabled ones included (a disabled
worker must still receive the update that makes it consistent again). The
operation runs in the one shape of :mod:`router.gateway.admin.locked`.
"""

from __future__ import annotations

from router.gateway.admin.answers import Outcome
from router.gateway.admin.fanout import AdminCall
from router.gateway.admin.locked import AdminContext, AdminRun
from router.gateway.admin.operations import Operation


async def broadcast(ctx: AdminContext, op: Operation, call: AdminCall) -> Outcome:
    """Lock if serialized, fence if fenced, fan out, settle; refresh versions after a weight change."""
    async with AdminRun.open(op, ctx) as run:
        targets = ctx.live_targets()
        await run.fence_targets(targets)
        results = await run.fan_out(targets, call)
        outcome = await run.settle(results)
        if op.changes_weights:
            await ctx.record_weight_change(targets, results)
        return outcome
