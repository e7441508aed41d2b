"""Versioned LoRA adapters: the versions of each adapter the fleet holds, and which one a request means.

An adapter loaded as ``name@version`` (:func:`~router.contract.lora.split_version`) is one immutable version
of the adapter ``name``: each version is its own adapter on the workers and its own entry of the fleet's
table, loaded and rolled back all or nothing like any adapter. A request that names ``name`` is served by
the *latest* version, the one published last among those still routed; because a version is published only
once every routable worker holds it, that switch happens in one step, with the table the snapshot carries.
A request that names ``name@version`` is pinned to it (404 naming the held versions when it is not held).

The index is rebuilt from the table whenever an entry is added, removed or stops being routed, so the proxy
reads two dictionaries per request; a request naming no versioned adapter costs nothing more.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from router.contract.errors import NotFound
from router.contract.fleet_adapters import FleetAdapter
from router.contract.lora import split_version


def family_of(name: str) -> str:
    """The adapter a name belongs to: ``policy`` for ``policy@v7`` and for ``policy``."""
    split = split_version(name)
    return name if split is None else split[0]


class NamedAdapters(NamedTuple):
    """The adapters a request names, as the router routes it (a tuple: built on the proxy's path)."""

    names: frozenset[str] = frozenset()
    """What the workers must hold: each versioned name resolved to the version that serves it."""
    renamed: Mapping[str, str] | None = None
    """Caller's name → the version it was resolved to (``None`` unless the request named an adapter without
    its version): the body forwarded must name that version."""


NO_ADAPTERS = NamedAdapters()


class Versions:
    """Every versioned adapter of a table: its versions oldest first, and the latest routed one."""

    def __init__(self, table: Mapping[str, FleetAdapter]) -> None:
        by_family: dict[str, list[FleetAdapter]] = {}
        for entry in table.values():
            split = split_version(entry.name)
            if split is not None:
                by_family.setdefault(split[0], []).append(entry)
        self.all: dict[str, tuple[str, ...]] = {}
        """Family → every version in the table (being unloaded included), in the order they were published."""
        self.latest: dict[str, str] = {}
        """Family → the latest version requests are routed to (families with none routed are left out)."""
        for family, entries in by_family.items():
            entries.sort(key=lambda e: (e.published, e.name))
            self.all[family] = tuple(e.name for e in entries)
            serving = [e.name for e in entries if e.serving]
            if serving:
                self.latest[family] = serving[-1]

    def knows(self, name: str) -> bool:
        """Whether ``name`` is one of these families, or a version of one (held or not)."""
        return name in self.all or family_of(name) in self.all

    def refuse(self, name: str, table: Mapping[str, FleetAdapter]) -> NotFound:
        """The 404 of a versioned name (or family) no routed version answers to, naming the held versions."""
        split = split_version(name)
        family = name if split is None else split[0]
        held = ", ".join(v for v in self.all.get(family, ()) if table[v].serving) or "none"
        if split is None:
            return NotFound(f"no version of LoRA adapter {family!r} is being served (held versions: {held})")
        return NotFound(
            f"version {split[1]!r} of LoRA adapter {family!r} is not held by the fleet (held versions: {held})"
        )
