"""The operator-facing state in ``GET /metrics``: the update journal's entry, the workers it fences,
pending workers, the leader gate's role and takeovers, and the data planes' restarts.

Each test builds the real objects (a worker registry, a journal in a temporary state directory, a
leader gate, a data-plane supervisor that is never started), sets a state, and reads the
exposition as Prometheus would.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router.gateway import keys, leadership
from router.gateway.admin.journal import UpdateJournal
from router.gateway.data_planes.metrics_merge import merge
from router.gateway.data_planes.supervisor import DataPlaneSupervisor
from router.gateway.fleet.registry import Worker, WorkerRegistry
from router.gateway.leader.elector import LeaseElector
from router.gateway.leader.gate import LeaderGate
from router.gateway.leader.pod_label import PodRole
from router.gateway.metrics import RouterMetrics

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

#: The series this file is about; the others are checked elsewhere (tests/test_observability.py).
STATE_SERIES = (
    "omni_router_update_journal_pending",
    "omni_router_update_journal_targets",
    "omni_router_worker_fenced",
    "omni_router_worker_pending",
    "omni_router_leader_role",
    "omni_router_leader_transitions_total",
    "omni_router_data_plane_restarts_total",
)


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(metrics: RouterMetrics) -> Samples:
    return parse(generate_latest(metrics.registry).decode())


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def state_series(samples: Samples) -> set[str]:
    return {name for name, _ in samples if name in STATE_SERIES}


class FakeLease:
    """The election as the gate and :func:`leadership.lead` see it: the lease is taken at once and
    held until :attr:`lost` is set."""

    identity, holder = "router-a", "router-a"

    def __init__(self) -> None:
        self.lost = asyncio.Event()

    def seconds_until_free(self) -> float:
        return 10.0

    def holds_lease(self) -> bool:
        return not self.lost.is_set()

    async def acquire(self) -> None:
        return None

    async def hold(self) -> str:
        await self.lost.wait()
        return "the lease was taken by another replica"


class PodLabel:
    """The pod's role label (--leader-pod-label), set once the gate has opened."""

    def __init__(self) -> None:
        self.leading = asyncio.Event()

    def set(self, role: str) -> None:
        if role == "leader":
            self.leading.set()


def serving(registry: WorkerRegistry, *ports: int) -> list[Worker]:
    workers = [registry.add(f"http://127.0.0.1:{port}", engine="omni") for port in ports]
    for n, w in enumerate(workers):
        w.health, w.weight_state, w.weight_version, w.instance_id = "healthy", "serving", "v1", f"i-{n}"
    return workers


async def test_a_failed_update_fences_the_worker_it_names_until_resolved(tmp_path: Path) -> None:
    registry, journal = WorkerRegistry(), UpdateJournal(tmp_path)
    a, b = serving(registry, 1, 2)
    metrics = RouterMetrics(registry, journal=journal)

    idle = scrape(metrics)
    assert value(idle, "omni_router_update_journal_pending", state="in_flight") == 0
    assert value(idle, "omni_router_update_journal_pending", state="failed") == 0
    assert value(idle, "omni_router_update_journal_targets") == 0
    assert [value(idle, "omni_router_worker_fenced", worker=w.id) for w in (a, b)] == [0, 0]

    await journal.begin("/update_weights_from_disk", [(a.id, a.url, False), (b.id, b.url, False)])
    running = scrape(metrics)
    assert value(running, "omni_router_update_journal_pending", state="in_flight") == 1
    assert value(running, "omni_router_update_journal_pending", state="failed") == 0
    assert value(running, "omni_router_update_journal_targets") == 2
    assert [value(running, "omni_router_worker_fenced", worker=w.id) for w in (a, b)] == [1, 1]

    await journal.fail([b.id], "b answered 500")
    failed = scrape(metrics)
    assert value(failed, "omni_router_update_journal_pending", state="in_flight") == 0
    assert value(failed, "omni_router_update_journal_pending", state="failed") == 1
    assert value(failed, "omni_router_update_journal_targets") == 1
    assert value(failed, "omni_router_worker_fenced", worker=a.id) == 0
    assert value(failed, "omni_router_worker_fenced", worker=b.id) == 1

    # What POST /weight_update_journal/resolve and re-enabling the last fenced worker do.
    assert await journal.discard_target(b.id)
    assert journal.pending is None
    resolved = scrape(metrics)
    assert value(resolved, "omni_router_update_journal_pending", state="in_flight") == 0
    assert value(resolved, "omni_router_update_journal_pending", state="failed") == 0
    assert value(resolved, "omni_router_update_journal_targets") == 0
    assert [value(resolved, "omni_router_worker_fenced", worker=w.id) for w in (a, b)] == [0, 0]


