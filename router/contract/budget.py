"""The one timeout budget: how long each operation may take, and how each layer waits for it.

Every admin operation has a :class:`Budget` (a column of the endpoint table in
:mod:`router.contract.endpoints`). All three layers derive their waits from it,
and each adds one margin, once:

==========  ====================================================================
layer       waits
==========  ====================================================================
worker      :meth:`Budget.bound`: the caller's ``timeout_s`` (for a join or a
            receive) plus the fixed work around it, else the operation's budget.
            Past it the worker stops waiting and answers 504 or a failure.
router      :meth:`Budget.router_wait`: the worker's bound plus
            :data:`HOP_MARGIN_S`, the time a worker gets to report its own
            timeout. Serialized operations first wait for the update lock, at
            most ``--admin-lock-timeout-s`` (default :data:`DEFAULT_LOCK_WAIT_S`),
            and answer 503 past it.
client      :meth:`Budget.client_wait`: the router's wait plus
            :data:`HOP_MARGIN_S`, plus the router's lock wait for serialized
            operations.
==========  ====================================================================

So a timeout is always reported by the layer that owns the work, with a message,
before the layer above gives up on it.
"""

from __future__ import annotations

from dataclasses import dataclass

#: What each layer adds to the wait of the layer below it: time to notice a timeout and answer.
HOP_MARGIN_S = 30.0
#: How long the router waits for its admin update lock by default (``--admin-lock-timeout-s``).
DEFAULT_LOCK_WAIT_S = 300.0
#: A weight-update group's join, and each collective on it, when the caller gives no ``timeout_s``.
DEFAULT_GROUP_TIMEOUT_S = 120.0
#: A weight receive (single-phase call, or from a ready prepare to its complete) when the caller gives no ``timeout_s``.
DEFAULT_RECEIVE_TIMEOUT_S = 600.0
#: Applying received weights, flushing and digesting after a receive ended.
APPLY_S = 60.0
#: Ending an update that will not commit (undo its hold, record what it left the weights as):
#: granted even when the update's own deadline has passed, so a timed-out update still ends cleanly.
CLEANUP_S = 10.0
#: The longest ``timeout_s`` a caller may ask for: a day is "forever" for a sync.
MAX_TIMEOUT_S = 86_400.0


@dataclass(frozen=True, slots=True)
class Budget:
    """How long one operation may take on a worker."""

    work_s: float
    """The worker's bound when the caller sets no timeout."""
    overhead_s: float = 0.0
    """Work around a caller-bounded wait: when the request sets its timeout, the bound is timeout + this."""

    def bound(self, timeout_s: float | None = None) -> float:
        """The worker's deadline for one call, given the request's timeout field (``None``: not set)."""
        return self.work_s if timeout_s is None else timeout_s + self.overhead_s

    def router_wait(self, timeout_s: float | None = None) -> float:
        """How long the router waits for a worker's answer (after it holds the lock, if it needs it)."""
        return self.bound(timeout_s) + HOP_MARGIN_S

    def client_wait(self, timeout_s: float | None = None, *, lock_wait_s: float = 0.0) -> float:
        """How long a client waits for the router's answer; ``lock_wait_s`` for serialized operations."""
        return self.router_wait(timeout_s) + lock_wait_s + HOP_MARGIN_S
