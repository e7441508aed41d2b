"""Prometheus metrics for the router (``GET /metrics``).

Per-worker gauges (in-flight, health, disabled, fenced, pending, weight version)
are sampled from the live registry at scrape time, so a removed worker stops
being reported at once instead of leaving a stale series behind; so are the
update journal's entry, the leader gate's role and the data planes' restarts.
Each app gets its own ``CollectorRegistry``, so several routers can live in one
process (tests).

With data-plane processes the control process sums every data plane's exposition
into its own, sample by sample (:mod:`router.gateway.data_planes.metrics_merge`):
a gauge that a data plane exported too would be added to the control process's
value. The fleet's and the control process's state is therefore exported by the
control process alone (``fleet_gauges``), which owns the registry, the journal,
the gate and the supervisor.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Protocol, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from router.contract.fleet import JournalState, LeaderRole, LeaderView
from router.gateway.fleet.registry import WorkerRegistry
from router.gateway.metrics_adapters import AdapterCollector

#: A bucket bound as Prometheus writes it (``+Inf``, ``0.005``); prometheus_client ships it unannotated.
_go_float: Callable[[float], str] = floatToGoString

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
_HEALTH_STATES = ("healthy", "unhealthy", "dead")
_JOURNAL_STATES = ("in_flight", "failed")
#: The roles a leader gate reports; ``single`` (no election) has no gate, and no gauge.
_LEADER_ROLES: tuple[str, ...] = tuple(role for role in get_args(LeaderRole) if role != "single")


class RestartCount(Protocol):
    """What the metrics read of the data-plane supervisor
    (:class:`~router.gateway.data_planes.supervisor.DataPlaneSupervisor`)."""

    @property
    def restarts(self) -> int: ...


class JournalSource(Protocol):
    """What the metrics read of the update journal (:class:`~router.gateway.admin.journal.UpdateJournal`, which
    sits above the metrics: its admin runs record into them)."""

    @property
    def pending(self) -> JournalState | None: ...

    def names(self, worker_id: str) -> bool: ...


class RoleSource(Protocol):
    """What the metrics read of the leader gate (:class:`~router.gateway.leader.gate.LeaderGate`)."""

    def view(self) -> LeaderView: ...


class _FleetCollector(Collector):
    def __init__(self, registry: WorkerRegistry, journal: JournalSource | None):
        self._registry = registry
        self._journal = journal

    def collect(self) -> Iterator[Metric]:
        inflight = GaugeMetricFamily(
            "omni_router_worker_inflight_requests", "Requests in flight per worker", labels=["worker", "url"]
        )
        health = GaugeMetricFamily(
            "omni_router_worker_health", "1 for the worker's current health state", labels=["worker", "state"]
        )
        disabled = GaugeMetricFamily(
            "omni_router_worker_disabled", "1 while the worker is out of routing", labels=["worker"]
        )
        version = GaugeMetricFamily(
            "omni_router_worker_weight_version_info",
            "Last known weight_version per worker",
            labels=["worker", "weight_version"],
        )
        routable = GaugeMetricFamily("omni_router_routable_workers", "Workers that may take /generate traffic")
        fleet = self._registry.fleet
        fleet_sequence = GaugeMetricFamily(
            "omni_router_fleet_sequence", "Sequence number of the fleet's current weights (0 before any change)"
        )
        fleet_sequence.add_metric([], fleet.latest_sequence)
        staleness = GaugeMetricFamily(
            "omni_router_worker_staleness",
            "Fleet versions the worker is behind the current one (-1: weights the router never recorded)",
            labels=["worker"],
        )
        paused = GaugeMetricFamily(
            "omni_router_worker_paused", "1 while the router's last pause broadcast holds the worker", labels=["worker"]
        )
        pending = GaugeMetricFamily(
            "omni_router_worker_pending",
            "1 while the worker is pending (GET /workers: pending): off the fleet's weights, or paused behind the "
            "router; its health and fencing aside",
            labels=["worker"],
        )
        journal = self._journal
        fenced = GaugeMetricFamily(
            "omni_router_worker_fenced",
            "1 while the update journal's unresolved entry names the worker (kept out of routing until resolved)",
            labels=["worker"],
        )
        retired = GaugeMetricFamily(
            "omni_router_retired_workers",
            "Workers whose catch-up the router gave up after --max-rejoin-attempts failures (pending, out of "
            "routing, until their process restarts)",
        )
        count = retired_count = 0
        for w in self._registry:
            retired_count += int(w.retired)
            pending.add_metric([w.id], 0.0 if self._registry.pending_reason(w) is None else 1.0)
            if journal is not None:
                fenced.add_metric([w.id], 1.0 if journal.names(w.id) else 0.0)
            sequence = fleet.verified_sequence(w.id, w)
            staleness.add_metric([w.id], -1.0 if sequence is None else fleet.latest_sequence - sequence)
            paused.add_metric([w.id], 1.0 if w.paused else 0.0)
            inflight.add_metric([w.id, w.url], w.inflight)
            for state in _HEALTH_STATES:
                health.add_metric([w.id, state], 1.0 if w.health == state else 0.0)
            disabled.add_metric([w.id], 1.0 if w.disabled else 0.0)
            version.add_metric([w.id, w.weight_version or ""], 1.0)
            count += int(self._registry.is_routable(w))
        routable.add_metric([], count)
        retired.add_metric([], retired_count)
        yield from (inflight, health, disabled, version, routable, fleet_sequence, staleness, paused, pending, retired)
        if journal is not None:
            yield fenced
            yield from _journal_families(journal)


def _journal_families(journal: JournalSource) -> Iterator[Metric]:
    """The unresolved entry: both states always (0 or 1), so an alert on it resolves instead of going stale."""
    entry = journal.pending
    state = GaugeMetricFamily(
        "omni_router_update_journal_pending",
        "1 for the state of the update journal's unresolved entry (in_flight: an update runs; failed: an operator "
        "must resolve it, and updates are refused with 409 until then)",
        labels=["state"],
    )
    for name in _JOURNAL_STATES:
        state.add_metric([name], 1.0 if entry is not None and entry.state == name else 0.0)
    yield state
    yield GaugeMetricFamily(
        "omni_router_update_journal_targets",
        "Workers the update journal's unresolved entry keeps fenced (0: no entry)",
        0 if entry is None else len(entry.targets),
    )


class ControlState(Collector):
    """The control process's own state: the leader gate's role, the times this replica took over, the
    data-plane processes its supervisor restarted. Read at scrape time like the fleet's gauges; each
    series exists only where its source does (no gate without --leader-election, no supervisor
    without --data-plane-processes)."""

    def __init__(self, leader: RoleSource | None):
        self.leader = leader
        self.leader_transitions = 0
        """Counted by :func:`router.gateway.leadership.lead` when the gate opens."""
        self.data_planes: RestartCount | None = None
        """The data-plane supervisor, set by the control process that runs one."""
        self._created = time.time()

    def collect(self) -> Iterator[Metric]:
        leader = self.leader
        if leader is not None:
            current = leader.view().role  # as /health says it: a leader past its renew deadline is stepping down
            role = GaugeMetricFamily(
                "omni_router_leader_role",
                "1 for this replica's current role under --leader-election (standby, taking_over, leader, "
                "stepped_down)",
                labels=["role"],
            )
            for name in _LEADER_ROLES:
                role.add_metric([name], 1.0 if current == name else 0.0)
            yield role
            transitions = CounterMetricFamily(
                "omni_router_leader_transitions",
                "Times this replica took the Lease and opened its gate (it leads once: losing the Lease exits)",
            )
            transitions.add_metric([], self.leader_transitions, created=self._created)
            yield transitions
        if self.data_planes is not None:
            restarts = CounterMetricFamily(
                "omni_router_data_plane_restarts",
                "Data-plane processes started again after one exited or was killed as unresponsive",
            )
            restarts.add_metric([], self.data_planes.restarts, created=self._created)
            yield restarts


class _RequestStats(Collector):
    """``omni_router_requests_total`` and ``omni_router_request_duration_seconds``, kept as plain
    counts and exported at scrape time.

    Every proxied request records both; prometheus_client's ``Counter.inc`` and
    ``Histogram.observe`` take a lock and walk the buckets each time, which cost a proxied request
    about as much as its routing. Here a request is two dictionary lookups, a bisect and three
    integer additions, on the event loop's one thread (the scrape runs there too)."""

    def __init__(self, buckets: tuple[float, ...]):
        self._bounds = buckets
        self._counts: dict[tuple[str, str, int], int] = {}
        # Per route: one count per bucket (the last is +Inf), and the sum of the durations.
        self._latency: dict[str, tuple[list[int], list[float]]] = {}
        self._created = time.time()

    def observe(self, route: str, method: str, status: int, duration_s: float) -> None:
        key = (route, method, status)
        self._counts[key] = self._counts.get(key, 0) + 1
        entry = self._latency.get(route)
        if entry is None:
            entry = self._latency[route] = ([0] * (len(self._bounds) + 1), [0.0])
        entry[0][bisect_left(self._bounds, duration_s)] += 1
        entry[1][0] += duration_s

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "omni_router_requests", "HTTP requests by route and status", labels=["route", "method", "status"]
        )
        for (route, method, status), count in sorted(self._counts.items()):
            requests.add_metric([route, method, str(status)], count, created=self._created)
        latency = HistogramMetricFamily(
            "omni_router_request_duration_seconds", "HTTP request latency by route", labels=["route"]
        )
        for route, (counts, total) in sorted(self._latency.items()):
            cumulative, buckets = 0, []
            for bound, count in zip((*self._bounds, float("inf")), counts, strict=True):
                cumulative += count
                buckets.append((_go_float(bound), cumulative))
            latency.add_metric([route], buckets, total[0])
        yield requests
        yield latency