async def test_an_entry_left_by_a_previous_run_is_exported_as_failed(tmp_path: Path) -> None:
    """A router that died mid-update: the next start reads the entry as failed, fencing every target."""
    first = UpdateJournal(tmp_path)
    registry = WorkerRegistry()
    (a,) = serving(registry, 1)
    await first.begin("/update_weights_from_disk", [(a.id, a.url, False)])

    journal = UpdateJournal(tmp_path)
    journal.load()
    samples = scrape(RouterMetrics(registry, journal=journal))
    assert value(samples, "omni_router_update_journal_pending", state="failed") == 1
    assert value(samples, "omni_router_update_journal_targets") == 1
    assert value(samples, "omni_router_worker_fenced", worker=a.id) == 1

    await journal.clear()
    cleared = scrape(RouterMetrics(registry, journal=UpdateJournal(tmp_path)))
    assert value(cleared, "omni_router_update_journal_pending", state="failed") == 0
    assert value(cleared, "omni_router_worker_fenced", worker=a.id) == 0


async def test_a_worker_off_the_fleets_weights_is_pending(tmp_path: Path) -> None:
    registry = WorkerRegistry()
    holder, joiner = serving(registry, 1, 2)
    metrics = RouterMetrics(registry, journal=UpdateJournal(tmp_path))
    # Boot weights are the fleet's until a weight change is recorded.
    assert [value(scrape(metrics), "omni_router_worker_pending", worker=w.id) for w in (holder, joiner)] == [0, 0]

    holder.weight_version = "v2"
    await registry.fleet.changed([(holder.id, holder.weights)], targets=[holder.id])
    samples = scrape(metrics)
    assert registry.pending_reason(joiner) is not None
    assert value(samples, "omni_router_worker_pending", worker=holder.id) == 0
    assert value(samples, "omni_router_worker_pending", worker=joiner.id) == 1
    assert value(samples, "omni_router_routable_workers") == 1

    joiner.weight_version = "v2"  # caught up from the holder, as --sync-joiners peer records it
    assert await registry.fleet.caught_up(joiner.id, joiner.weights, registry.fleet.latest_sequence)
    assert registry.pending_reason(joiner) is None
    assert value(scrape(metrics), "omni_router_worker_pending", worker=joiner.id) == 0

    # Paused although the router did not pause it: pending too, though its weights are current.
    joiner.reported_paused = True
    assert value(scrape(metrics), "omni_router_worker_pending", worker=joiner.id) == 1


