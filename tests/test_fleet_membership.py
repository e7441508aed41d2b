"""Elastic-fleet policy, driven directly (no worker processes): which changes make a
weight-update group stale, the group records across a router restart, a worker
whose pod departs mid-update failing that update closed, and discovery's changes
waiting for the admin update lock.

Workers here are loopback addresses where nothing listens (127.0.0.2 …), so a
probe of one is refused at once.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from router.contract.admin import UpdateWeightVersionResult
from router.contract.errors import Conflict
from router.contract.fleet import RankAssignment
from router.contract.fleet_answers import WorkerResult
from router.gateway.admin.fanout import FanOut
from router.gateway.admin.journal import UpdateJournal
from router.gateway.admin.locked import AdminContext, AdminRun, LockHold
from router.gateway.admin.operations import OPERATIONS
from router.gateway.admin.update_gate import UpdateGate
from router.gateway.discovery.k8s import PodWorker
from router.gateway.discovery.reconcile import DiscoveredFleet
from router.gateway.fleet.groups import WeightGroups, membership_changes
from router.gateway.fleet.registry import Worker, WorkerRegistry
from router.gateway.fleet.weights import FleetWeights
from router.gateway.health import HealthChecker, WorkerProber
from router.gateway.metrics import RouterMetrics
from router.gateway.upstream import WorkerClient

URLS = [f"http://127.0.0.{i}:9" for i in (2, 3, 4)]


def fleet_of(n: int) -> WorkerRegistry:
    registry = WorkerRegistry()
    for i, url in enumerate(URLS[:n]):
        worker = registry.add(url)
        worker.instance_id, worker.tp_size, worker.health = f"proc-{i}", 1, "healthy"
    return registry


def ranks(workers: list[Worker]) -> list[RankAssignment]:
    return [RankAssignment(worker=w.id, url=w.url, rank_offset=1 + i, tp_size=1) for i, w in enumerate(workers)]


async def built(groups: WeightGroups, registry: WorkerRegistry) -> list[Worker]:
    members = list(registry)
    await groups.built("g", len(members) + 1, ranks(members), members)
    return members


class TestGroupMembership:
    async def test_matching_fleet_passes_and_each_kind_of_change_is_named(self) -> None:
        registry = fleet_of(3)
        groups = WeightGroups(None)
        a, b, c = await built(groups, registry)
        groups.check("g", list(registry))  # unchanged: no refusal
        assert membership_changes(groups.get("g"), [a, b]) == [f"{c.id} left the fleet (removed or dead)"]  # type: ignore[arg-type]
        newcomer = Worker(id="w-new", url="http://127.0.0.5:9", instance_id="proc-9")
        assert membership_changes(groups.get("g"), [a, b, c, newcomer]) == ["w-new joined the fleet"]  # type: ignore[arg-type]
        b.instance_id = "proc-restarted"
        with pytest.raises(Conflict) as refused:
            groups.check("g", [a, b, c])
        assert refused.value.status == 409 and f"{b.id} restarted" in refused.value.message
        assert refused.value.extra["group_changes"] == [f"{b.id} restarted (its new process is not in the group)"]
        # The group's leave goes only to the processes that joined: the restarted one would refuse it (400).
        assert groups.members_among("g", [a, b, c]) == [a, c]

    async def test_an_unknown_group_is_left_to_the_workers(self) -> None:
        registry = fleet_of(2)
        groups = WeightGroups(None)
        await built(groups, registry)
        groups.check("other", list(registry)[:1])
        assert groups.members_among("other", list(registry)) == list(registry)

    async def test_records_survive_a_router_restart_and_destroy_forgets_them(self, tmp_path: Path) -> None:
        registry = fleet_of(2)
        groups = WeightGroups(tmp_path)
        await built(groups, registry)
        again = WeightGroups(tmp_path)
        (view,) = again.views(list(registry))
        assert (
            view.matches_fleet and view.world_size == 3 and [m.worker for m in view.members] == [w.id for w in registry]
        )
        with pytest.raises(Conflict):
            again.check("g", list(registry)[:1])
        await again.dropped("g")
        assert WeightGroups(tmp_path).get("g") is None

    async def test_an_unreadable_record_checks_nothing(self, tmp_path: Path) -> None:
        (tmp_path / "weight_groups.json").write_text("{not json")
        assert WeightGroups(tmp_path).get("g") is None


@pytest.fixture
async def ctx() -> Any:
    registry = fleet_of(2)
    workers = WorkerClient(stream_limit=8, connect_timeout_s=1.0)
    yield AdminContext(
        registry=registry,
        gate=UpdateGate(0.2),
        journal=UpdateJournal(None),
        metrics=RouterMetrics(registry),
        fanout=FanOut(workers),
        prober=WorkerProber(workers, timeout_s=1.0),
        groups=WeightGroups(None),
    )
    await workers.close()


def ok(worker: Worker) -> WorkerResult[Any]:
    body = UpdateWeightVersionResult(success=True, message="ok")
    return WorkerResult(worker=worker.id, url=worker.url, success=True, status_code=200, body=body, elapsed_ms=1.0)


async def test_a_target_whose_pod_departs_mid_update_fails_it_closed(ctx: AdminContext) -> None:
    stays, departs = list(ctx.registry)
    op = OPERATIONS["/update_weight_version"]
    async with AdminRun.open(op, ctx) as run:
        await run.fence_targets([stays, departs])
        departs.departed = "discovery no longer lists its pod"
        outcome = await run.settle([ok(stays), ok(departs)])
    assert outcome.status == 502
    assert departs.disabled and not stays.disabled
    assert ctx.journal.names(departs.id) and not ctx.journal.names(stays.id)
    assert not ctx.registry.is_routable(departs)


async def test_discovery_changes_wait_for_the_update_lock(ctx: AdminContext) -> None:
    registry = ctx.registry
    refused = asyncio.Event()  # set when discovery's wait for the lock ran out (it then waits again)

    def on_wait(operation: str, _waited_s: float, acquired: bool) -> None:
        if operation == "service_discovery" and not acquired:
            refused.set()

    gate = UpdateGate(0.2, on_wait=on_wait)
    health = HealthChecker(registry, ctx.prober, interval_s=3600)
    discovered = DiscoveredFleet(registry, gate, ctx.journal, health)
    runner = asyncio.create_task(discovered.run())
    try:
        pod_a, pod_b = PodWorker(URLS[2], "ns/a"), PodWorker("http://127.0.0.6:9", "ns/b")
        discovered.offer({pod_a.url: pod_a})
        await asyncio.wait_for(discovered.applied.wait(), 5)
        added = registry.find(pod_a.url)
        assert added is not None and added.source == "discovery" and added.pod == "ns/a"

        hold = await LockHold.take(gate, "prepare_weights_update")  # an update holds the lock
        discovered.offer({pod_b.url: pod_b})
        # Departure is immediate (no traffic, the update fails it) but the registry waits.
        assert added.departed is not None and not registry.is_routable(added)
        await asyncio.wait_for(refused.wait(), 5)  # discovery tried for the lock and was kept out
        assert registry.find(pod_a.url) is added and registry.find(pod_b.url) is None
        assert not discovered.applied.is_set()
        hold.release()
        await asyncio.wait_for(discovered.applied.wait(), 5)
        assert registry.find(pod_a.url) is None and added.removed
        assert registry.find(pod_b.url) is not None
        # Static workers are the operator's: discovery never removes them.
        assert [w.url for w in registry if w.source == "static"] == URLS[:2]
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


async def test_a_pod_that_returns_before_removal_is_no_longer_departed(ctx: AdminContext) -> None:
    health = HealthChecker(ctx.registry, ctx.prober, interval_s=3600)
    discovered = DiscoveredFleet(ctx.registry, ctx.gate, ctx.journal, health)
    runner = asyncio.create_task(discovered.run())
    try:
        pod = PodWorker(URLS[2], "ns/a")
        discovered.offer({pod.url: pod})
        await asyncio.wait_for(discovered.applied.wait(), 5)
        hold = await LockHold.take(ctx.gate, "prepare_weights_update")
        discovered.offer({})
        worker = ctx.registry.find(pod.url)
        assert worker is not None and worker.departed is not None
        discovered.offer({pod.url: pod})  # Ready again (a readiness flap) while the update runs
        assert worker.departed is None
        hold.release()
        await asyncio.wait_for(discovered.applied.wait(), 5)
        assert ctx.registry.find(pod.url) is worker
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


def test_fleet_weights_keep_a_returning_pod_pending_only_when_its_process_changed() -> None:
    """Holders are per worker id and process: the same process back at the same address serves at once,
    a new process there (a restarted pod reusing the IP) is pending."""
    registry = fleet_of(1)
    (worker,) = list(registry)
    registry.fleet = FleetWeights(None)
    asyncio.run(registry.fleet.changed([(worker.id, worker.weights)]))
    assert registry.pending_reason(worker) is None
    worker.instance_id = "a-new-process"
    assert registry.pending_reason(worker) is not None
