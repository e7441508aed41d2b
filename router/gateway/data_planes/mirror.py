"""A data plane's copy of the control process's routing state, and the view the control publishes.

Both sides use the same :class:`~router.gateway.fleet.registry.WorkerRegistry` (and its
:class:`~router.gateway.fleet.weights.FleetWeights` rule), so a data plane decides
"routable" and "pending" exactly as the control process does: the snapshot carries the inputs
of that rule, not its result. A data plane's own observations (a failed request, a restarted
worker seen through the instance check) change its copy at once and are overwritten by the
next snapshot, which the control process builds from its own probes and the reports.
"""

from __future__ import annotations

from router.gateway.data_planes.messages import GateView, RoutingSnapshot, WorkerView
from router.gateway.fleet.registry import Worker, WorkerRegistry

#: The worker fields a snapshot carries (:class:`WorkerView`'s, in its order): what routing reads.
VIEW_FIELDS = tuple(WorkerView.model_fields)


def _routing_fields(w: Worker) -> tuple[object, ...]:
    """A worker's :data:`VIEW_FIELDS`, in their order (read for every worker on every check: spelt out, which
    is faster than any generic getter)."""
    return (
        w.id,
        w.url,
        w.engine,
        w.health,
        w.disabled,
        w.departed,
        w.weight_version,
        w.weight_state,
        w.instance_id,
        w.tp_size,
        w.paused,
        w.reported_paused,
        w.asleep,
    )


#: Views kept for reuse, at most: an update flips the same flags back and forth, so a few per worker suffice.
MAX_CACHED_VIEWS = 4096


class ViewCache:
    """:class:`WorkerView` objects by the fields they carry, so a snapshot reuses the view of every worker
    whose routing state it saw before (a fence raised and lowered again on the whole fleet builds no view
    twice); equal snapshots then also hold the same objects, which compare at once."""

    __slots__ = ("_views",)

    def __init__(self) -> None:
        self._views: dict[tuple[object, ...], WorkerView] = {}

    def view(self, fields: tuple[object, ...]) -> WorkerView:
        view = self._views.get(fields)
        if view is None:
            if len(self._views) >= MAX_CACHED_VIEWS:
                self._views.clear()
            view = self._views[fields] = WorkerView.model_validate(dict(zip(VIEW_FIELDS, fields, strict=True)))
        return view


def view_of(
    registry: WorkerRegistry, version: int, gate: GateView | None = None, views: ViewCache | None = None
) -> RoutingSnapshot:
    """The control process's routing state as a snapshot (removed workers are left out)."""
    cache = views if views is not None else ViewCache()
    workers = [cache.view(_routing_fields(w)) for w in registry if not w.removed]
    adapters = registry.adapters.table() if registry.adapters else None
    return RoutingSnapshot(version=version, workers=workers, fleet=registry.fleet.record, gate=gate, adapters=adapters)


def routing_key(registry: WorkerRegistry, gate: GateView | None) -> tuple[object, ...]:
    """What a snapshot would say, as a cheap tuple: equal keys, equal snapshots (versions aside). The workers
    are compared by the fields :func:`view_of` reads; the fleet record is held (every change replaces it, and
    tuple equality tries identity before comparing contents)."""
    workers = tuple(_routing_fields(w) for w in registry if not w.removed)
    return (workers, registry.fleet.record, gate, registry.adapters.key())


def same_routing(a: RoutingSnapshot, b: RoutingSnapshot) -> bool:
    """Whether two snapshots say the same (their versions aside)."""
    return a.workers == b.workers and a.fleet == b.fleet and a.gate == b.gate and a.adapters == b.adapters


def apply(registry: WorkerRegistry, snapshot: RoutingSnapshot) -> list[Worker]:
    """Make ``registry`` say what ``snapshot`` says; returns the workers that left it.

    Synchronous: a request picked after this returns sees the new state, and one picked before
    checks it again right before its first byte is written (the proxy's admission check)."""
    wanted = {view.id: view for view in snapshot.workers}
    gone = [registry.remove(w.id) for w in registry if w.id not in wanted]
    for view in snapshot.workers:
        worker = registry.find(view.id) or registry.add(view.url)
        worker.engine = view.engine
        worker.health = view.health
        worker.disabled = view.disabled
        worker.departed = view.departed
        worker.weight_version = view.weight_version
        worker.weight_state = view.weight_state
        worker.instance_id = view.instance_id
        worker.tp_size = view.tp_size
        worker.paused = view.paused
        worker.reported_paused = view.reported_paused
        worker.asleep = view.asleep
    registry.fleet.record = snapshot.fleet
    registry.adapters.replace(snapshot.adapters)
    return gone