class AffinityStats(Collector):
    """Session affinity's series (``--session-affinity``), kept as plain counts like the request
    stats: a pinned request is a hit, counted on the hot path. With data-plane processes the control
    process's table places every session and counts it; a data plane counts the placements it made
    from its own table because the control process did not answer in time."""

    def __init__(self) -> None:
        self.pinned = 0
        self.hits = 0
        self.new_pins = 0
        self.local_placements = 0
        self.reassignments: dict[str, int] = {}
        self._created = time.time()

    def reassigned(self, reason: str) -> None:
        self.reassignments[reason] = self.reassignments.get(reason, 0) + 1

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("omni_router_affinity_pinned_sessions", "Sessions pinned to a worker", self.pinned)
        hits = CounterMetricFamily("omni_router_affinity_hits", "Requests routed to their session's pinned worker")
        hits.add_metric([], self.hits, created=self._created)
        yield hits
        pins = CounterMetricFamily("omni_router_affinity_new_pins", "Sessions pinned to a worker for the first time")
        pins.add_metric([], self.new_pins, created=self._created)
        yield pins
        local = CounterMetricFamily(
            "omni_router_affinity_local_placements",
            "Sessions a data-plane process placed from its own table: the control process did not answer in time",
        )
        local.add_metric([], self.local_placements, created=self._created)
        yield local
        moved = CounterMetricFamily(
            "omni_router_affinity_reassignments",
            "Sessions moved to another worker, by reason",
            labels=["reason"],
        )
        for reason, count in sorted(self.reassignments.items()):
            moved.add_metric([reason], count, created=self._created)
        yield moved


