"""The LoRA adapters a router has loaded across its fleet, and who holds which version.

A router loads an adapter on every live worker at once, all or nothing (:mod:`router.gateway.sync.adapters`).
Each load that succeeds everywhere is one *fleet version* of the adapter's name; a worker holds that
version from the process the router loaded it into (its ``instance_id``), so a restarted worker holds
none until it is loaded again. Requests that name an adapter go only to the workers that hold its
fleet version.
"""

from __future__ import annotations

from pydantic import Field

from router.contract.base import WireResponse


class AdapterHolding(WireResponse):
    """What one worker holds of one adapter."""

    version: int
    """The fleet version it holds."""
    instance_id: str | None = None
    """The worker process it was loaded into."""


class FleetAdapter(WireResponse):
    """One adapter of the fleet."""

    name: str
    version: int
    """Counts the router's fleet-wide loads of this name that succeeded on every target."""
    source: str
    """Where it was loaded from: a path on the workers' disks, or ``__tensor__`` (sent as tensors)."""
    published: int = 0
    """Where this load stands in the order of the table's loads (higher: later): the latest of an adapter's
    versions (``name@version``) is the one published last."""
    serving: bool = True
    """False from the start of its unload: requests naming it are refused from then on."""
    holders: dict[str, AdapterHolding] = Field(default_factory=dict)
    """Worker id → what it holds."""


class FleetAdapterTable(WireResponse):
    """``GET /fleet/adapters`` and what a routing snapshot carries: every adapter of the fleet."""

    adapters: list[FleetAdapter] = Field(default_factory=list)