async def test_the_leader_role_and_the_takeover_it_counts(monkeypatch: Any) -> None:
    """The gate's role as it moves (standby, taking over, leader, stepped down), and one transition
    counted by :func:`leadership.lead` when the gate opens."""
    lease = FakeLease()
    gate = LeaderGate(lease)
    metrics = RouterMetrics(WorkerRegistry(), leader=gate)
    app = cast(web.Application, {keys.METRICS: metrics})

    def role(samples: Samples) -> dict[str, float | None]:
        roles = ("standby", "taking_over", "leader", "stepped_down")
        return {name: value(samples, "omni_router_leader_role", role=name) for name in roles}

    standby = scrape(metrics)
    assert role(standby) == {"standby": 1, "taking_over": 0, "leader": 0, "stepped_down": 0}
    assert value(standby, "omni_router_leader_transitions_total") == 0

    reading = asyncio.Event()
    read = asyncio.Event()

    async def take_over(_app: web.Application) -> None:
        reading.set()
        await read.wait()

    monkeypatch.setattr(leadership, "take_over", take_over)
    exits: list[str] = []
    label = PodLabel()
    leading = asyncio.create_task(
        leadership.lead(app, cast(LeaseElector, lease), gate, exit_process=exits.append, role=cast(PodRole, label))
    )
    await reading.wait()
    taking_over = scrape(metrics)
    assert role(taking_over)["taking_over"] == 1
    assert value(taking_over, "omni_router_leader_transitions_total") == 0

    read.set()
    await asyncio.wait_for(label.leading.wait(), 5)
    leader = scrape(metrics)
    assert role(leader) == {"standby": 0, "taking_over": 0, "leader": 1, "stepped_down": 0}
    assert value(leader, "omni_router_leader_transitions_total") == 1

    lease.lost.set()
    await leading
    assert exits == ["the lease was taken by another replica"]
    gone = scrape(metrics)
    assert role(gone) == {"standby": 0, "taking_over": 0, "leader": 0, "stepped_down": 1}
    assert value(gone, "omni_router_leader_transitions_total") == 1


def test_data_plane_restarts_are_the_supervisors(tmp_path: Path) -> None:
    metrics = RouterMetrics(WorkerRegistry())
    assert "omni_router_data_plane_restarts_total" not in state_series(scrape(metrics))
    supervisor = DataPlaneSupervisor([], 2, str(tmp_path / "control.sock"), grace_s=1.0)
    metrics.control.data_planes = supervisor
    assert value(scrape(metrics), "omni_router_data_plane_restarts_total") == 0
    supervisor.restarts += 3
    assert value(scrape(metrics), "omni_router_data_plane_restarts_total") == 3


def test_without_a_journal_gate_or_supervisor_none_of_it_is_exported() -> None:
    registry = WorkerRegistry()
    serving(registry, 1)
    assert state_series(scrape(RouterMetrics(registry))) == {"omni_router_worker_pending"}


async def test_with_data_planes_the_state_is_exported_once(tmp_path: Path) -> None:
    """A data plane exports none of it; the control process's merge of every data plane's series into
    its own (which sums samples) therefore reports each value once, not once per process."""
    registry, journal = WorkerRegistry(), UpdateJournal(tmp_path)
    a, b = serving(registry, 1, 2)
    gate = LeaderGate(FakeLease())
    gate.open()
    control = RouterMetrics(registry, journal=journal, leader=gate)
    control.control.leader_transitions = 1
    supervisor = DataPlaneSupervisor([], 2, str(tmp_path / "control.sock"), grace_s=1.0)
    supervisor.restarts = 2
    control.control.data_planes = supervisor
    await journal.begin("/update_weights_from_disk", [(b.id, b.url, False)])
    await journal.fail([b.id], "b answered 500")

    # A data plane's metrics, built as create_data_plane_app builds them (even if handed the same objects).
    planes = [RouterMetrics(WorkerRegistry(), fleet_gauges=False, journal=journal, leader=gate) for _ in range(2)]
    for plane in planes:
        plane.control.leader_transitions = 1
        plane.control.data_planes = supervisor
        assert state_series(scrape(plane)) == set()

    merged = parse(merge(control.registry.collect(), [plane.render().decode() for plane in planes]).decode())
    assert state_series(merged) == set(STATE_SERIES)
    assert value(merged, "omni_router_update_journal_pending", state="failed") == 1
    assert value(merged, "omni_router_update_journal_targets") == 1
    assert value(merged, "omni_router_worker_fenced", worker=b.id) == 1
    assert value(merged, "omni_router_worker_fenced", worker=a.id) == 0
    assert value(merged, "omni_router_leader_role", role="leader") == 1
    assert value(merged, "omni_router_leader_transitions_total") == 1
    assert value(merged, "omni_router_data_plane_restarts_total") == 2
