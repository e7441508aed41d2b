"""What a router replica answers while it is not the leader (``--leader-election``).

The gate is closed from start-up until this replica holds the Lease *and* has re-read the durable
state (:mod:`router.gateway.leadership`); it closes again, for good, the moment leadership is
lost. While it is closed nothing a client asks is run here (the worker registry, discovery and
health probes keep running behind it, so a standby that takes over knows the fleet already):

==============  ======================================================================================
``/liveness``   200: the process serves (Kubernetes must not restart a standby)
``/health``     200, with ``"leader": {"role": "standby", "holder": ...}``
``/leader``     503: the router's readiness probe, so the Service sends a standby nothing
``/metrics``    served: Prometheus scrapes every pod, standbys included
``/readiness``  503
anything else   503 with ``Retry-After`` (seconds until the lease could expire as seen here, at least
                1), ``X-Omni-Router-Role: standby`` and ``{"error": {"message": "this omni-router
                replica is a standby; the leader is <holder>"}}``: nothing ran, a client may send the
                call again (the project's trainer client does, through a failover)
==============  ======================================================================================

An open gate passes every request through untouched: the leader's routes are exactly what a router
without leader election serves.
"""

from __future__ import annotations

import math
from typing import Protocol

from aiohttp import web

from router.contract.fleet import ROUTER_ROLE_HEADER, STANDBY_ROLE, LeaderRole, LeaderView
from router.contract.web.middleware import json_error

#: Routes a closed gate still lets through (monitoring and the probes that must see a standby as it is).
ANSWERED_BY_A_STANDBY = frozenset({"/liveness", "/health", "/leader", "/metrics"})


class LeaseView(Protocol):
    """What the gate reads of the election (:class:`~router.gateway.leader.elector.LeaseElector`)."""

    @property
    def identity(self) -> str: ...
    @property
    def holder(self) -> str | None: ...
    def seconds_until_free(self) -> float: ...
    def holds_lease(self) -> bool: ...


class LeaderGate:
    """Closed (standby, taking over, stepped down) or open (leader); :meth:`answer` is what it says closed."""

    def __init__(self, lease: LeaseView):
        self._lease = lease
        self.role: LeaderRole = "standby"
        self.passes = set(ANSWERED_BY_A_STANDBY)
        """The routes a closed gate lets through (the control process adds its data planes' own route)."""

    @property
    def is_open(self) -> bool:
        """Leading, and the last renewal is within the renew deadline (checked now, not only by the renewals)."""
        return self.role == "leader" and self._lease.holds_lease()

    def taking_over(self) -> None:
        """The lease is ours; the durable state is being read: still closed."""
        self.role = "taking_over"

    def open(self) -> None:
        self.role = "leader"

    def step_down(self) -> None:
        """Leadership lost: closed for good (the process exits next)."""
        self.role = "stepped_down"

    def view(self) -> LeaderView:
        role: LeaderRole = "stepped_down" if self.role == "leader" and not self.is_open else self.role
        return LeaderView(role=role, holder=self._lease.holder, identity=self._lease.identity)

    def retry_after_s(self) -> int:
        return max(1, math.ceil(self._lease.seconds_until_free()))

    def why_closed(self) -> str:
        if self.role == "taking_over":
            return "this omni-router replica is taking over as the leader; it serves once it has read the fleet's state"
        if self.role in ("stepped_down", "leader"):  # a leader past its renew deadline is stepping down
            return "this omni-router replica lost the leadership and is exiting"
        holder = self._lease.holder
        return f"this omni-router replica is a standby; the leader is {holder or '(none yet: the lease is free)'}"

    def answer(self, request: web.Request) -> web.Response | None:
        """What a closed gate answers for ``request``; ``None`` lets it through (the gate is open, or the
        route is one a standby serves). Run before the access check: nothing runs on a standby either way."""
        return self.answer_path(request.path)

    def answer_path(self, path: str) -> web.Response | None:
        """:meth:`answer` for a request to ``path``."""
        if path in self.passes or self.is_open:
            return None
        if path == "/readiness":
            return web.json_response({"status": "not_ready", "reason": self.why_closed()}, status=503)
        headers = {"Retry-After": str(self.retry_after_s()), ROUTER_ROLE_HEADER: STANDBY_ROLE}
        return json_error(503, self.why_closed(), headers=headers)
