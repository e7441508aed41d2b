"""The fleet's LoRA adapters: which exist, at which fleet version, who holds it, and who uses it now.

The control process changes the table only through fleet-wide loads and unloads
(:mod:`router.gateway.sync.adapters`) and catch-ups, and keeps it in the state store
(:data:`ADAPTERS_FILE`) after each, so a restarted router, or a standby that takes over, routes
adapters to the workers that still hold them (a holder is known by its process, so a worker that
restarted meanwhile holds nothing). A data plane holds a copy from the routing snapshot. Entries are
replaced, never changed in place, so a snapshot's change check compares them by identity first.

A request names adapters as SGLang and vLLM do: ``lora_path`` on ``/generate`` (one name, or one per
prompt of a batch), ``model`` on the OpenAI routes (an adapter's name, or SGLang's
``<base>:<adapter>``). A ``lora_path`` the fleet has not loaded is a 404 naming the loaded ones; a
``model`` that names no adapter is the base model, as the workers read it. A name without a version of an
adapter loaded as versions (``name@version``) means its latest version (:mod:`.adapter_versions`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from pydantic import ValidationError

from router.contract.errors import NotFound
from router.contract.fleet_adapters import AdapterHolding, FleetAdapter, FleetAdapterTable
from router.gateway.fleet.adapter_versions import NO_ADAPTERS, NamedAdapters, Versions
from router.gateway.state.durable import DurableRecord

log = logging.getLogger(__name__)

#: The record of the fleet's adapter table in the state store.
ADAPTERS_FILE = "fleet_adapters.json"
#: Versions of one adapter kept loaded by default once a newer one is published (``--lora-keep-versions``).
DEFAULT_KEEP_VERSIONS = 2


class Holder(Protocol):
    """A worker as the table reads it (:class:`~router.gateway.fleet.registry.Worker`)."""

    @property
    def id(self) -> str: ...

    @property
    def instance_id(self) -> str | None: ...


class FleetAdapters:
    """Every adapter of the fleet (see the module docstring)."""

    def __init__(self) -> None:
        self._table: dict[str, FleetAdapter] = {}
        self._versions = Versions(self._table)
        self._stored: DurableRecord | None = None
        self.keep_versions = DEFAULT_KEEP_VERSIONS
        """How many of an adapter's newest versions stay loaded once a newer one is published (the control
        process: :mod:`router.gateway.sync.adapter_versions`)."""
        self.inflight: dict[str, int] = {}
        """Requests this process has in flight per adapter name (only non-zero counts)."""
        self.inflight_elsewhere: dict[str, int] = {}
        """The same, through the router's data-plane processes, as they last reported (the control process)."""

    def __bool__(self) -> bool:
        return bool(self._table)

    def get(self, name: str) -> FleetAdapter | None:
        return self._table.get(name)

    def names(self) -> list[str]:
        """Every adapter of the table (being unloaded included)."""
        return sorted(self._table)

    def versions(self, family: str) -> tuple[str, ...]:
        """Every version of the versioned adapter ``family`` in the table, oldest first."""
        return self._versions.all.get(family, ())

    def _changed(self) -> None:
        """An entry was added, removed or stopped (or resumed) being routed: the versions index follows."""
        self._versions = Versions(self._table)

    def serving_names(self) -> list[str]:
        return sorted(name for name, entry in self._table.items() if entry.serving)

    def holds(self, worker: Holder, name: str) -> bool:
        """Whether ``worker`` serves ``name`` at its fleet version, from the process it was loaded into."""
        entry = self._table.get(name)
        if entry is None or not entry.serving:
            return False
        held = self.holding(worker, name)
        return held is not None and held.version == entry.version

    def holding(self, worker: Holder, name: str) -> AdapterHolding | None:
        """What ``worker`` holds of ``name``, in the process it was loaded into (a restarted one holds none)."""
        entry = self._table.get(name)
        held = None if entry is None else entry.holders.get(worker.id)
        return held if held is not None and held.instance_id == worker.instance_id else None

    def holds_all(self, worker: Holder, names: Iterable[str]) -> bool:
        return all(self.holds(worker, name) for name in names)

    def named_by(self, fields: Mapping[str, Any] | None) -> frozenset[str]:
        """The adapters a generation request's body names; 404 for a ``lora_path`` the fleet does not serve."""
        return self.resolve(fields).names

    def resolve(self, fields: Mapping[str, Any] | None) -> NamedAdapters:
        """:meth:`named_by`, with an adapter named without its version resolved to its latest version (and the
        names the forwarded body must change); 404 for a version the fleet does not hold."""
        if not fields or (not self._table and "lora_path" not in fields):
            return NO_ADAPTERS
        asked: set[str] = set()
        lora_path = fields.get("lora_path")
        if isinstance(lora_path, str):
            asked.add(lora_path)
        elif isinstance(lora_path, list):
            asked.update(n for n in lora_path if isinstance(n, str))
        model = fields.get("model")
        if not asked and isinstance(model, str):
            _, sep, tail = model.partition(":")
            named = model if self._names(model) else tail if sep and self._names(tail) else None
            if named is not None:
                asked.add(named)
        if not asked:
            return NO_ADAPTERS
        if len(asked) == 1:  # nearly every request: one adapter
            (name,) = asked
            served = self._served_as(name)
            return NamedAdapters(frozenset((served,)), None if served == name else {name: served})
        names: set[str] = set()
        renamed: dict[str, str] = {}
        for name in sorted(asked):
            served = self._served_as(name)
            names.add(served)
            if served != name:
                renamed[name] = served
        return NamedAdapters(frozenset(names), renamed or None)

    def _names(self, model: str) -> bool:
        """Whether a ``model`` names an adapter of the fleet (a version it does not hold, or is dropping, too)."""
        return model in self._table or (bool(self._versions.all) and self._versions.knows(model))

    def _served_as(self, name: str) -> str:
        """The adapter that serves a request naming ``name``; 404 when none does."""
        entry = self._table.get(name)
        if entry is not None and entry.serving:
            return name
        latest = self._versions.latest.get(name)
        if latest is not None:
            return latest
        if entry is None and self._versions.knows(name):
            raise self._versions.refuse(name, self._table)
        loaded = ", ".join(self.serving_names()) or "none"
        why = "is being unloaded" if entry is not None else "is not loaded on the fleet"
        raise NotFound(f"LoRA adapter {name!r} {why} (loaded: {loaded})")

    # -- requests in flight ---------------------------------------------------------------
    def started(self, names: Iterable[str]) -> None:
        for name in names:
            self.inflight[name] = self.inflight.get(name, 0) + 1

    def ended(self, names: Iterable[str]) -> None:
        for name in names:
            left = self.inflight.get(name, 0) - 1
            if left > 0:
                self.inflight[name] = left
            else:
                self.inflight.pop(name, None)

    def in_flight(self, name: str) -> int:
        """Requests naming ``name`` in flight through this router (every process, as last reported)."""
        return self.inflight.get(name, 0) + self.inflight_elsewhere.get(name, 0)

    # -- changes (the control process, under the update lock) ----------------------------------
    def record_load(self, name: str, source: str, holders: Iterable[Holder]) -> FleetAdapter:
        """A load that succeeded on every target: the name's next fleet version, held by exactly ``holders``."""
        previous = self._table.get(name)
        version = 1 if previous is None else previous.version + 1
        held = {w.id: AdapterHolding(version=version, instance_id=w.instance_id) for w in holders}
        published = 1 + max((e.published for e in self._table.values()), default=0)
        entry = FleetAdapter(name=name, version=version, source=source, published=published, holders=held)
        self._table[name] = entry
        self._changed()
        return entry

    def add_holder(self, name: str, worker_id: str, version: int, instance_id: str | None) -> None:
        """A worker was given ``name``'s fleet ``version`` (catch-up): it holds it from the process ``instance_id``."""
        entry = self._table.get(name)
        if entry is not None and entry.version == version:
            holders = {**entry.holders, worker_id: AdapterHolding(version=version, instance_id=instance_id)}
            self._table[name] = entry.model_copy(update={"holders": holders})

    def forget_holders(self, name: str, worker_ids: Iterable[str]) -> None:
        """These workers hold no known version of ``name`` any more (a rollback that did not answer)."""
        entry = self._table.get(name)
        drop = set(worker_ids)
        if entry is not None and drop & entry.holders.keys():
            holders = {wid: h for wid, h in entry.holders.items() if wid not in drop}
            self._table[name] = entry.model_copy(update={"holders": holders})

    def stop_serving(self, name: str) -> FleetAdapter:
        """The start of an unload: requests naming ``name`` are refused from now on."""
        entry = self._table[name]
        stopped = self._table[name] = entry.model_copy(update={"serving": False})
        self._changed()
        return stopped

    def resume_serving(self, name: str) -> None:
        """An unload that did not reach every holder: the adapter serves again from those that still hold it."""
        entry = self._table.get(name)
        if entry is not None and not entry.serving:
            self._table[name] = entry.model_copy(update={"serving": True})
            self._changed()

    def remove(self, name: str) -> None:
        self._table.pop(name, None)
        self._changed()

    # -- the stored record (the control process) ----------------------------------------------
    def attach(self, record: DurableRecord) -> None:
        """Keep the table in ``record`` from now on, starting from what it holds (blocking: start-up, takeover).
        A record that cannot be read or parsed leaves the table empty: adapters are loaded again."""
        self._stored = record
        try:
            data = record.load()
            self.replace(None if data is None else FleetAdapterTable.model_validate_json(data))
        except (OSError, ValueError, ValidationError) as exc:
            log.error(
                "the LoRA adapter table in %s is unreadable (%s); adapters must be loaded again", record.location, exc
            )
            self.replace(None)

    async def save(self) -> None:
        """Store the table as it is now (a failed write is logged and retried; memory stays the truth)."""
        if self._stored is not None:
            await self._stored.save(self.table().model_dump_json(indent=1).encode())

    # -- the snapshot ------------------------------------------------------------------------
    def table(self) -> FleetAdapterTable:
        return FleetAdapterTable(adapters=[self._table[name] for name in sorted(self._table)])

    def key(self) -> tuple[FleetAdapter, ...]:
        """What :meth:`table` would say, cheaply (entries are replaced on every change)."""
        return tuple(self._table[name] for name in sorted(self._table))

    def replace(self, table: FleetAdapterTable | None) -> None:
        """A data plane takes the control process's table."""
        self._table = {} if table is None else {entry.name: entry for entry in table.adapters}
        self._changed()
