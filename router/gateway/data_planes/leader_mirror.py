"""The leader gate across processes (``--leader-election`` with ``--data-plane-processes N``).

The control process owns the election and its :class:`~router.gateway.leader.gate.LeaderGate`.
Each routing snapshot carries the gate's state (:class:`~.messages.GateView`); every data plane
runs the same ``LeaderGate`` over a :class:`MirroredLease`, so a standby's data planes answer
exactly what its control process answers: 503, ``Retry-After`` and ``X-Omni-Router-Role: standby``.

A standby refuses rather than proxies to the leader. The Service sends traffic only to the ready
replica (readiness is ``/leader``), so what reaches a standby is what was in flight at a failover;
a proxy would add a hop, and a second place to fail, to exactly those requests, while a 503 with
``Retry-After`` is safe to retry because nothing ran (the project's trainer client does so).

Leadership ends on the clock, not on a message: the snapshot carries the leader's renew deadline
as a moment of the host's monotonic clock, and a data plane's gate closes at that moment whether
or not the next snapshot has arrived. A leader cut off from the API server therefore stops
serving generation in every process at once, before a standby can take the lease.
"""

from __future__ import annotations

import time

from router.gateway.data_planes.messages import GateView
from router.gateway.leader.elector import LeaseElector
from router.gateway.leader.gate import LeaderGate


def gate_view(gate: LeaderGate, elector: LeaseElector) -> GateView:
    """What the control process's gate says now, for the next snapshot."""
    return GateView(
        role=gate.role,
        holder=elector.holder,
        identity=elector.identity,
        open_until=elector.renewed_until(),
        free_at=elector.free_at(),
    )


class MirroredLease:
    """The control process's lease as its last snapshot described it (a ``LeaseView`` for the gate)."""

    def __init__(self) -> None:
        self.view: GateView | None = None

    @property
    def identity(self) -> str:
        return self.view.identity if self.view is not None else ""

    @property
    def holder(self) -> str | None:
        return self.view.holder if self.view is not None else None

    def seconds_until_free(self) -> float:
        return 0.0 if self.view is None else max(0.0, self.view.free_at - time.monotonic())

    def holds_lease(self) -> bool:
        until = self.view.open_until if self.view is not None else None
        return until is not None and time.monotonic() < until


def mirrored_gate() -> tuple[LeaderGate, MirroredLease]:
    """A data plane's gate, closed (standby) until a snapshot says otherwise."""
    lease = MirroredLease()
    return LeaderGate(lease), lease


def apply_gate(gate: LeaderGate, lease: MirroredLease, view: GateView | None) -> None:
    """Take the control process's gate state from a snapshot (``None``: closed, as at start-up)."""
    lease.view = view
    gate.role = view.role if view is not None else "standby"
