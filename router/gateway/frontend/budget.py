"""The request-body bytes one serving process may hold in memory at once, across all its connections.

Each connection of the lean server holds at most one request's body being served and a small part of
the next (:mod:`.connection`), so one caller's memory is bounded by the body bound
(``MAX_BODY_BYTES``); many callers together are bounded by this budget. A body is counted as its
bytes arrive and given back once its answer is done (or its connection closed); a request that would
pass the budget is answered 503 with ``Retry-After`` at once, at its headers when it declares its
length, rather than the process growing.
"""

from __future__ import annotations

from router.contract.web.parsing import MAX_BODY_BYTES

#: The router's default budget, shared by its serving processes: sixteen bodies of the largest size.
DEFAULT_ROUTER_BUDGET_BYTES = 16 * MAX_BODY_BYTES
#: Each serving process may hold at least this much, so two of the largest bodies always fit.
MIN_PROCESS_BUDGET_BYTES = 2 * MAX_BODY_BYTES


def process_share(router_budget_bytes: int | None, processes: int) -> int:
    """One serving process's share of the router's budget (the default when ``None``)."""
    total = DEFAULT_ROUTER_BUDGET_BYTES if router_budget_bytes is None else router_budget_bytes
    return max(MIN_PROCESS_BUDGET_BYTES, total // max(1, processes))


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
