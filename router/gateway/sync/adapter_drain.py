"""Taking adapters out of routing and waiting for the requests that name them to end, before they are unloaded.

An unload (:mod:`router.gateway.sync.adapters`) and a drop of old versions
(:mod:`router.gateway.sync.adapter_versions`) first stop routing the adapters; requests admitted before that
are counted by every process that routes (:attr:`~router.gateway.fleet.adapters.FleetAdapters.in_flight`),
the data planes' counts arriving in their periodic reports. This waits, bounded, until none is left.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection

from router.gateway.admin.locked import AdminContext

#: How long an unload waits for the requests naming its adapter to end before it unloads anyway.
UNLOAD_DRAIN_S = 30.0
#: How long an unload waits, once routing stopped, before it trusts the data planes' counts of requests in
#: flight: longer than their report period (0.25 s) and its delivery, so a request admitted just before the
#: stop has been counted.
REPORTS_CATCH_UP_S = 0.75
#: How often an unload looks at those counts.
DRAIN_POLL_S = 0.05


async def stop_routing(ctx: AdminContext, names: Collection[str], refused: str) -> None:
    """Stop routing ``names`` in every process that routes (the fence barrier); when a process has not applied it
    within its bound, route them again and raise (``refused`` says what was refused), so nothing was unloaded."""
    adapters = ctx.registry.adapters
    for name in names:
        adapters.stop_serving(name)
    ctx.barrier.announce()
    await adapters.save()
    try:
        await ctx.barrier.confirm(refused)
    except BaseException:
        for name in names:
            adapters.resume_serving(name)
        ctx.barrier.announce()
        await adapters.save()
        raise


async def drain(ctx: AdminContext, names: Collection[str]) -> None:
    """Wait for the requests naming any of ``names`` to end, within :data:`UNLOAD_DRAIN_S`. Past the bound the
    caller unloads anyway: an omni-worker finishes a request with the adapter it started with."""
    adapters = ctx.registry.adapters
    await asyncio.sleep(REPORTS_CATCH_UP_S)
    deadline = time.monotonic() + UNLOAD_DRAIN_S
    # Counts that data planes report, not an event this process could wait on: polled.
    while any(adapters.in_flight(name) for name in names):
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(DRAIN_POLL_S)
