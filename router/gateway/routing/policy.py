"""Load-balancing policies: pick one routable worker for a request.

Plain classes over a list of candidates, so they are tested without HTTP.
Eligibility (healthy, not disabled, not already tried) is decided by the
caller; a policy only ranks.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from typing import Protocol

from router.gateway.config import PolicyName
from router.gateway.fleet.registry import Worker


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Worker]) -> Worker:
        """Pick one of ``candidates`` (never empty)."""
        ...


class LeastInflight:
    """Fewest requests in flight through this router; ties rotate so idle workers share load.

    With several data-plane processes a worker's load is this process's count now plus the
    others' as last reported (every 0.25 s): exact for this process, a fraction of a second
    stale for the rest, which is what keeps the count off the hot path."""

    name = "least_inflight"

    def __init__(self) -> None:
        self._tick = itertools.count()

    def choose(self, candidates: Sequence[Worker]) -> Worker:
        low = min(w.inflight + w.inflight_elsewhere for w in candidates)
        tied = [w for w in candidates if w.inflight + w.inflight_elsewhere == low]
        return tied[next(self._tick) % len(tied)]


class RoundRobin:
    """Each request to the next candidate in registry order."""

    name = "round_robin"

    def __init__(self) -> None:
        self._tick = itertools.count()

    def choose(self, candidates: Sequence[Worker]) -> Worker:
        return candidates[next(self._tick) % len(candidates)]


class Random:
    """Uniformly at random (seedable for tests)."""

    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: Sequence[Worker]) -> Worker:
        return candidates[self._rng.randrange(len(candidates))]


_POLICIES: dict[str, type[LeastInflight] | type[RoundRobin] | type[Random]] = {
    "least_inflight": LeastInflight,
    "round_robin": RoundRobin,
    "random": Random,
}


def make_policy(name: PolicyName | str) -> Policy:
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(_POLICIES)}") from None
