"""The admin routes the router broadcasts, and how each one is treated.

One row per worker admin route. ``locked`` routes are serialized by the admin
update lock; ``fenced`` routes also take their targets out of request routing
for the whole broadcast, journal them, and keep them disabled unless every
target succeeds. Timeouts are per route and sized for the work: a weight load
or a rendezvous takes minutes, a version query does not. A caller's
``timeout_s`` in the body stretches the router's wait beyond it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def caller_timeout_s(body: Any) -> float | None:
    """The positive ``timeout_s`` a caller put in the body, if any (bools are not numbers here)."""
    if isinstance(body, dict):
        asked = body.get("timeout_s")
        if isinstance(asked, (int, float)) and not isinstance(asked, bool) and asked > 0:
            return float(asked)
    return None


@dataclass(frozen=True, slots=True)
class Operation:
    """One worker admin route and how the router treats it."""

    path: str
    methods: tuple[str, ...]
    timeout_s: float
    locked: bool = False
    fenced: bool = False
    changes_weights: bool = False
    """After success the router refreshes each target's ``weight_version``."""

    @property
    def name(self) -> str:
        return self.path.lstrip("/")

    def timeout_for(self, body: Any) -> float:
        """The route's timeout, or the caller's ``timeout_s`` plus a margin when that is longer."""
        asked = caller_timeout_s(body)
        return self.timeout_s if asked is None else max(self.timeout_s, asked + 30.0)


_P = ("POST",)
_GP = ("GET", "POST")
_G = ("GET",)

OPERATIONS: dict[str, Operation] = {
    op.path: op
    for op in (
        # Fleet-changing: one at a time, targets fenced, fail closed.
        Operation("/pause_generation", _P, 300.0, locked=True, fenced=True),
        Operation("/update_weights_from_disk", _P, 1800.0, locked=True, fenced=True, changes_weights=True),
        Operation("/update_weights_from_tensor", _P, 600.0, locked=True, fenced=True, changes_weights=True),
        Operation("/update_weights_from_distributed", _P, 1800.0, locked=True, fenced=True, changes_weights=True),
        Operation("/init_weights_update_group", _P, 900.0, locked=True, fenced=True),
        Operation("/destroy_weights_update_group", _P, 300.0, locked=True, fenced=True),
        Operation("/prepare_weights_update", _P, 600.0, locked=True, fenced=True),
        Operation("/complete_weights_update", _P, 1800.0, locked=True, fenced=True, changes_weights=True),
        Operation("/update_weight_version", _P, 120.0, locked=True, fenced=True, changes_weights=True),
        Operation("/release_memory_occupation", _GP, 600.0, locked=True, fenced=True),
        Operation("/resume_memory_occupation", _GP, 600.0, locked=True, fenced=True, changes_weights=True),
        # Serialized with updates (resuming mid-update would serve partial weights) but not fenced.
        Operation("/continue_generation", _P, 120.0, locked=True),
        # SGLang 0.5.23's update bracket (miles sends it): serialized with updates, changes nothing.
        Operation("/begin_weight_update", _P, 120.0, locked=True),
        Operation("/end_weight_update", _P, 120.0, locked=True),
        # Plain broadcasts.
        Operation("/flush_cache", _GP, 120.0),
        Operation("/abort_request", _P, 30.0),
        Operation("/get_weight_version", _G, 30.0),
        Operation("/server_info", _G, 30.0),
        Operation("/weights_checker", _GP, 900.0),
        Operation("/model_info", _GP, 60.0),
    )
}

# The router-only route that tells workers to drop a prepared receive (two-phase abort).
ABORT_WEIGHTS_UPDATE = Operation("/abort_weights_update", _P, 120.0)
