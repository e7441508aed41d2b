"""The request-body bytes one serving process may hold in memory at once, across all its connections.

Each connection of the lean server holds at most one request's body being served and a small part of
the next (:mod:`.connection`), so one caller's memory is bounded by the body bound
(``MAX_BODY_BYTES``); many callers together are bounded by this budget. A body is counted as its
bytes arrive and given back once its answer is done (or its connection closed); a request that would
pass the budget is answered 503 with ``Retry-After`` at once, at its headers when it declares its
length, rather than the process growing. Each process's share of the router's budget is a setting
(:meth:`router.gateway.config.RouterConfig.body_budget_bytes`).
"""

from __future__ import annotations


class BodyBudget:
    """Bytes held against ``capacity``; :meth:`take` refuses what would pass it."""

    __slots__ = ("capacity", "held", "refused")

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.held = 0
        self.refused = 0
        """Requests refused because the budget was spent (a metric)."""

    def admits(self, size: int) -> bool:
        """Whether a body of ``size`` declared bytes would fit now (a refusal is counted)."""
        if self.held + size > self.capacity:
            self.refused += 1
            return False
        return True

    def take(self, size: int) -> bool:
        if self.held + size > self.capacity:
            self.refused += 1
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held -= size
