"""Taking over as the leader, and stepping down (``--leader-election``).

::

    start-up          the gate is closed (standby); the worker registry, discovery and health probes run
    (--leader-pod-label: the pod is labelled ``standby`` at start-up, ``leader`` once the gate opens)
    lease taken       the gate says "taking over"; renewals start; every durable record is read again
                      from the store: the journal (an entry still ``in_flight`` becomes ``failed`` and its
                      targets are fenced, as after a crash), the fleet's weights, the weight-update
                      groups. Only then does the gate open
    lease lost        the gate closes at once, one line is logged and the process exits with status 1, as
                      client-go's controllers do: nothing it had in flight goes on beside a new leader.
                      Kubernetes restarts the container, which comes back as a standby
    SIGTERM (leader)  the server drains as usual while the lease is renewed; once the app is closed the
                      lease is released, so a standby takes over within a retry period

Why an update in flight during a failover is neither lost nor applied twice: its journal entry is in
the store before any worker is touched (:meth:`~router.gateway.admin.journal.UpdateJournal.begin`
refuses the update otherwise); a replica reads the store only once it holds the lease, so it finds
the entry and keeps the targets fenced until an operator resolves it; and every write to the store
is a compare-and-swap (:mod:`router.gateway.state.k8s_store`), so a deposed leader's late write is
refused instead of overwriting what the new leader wrote.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from aiohttp import web

from router.gateway import keys
from router.gateway.admin.journal import JOURNAL_FILE, keep_fenced
from router.gateway.config import RouterConfig
from router.gateway.fleet.adapters import ADAPTERS_FILE
from router.gateway.fleet.groups import GROUPS_FILE
from router.gateway.fleet.weights import FLEET_FILE
from router.gateway.leader.elector import LeaseElector, LeaseSettings, default_identity
from router.gateway.leader.gate import LeaderGate
from router.gateway.leader.pod_label import PodRole
from router.gateway.state.store import StateStore

log = logging.getLogger(__name__)

#: Every record a new leader reads before it serves.
RECORDS = (JOURNAL_FILE, FLEET_FILE, GROUPS_FILE, ADAPTERS_FILE)


@dataclass(frozen=True, slots=True)
class Leadership:
    """The elector and the gate it drives (closed until the lease is taken and the state read)."""

    elector: LeaseElector
    gate: LeaderGate

    @classmethod
    def for_config(cls, config: RouterConfig) -> Leadership:
        elector = LeaseElector(
            LeaseSettings(
                name=config.leader_lease_name,
                identity=config.leader_identity or default_identity(),
                duration_s=config.leader_lease_duration_s,
                renew_deadline_s=config.leader_renew_deadline_s,
                retry_period_s=config.leader_retry_period_s,
            )
        )
        return cls(elector, LeaderGate(elector))

    def install(self, app: web.Application) -> None:
        """Run the election with the app. Call it after every other cleanup context is added: the takeover
        needs what they build, and the lease is released after all of them have closed."""
        app[keys.ELECTOR] = self.elector
        app[keys.LEADER_GATE] = self.gate
        app.cleanup_ctx.append(leadership_ctx)
        app.on_cleanup.append(release_lease)


async def leadership_ctx(app: web.Application) -> AsyncIterator[None]:
    """An aiohttp cleanup context: the election runs for as long as the app does."""
    elector = app[keys.ELECTOR]
    elector.open()
    label = app[keys.CONFIG].leader_pod_label
    role = PodRole(elector, label) if label is not None else None
    task = asyncio.create_task(lead(app, elector, app[keys.LEADER_GATE], role=role), name="leader-election")
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    if role is not None:
        await role.close()


async def release_lease(app: web.Application) -> None:
    """On the way out (after every cleanup context): hand the lease over at once rather than at expiry."""
    elector = app[keys.ELECTOR]
    try:
        await elector.release(bound_s=elector.settings.renew_deadline_s)
    finally:
        await elector.close()


async def lead(
    app: web.Application,
    elector: LeaseElector,
    gate: LeaderGate,
    *,
    exit_process: Callable[[str], None] | None = None,
    role: PodRole | None = None,
) -> None:
    """Wait for the lease, take over, serve while it is renewed; step down and exit when it is lost."""
    if role is not None:
        role.set("standby")
    await elector.acquire()
    gate.taking_over()
    holding = asyncio.create_task(elector.hold(), name="lease-renewal")
    takeover = asyncio.create_task(take_over(app), name="leader-takeover")
    why = ""
    try:
        await asyncio.wait({holding, takeover}, return_when=asyncio.FIRST_COMPLETED)
        if takeover.done() and takeover.exception() is None:
            gate.open()
            app[keys.METRICS].control.leader_transitions += 1
            log.info("leader %s: the fleet's state is read, serving the admin routes", elector.identity)
            if role is not None:
                role.set("leader")
            why = await holding
        elif takeover.done():
            why = f"taking over failed: {takeover.exception()!r}"
        else:
            why = holding.result()
    finally:
        for task in (holding, takeover):
            task.cancel()
        await asyncio.gather(holding, takeover, return_exceptions=True)
    gate.step_down()
    (exit_process or exit_now)(why)


async def take_over(app: web.Application) -> None:
    """Read every durable record again and apply it, before the gate opens (the reads run off the loop)."""
    state, registry, journal = app[keys.STATE], app[keys.REGISTRY], app[keys.JOURNAL]
    assert state.store is not None, "leader election needs a state store (config.validate)"
    await until_readable(state.store, RECORDS, retry_s=app[keys.ELECTOR].settings.retry_period_s)
    workers = [(w.id, w.url) for w in registry]
    keep_fenced(registry, await asyncio.to_thread(journal.reload, workers))
    await asyncio.to_thread(registry.fleet.reload)
    await asyncio.to_thread(app[keys.ADMIN].groups.reload)
    await asyncio.to_thread(registry.adapters.attach, state.record(ADAPTERS_FILE))


async def until_readable(store: StateStore, names: Sequence[str], *, retry_s: float) -> None:
    """Return once every record reads without an error; the gate stays closed meanwhile. Bounded by the
    lease: a leader that cannot reach the API server cannot renew either, and steps down."""
    for name in names:
        while True:
            try:
                await asyncio.to_thread(store.read, name)
                break
            except OSError as exc:
                log.warning("taking over: cannot read state record %s (%s); the gate stays closed, retrying", name, exc)
                await asyncio.sleep(retry_s)


def exit_now(why: str) -> NoReturn:
    """Leave at once, without the graceful drain: an admin call still running must not go on beside the new
    leader (its journal entry, already in the store, keeps its targets fenced there)."""
    log.error("lost the leadership (%s); exiting with status 1: Kubernetes restarts this replica as a standby", why)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(1)
