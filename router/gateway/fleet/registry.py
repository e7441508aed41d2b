"""The worker registry: who the workers are, whether they may take traffic.

Three facts decide routing: ``health`` (what probes observed), ``disabled``
(what an operator or an in-flight update decided) and whether the worker holds
the fleet's weights (:mod:`router.gateway.fleet.weights`; a worker that does not
is *pending*). A worker is *routable* only when it is healthy, not disabled and
not pending; it is a *broadcast target* whenever it is not dead, disabled or
pending or not, because such a worker must still receive the update that will
make it consistent again.

Which recorded version a request may be served from is the version policy's
(:mod:`router.gateway.routing.version_policy`); *routable* here is its default,
``latest-only``. The registry also keeps each worker's control state as the
router's own successful broadcasts left it (paused, asleep): it is what the
router did, not a probe of the worker, and a restarted worker keeps it until the
next such broadcast.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from urllib.parse import unquote

from router.contract import endpoints as ep
from router.contract.base import canonical_worker_url
from router.contract.errors import BadRequest, Conflict, NotFound
from router.contract.fleet import CatchUpStatus, EngineName, HealthState, WorkerRecord, WorkerSource
from router.gateway.fleet.adapters import FleetAdapters
from router.gateway.fleet.weights import FleetWeights, WorkerWeights

#: Broadcasts that change a worker's control state: path → (field, value) once it succeeded there.
CONTROL_EFFECTS: dict[str, tuple[str, bool]] = {
    ep.PAUSE_GENERATION.path: ("paused", True),
    ep.CONTINUE_GENERATION.path: ("paused", False),
    ep.PAUSE.path: ("paused", True),
    ep.RESUME.path: ("paused", False),
    ep.SLEEP.path: ("asleep", True),
    ep.RELEASE_MEMORY_OCCUPATION.path: ("asleep", True),
    ep.WAKE_UP.path: ("asleep", False),
    ep.RESUME_MEMORY_OCCUPATION.path: ("asleep", False),
}


#: Why a worker that says it is paused takes no traffic while the router has not paused it.
PAUSED_BEHIND_ROUTER = (
    "its generation is paused although the router did not pause it (it would park every request): the router "
    "continues it before it takes traffic again"
)


def normalize_url(raw: str) -> str:
    """Validate a worker base URL and return its canonical form (``http://host:port``); 400 when it
    breaks the contract's rule (:func:`~router.contract.base.canonical_worker_url`)."""
    try:
        return canonical_worker_url(raw)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def worker_id_for(url: str) -> str:
    """A stable id derived from the canonical URL, so it survives router restarts."""
    return "w-" + hashlib.sha256(url.encode()).hexdigest()[:12]


@dataclass(slots=True, eq=False)
class Worker:
    """One upstream worker and everything the router tracks about it."""

    id: str
    url: str
    engine: EngineName | None = None
    """The server behind the URL (:mod:`router.gateway.engines`); ``None`` until detected."""
    engine_detail: str | None = None
    """Why the engine is not known yet, or what its server lacks (shown in ``GET /workers``)."""
    admin_paths: frozenset[str] | None = None
    """The admin routes this worker's server serves, where its engine's probe found out (vLLM with or
    without the project's plugin); ``None``: every route of its engine."""
    health: HealthState = "unhealthy"
    disabled: bool = False
    inflight: int = 0
    inflight_elsewhere: int = 0
    """Requests on it through the router's other data-plane processes, as last reported (0 in one process)."""
    weight_version: str | None = None
    tp_size: int | None = None
    weight_state: str | None = None
    instance_id: str | None = None
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    ever_healthy: bool = False
    update_holds: int = 0
    """How many in-flight broadcasts target this worker; while > 0 failed probes are
    not counted, so a worker busy loading weights is not declared dead for being slow."""
    removed: bool = False
    source: WorkerSource = "static"
    pod: str | None = None
    departed: str | None = None
    """Set when discovery stops listing the worker's pod: no traffic from then on, and an update
    that targets it counts it as failed; it leaves the registry once no update holds the lock."""
    paused: bool = False
    """Its generation was paused by the router's last successful pause broadcast (SGLang or vLLM)."""
    control_changes: int = 0
    """Counts the router's successful control broadcasts to it: a probe that was in flight across one read
    the state before it, and what it read is not kept (:meth:`WorkerRegistry.observe_control`)."""
    reported_paused: bool | None = None
    """What the worker itself last said of its generation (its probe: omni-worker's ``/health``, vLLM's
    ``/is_paused``, SGLang's ``/ready``): paused, running, or ``None`` when it does not say. A worker that
    reports paused while the router has not paused it (it applied a pause it received while it was stopped,
    or someone paused it directly) would park every request sent to it: it takes none until it runs again."""
    asleep: bool = False
    """Its memory was released (``/sleep``, ``/release_memory_occupation``) by the router's broadcast."""
    catch_up: CatchUpStatus | None = None
    """The router's catch-up from a peer (:mod:`router.gateway.catch_up.joiners`), while one is under way or failed."""

    @property
    def is_dead(self) -> bool:
        return self.health == "dead"

    @property
    def retired(self) -> bool:
        """Its catch-ups failed ``--max-rejoin-attempts`` times: out of routing and of fleet-wide calls until its
        process restarts (:mod:`router.gateway.catch_up.joiners`)."""
        return self.catch_up is not None and self.catch_up.state == "retired"

    @property
    def paused_behind_router(self) -> bool:
        """It says its generation is paused, and no pause or sleep of the router's explains it."""
        return self.reported_paused is True and not self.paused and not self.asleep

    @property
    def released_behind_router(self) -> bool:
        """It says its weights are released (its memory freed), and no sleep or release of the router's explains it."""
        return self.weight_state == "released" and not self.asleep

    @property
    def weights(self) -> WorkerWeights:
        return WorkerWeights(
            weight_version=self.weight_version, weight_state=self.weight_state, instance_id=self.instance_id
        )


@dataclass(slots=True)
class HealthThresholds:
    """Consecutive probe counts: ``failure`` to unhealthy, ``dead`` to dead, ``success`` to come back."""

    failure: int = 3
    dead: int = 6
    success: int = 2


@dataclass
class WorkerRegistry:
    """Workers in registration order (the order rank assignment follows)."""

    thresholds: HealthThresholds = field(default_factory=HealthThresholds)
    fleet: FleetWeights = field(default_factory=lambda: FleetWeights(None))
    adapters: FleetAdapters = field(default_factory=FleetAdapters)
    """The fleet's LoRA adapters and who holds which (:mod:`router.gateway.fleet.adapters`)."""
    _workers: dict[str, Worker] = field(default_factory=dict)

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def workers(self) -> Iterable[Worker]:
        """The workers without a copy, for routing's per-request loops (which never await inside)."""
        return self._workers.values()

    def add(
        self,
        raw_url: str,
        *,
        disabled: bool = False,
        source: WorkerSource = "static",
        pod: str | None = None,
        engine: EngineName | None = None,
    ) -> Worker:
        """Register a worker; ``engine`` ``None``: detected by the health checker before it is probed."""
        url = normalize_url(raw_url)
        wid = worker_id_for(url)
        if wid in self._workers:
            raise Conflict(f"worker {url} is already registered as {wid}")
        worker = Worker(id=wid, url=url, disabled=disabled, source=source, pod=pod, engine=engine)
        self._workers[wid] = worker
        return worker

    def find(self, key: str) -> Worker | None:
        """Look a worker up by id, or by (URL-escaped) URL."""
        if key in self._workers:
            return self._workers[key]
        text = unquote(key)
        if text in self._workers:
            return self._workers[text]
        try:
            return self._workers.get(worker_id_for(normalize_url(text)))
        except BadRequest:
            return None

    def get(self, key: str) -> Worker:
        worker = self.find(key)
        if worker is None:
            raise NotFound(f"no worker with id or url {unquote(key)!r}")
        return worker

    def remove(self, key: str) -> Worker:
        worker = self.get(key)
        del self._workers[worker.id]
        worker.removed = True
        return worker

    def pending_reason(self, worker: Worker) -> str | None:
        """Why ``worker`` may not take generation traffic although it is healthy, or ``None``."""
        if worker.paused_behind_router:
            return PAUSED_BEHIND_ROUTER
        return self.fleet.why_not_serving(worker.id, worker)

    def is_routable(self, worker: Worker) -> bool:
        """Eligible under the default version policy, ``latest-only`` (workers the router paused included)."""
        if worker.health != "healthy" or worker.disabled or worker.removed or worker.departed is not None:
            return False
        if worker.paused_behind_router:
            return False
        sequence = self.fleet.verified_sequence(worker.id, worker)
        return sequence is not None and sequence >= self.fleet.latest_sequence

    def observe_control(self, path: str, succeeded: Iterable[str]) -> None:
        """A broadcast of ``path`` succeeded on the workers ``succeeded``: record its control effect, if any."""
        effect = CONTROL_EFFECTS.get(path)
        if effect is None:
            return
        name, value = effect
        for wid in succeeded:
            worker = self._workers.get(wid)
            if worker is not None:
                setattr(worker, name, value)
                worker.control_changes += 1
                if name == "paused":
                    worker.reported_paused = value  # it just answered so: no need to wait for its next probe

    def routable(self) -> list[Worker]:
        return [w for w in self._workers.values() if self.is_routable(w)]

    def record(self, worker: Worker) -> WorkerRecord:
        """The worker as ``GET /workers`` shows it, with the reason it is pending, if it is."""
        sequence = self.fleet.verified_sequence(worker.id, worker)
        return WorkerRecord(
            id=worker.id,
            url=worker.url,
            health=worker.health,
            disabled=worker.disabled,
            inflight=worker.inflight,
            engine=worker.engine,
            engine_detail=worker.engine_detail,
            weight_version=worker.weight_version,
            tp_size=worker.tp_size,
            weight_state=worker.weight_state,
            instance_id=worker.instance_id,
            pending=self.pending_reason(worker),
            fleet_sequence=sequence,
            staleness=None if sequence is None else self.fleet.latest_sequence - sequence,
            paused=worker.paused,
            reported_paused=worker.reported_paused,
            asleep=worker.asleep,
            source=worker.source,
            pod=worker.pod,
            departed=worker.departed,
            catch_up=worker.catch_up,
        )

    def live(self) -> list[Worker]:
        """Broadcast targets: every worker that is not dead, disabled ones included."""
        return [w for w in self._workers.values() if not w.is_dead]

    def observe_probe(self, worker: Worker, ok: bool) -> bool:
        """Apply one health-probe outcome; returns True when ``health`` changed.

        A worker's first good probe makes it healthy at once (start-up); after that
        it takes ``success`` consecutive good probes. ``failure`` consecutive bad
        probes make it unhealthy and ``dead`` make it dead. Probes that fail while
        an update targets the worker are ignored.
        """
        if worker.removed:
            return False
        before = worker.health
        if ok:
            worker.consecutive_failures = 0
            worker.consecutive_successes += 1
            if worker.health != "healthy" and (
                not worker.ever_healthy or worker.consecutive_successes >= self.thresholds.success
            ):
                worker.health = "healthy"
                worker.ever_healthy = True
        else:
            if worker.update_holds > 0:
                return False
            worker.consecutive_successes = 0
            worker.consecutive_failures += 1
            if worker.consecutive_failures >= self.thresholds.dead:
                worker.health = "dead"
            elif worker.consecutive_failures >= self.thresholds.failure or not worker.ever_healthy:
                worker.health = "unhealthy"
        return worker.health != before