class VersionPolicyStats(Collector):
    """The weight-version policy's series, plain counts like the request stats: a worker left out of a
    request's candidates is counted by reason, only when one is (a fleet where every worker is eligible
    costs nothing), and a request no worker could serve under its policy by the policy's kind."""

    def __init__(self) -> None:
        self.filtered: dict[str, int] = {}
        self.refused: dict[str, int] = {}
        self._created = time.time()

    def collect(self) -> Iterator[Metric]:
        filtered = CounterMetricFamily(
            "omni_router_candidates_filtered",
            "Workers left out of a request's candidates, by reason (paused, fenced, unhealthy, pending, stale, "
            "unversioned)",
            labels=["reason"],
        )
        for reason, count in sorted(self.filtered.items()):
            filtered.add_metric([reason], count, created=self._created)
        yield filtered
        refused = CounterMetricFamily(
            "omni_router_version_policy_refusals",
            "Requests answered 503 because no worker was eligible under their weight-version policy",
            labels=["policy"],
        )
        for kind, count in sorted(self.refused.items()):
            refused.add_metric([kind], count, created=self._created)
        yield refused


class RouterMetrics:
    """Every series the router exports, in one registry of its own."""

    def __init__(
        self,
        workers: WorkerRegistry,
        *,
        fleet_gauges: bool = True,
        journal: JournalSource | None = None,
        leader: RoleSource | None = None,
    ):
        """``fleet_gauges``: export the per-worker gauges and the control process's state (a data-plane
        process leaves them to its control process, which owns the registry, the journal and the gate,
        sums every process's load, and would otherwise add a data plane's copy to its own).
        ``journal``: the update journal whose entry, and the workers it fences, are exported.
        ``leader``: the leader gate (``--leader-election``) whose role is exported."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._requests = _RequestStats(_LATENCY_BUCKETS)
        r.register(self._requests)
        self.admin_ops = Counter(
            "omni_router_admin_operations_total",
            "Admin broadcasts by operation and outcome",
            ["operation", "outcome"],
            registry=r,
        )
        self.admin_duration = Histogram(
            "omni_router_admin_operation_duration_seconds",
            "Admin broadcast duration",
            ["operation", "outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.admin_phases = Histogram(
            "omni_router_admin_phase_seconds",
            "Where admin operations spend their time, by phase: lock_wait, fence_barrier, journal_write, fan_out, "
            "slowest_worker, settle, verification (router/gateway/admin/timings.py)",
            ["operation", "phase"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.lock_wait = Histogram(
            "omni_router_update_lock_wait_seconds",
            "Time spent waiting for the admin update lock",
            ["operation", "acquired"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "omni_router_generate_retries_total", "Proxy attempts retried on another worker", ["reason"], registry=r
        )
        self.upstream_errors = Counter(
            "omni_router_upstream_errors_total", "Proxy attempts that failed before a response", ["worker"], registry=r
        )
        self.client_aborts = Counter(
            "omni_router_client_disconnects_total", "Requests whose caller went away; aborted on the worker", registry=r
        )
        self.body_bytes_held = Gauge(
            "omni_router_request_body_bytes_held",
            "Bytes of generation request bodies the lean server holds (bounded by --body-budget-mb)",
            registry=r,
        )
        self.stream_stalls = Counter(
            "omni_router_stalled_callers_total",
            "Callers cut off because they read nothing of their answer for --stream-stall-timeout-s (a stream's "
            "request aborted on its worker)",
            registry=r,
        )
        self.stale_aborts = Counter(
            "omni_router_stale_requests_aborted_total",
            "Requests in flight dropped at a pause broadcast because the version being published puts their start "
            "version outside their version policy (aborted on their workers; their callers answered 409)",
            registry=r,
        )
        self.handed_connections = Counter(
            "omni_router_admin_connections_handed_total",
            "Callers' connections a data plane handed to the control process with their first admin call",
            registry=r,
        )
        self.catch_ups = Counter(
            "omni_router_catch_ups_total",
            "Pending workers loaded from a peer (--sync-joiners peer), by outcome",
            ["outcome"],
            registry=r,
        )
        self.adapter_requests = Counter(
            "omni_router_adapter_requests_total",
            "Generation requests routed naming a LoRA adapter, by adapter",
            ["adapter"],
            registry=r,
        )
        self.catch_up_duration = Histogram(
            "omni_router_catch_up_duration_seconds",
            "Duration of one catch-up from a peer, the lock wait excluded",
            ["outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.affinity = AffinityStats()
        r.register(self.affinity)
        self._versions = VersionPolicyStats()
        r.register(self._versions)
        self.filtered = self._versions.filtered
        """Reason → workers left out of candidates; the proxy adds to it in place (no call per request)."""
        self.control = ControlState(leader)
        if fleet_gauges:
            r.register(_FleetCollector(workers, journal))
            r.register(AdapterCollector(workers))
            r.register(self.control)

    def observe_request(self, route: str, method: str, status: int, duration_s: float) -> None:
        """One served HTTP request (the router's edge middleware, on every request)."""
        self._requests.observe(route, method, status, duration_s)

    def refused_by_policy(self, kind: str) -> None:
        """A request no worker could serve under its weight-version policy (``kind``: latest-only, ...)."""
        refused = self._versions.refused
        refused[kind] = refused.get(kind, 0) + 1

    def observe_lock_wait(self, operation: str, waited_s: float, acquired: bool) -> None:
        self.lock_wait.labels(operation, "true" if acquired else "false").observe(waited_s)

    def observe_admin(
        self, operation: str, outcome: str, duration_s: float, phases: dict[str, float] | None = None
    ) -> None:
        self.admin_ops.labels(operation, outcome).inc()
        self.admin_duration.labels(operation, outcome).observe(duration_s)
        for phase, seconds in (phases or {}).items():
            if phase != "total":  # the whole is the duration above
                self.admin_phases.labels(operation, phase).observe(seconds)

    def observe_catch_up(self, outcome: str, duration_s: float) -> None:
        self.catch_ups.labels(outcome).inc()
        self.catch_up_duration.labels(outcome).observe(duration_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
