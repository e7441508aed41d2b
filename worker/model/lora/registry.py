"""The adapters a model serves, by name.

Loading a name that is loaded already is an update: the new adapter is placed
and checked completely first, then replaces the old one in one assignment. A
refused update leaves the old adapter serving; a sequence that already holds
the old :class:`LoadedLora` keeps it to its end, since adapters are never
modified, only replaced. Each successful load of a name bumps that name's
version, which keeps counting across an unload.
"""

from __future__ import annotations

import threading

from worker.model.lora.adapter import LoraAdapter
from worker.model.lora.config import LoraLoadError
from worker.model.lora.loaded import LoadedLora, LoraHost, Placement, place_adapter


class LoraNotFoundError(LookupError):
    """No adapter of that name is loaded."""


class LoraAdapters:
    """Up to ``max_loras`` adapters of rank at most ``max_lora_rank``, placed on ``model``."""

    def __init__(self, model: LoraHost, *, max_loras: int, max_lora_rank: int):
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras={max_loras} and max_lora_rank={max_lora_rank} must both be at least 1")
        self.placement = Placement.of(model)
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self._loaded: dict[str, LoadedLora] = {}
        self._versions: dict[str, int] = {}
        # Loads may be placed concurrently; the count check, the version and the swap happen together.
        self._lock = threading.Lock()

    def load(self, name: str, adapter: LoraAdapter) -> LoadedLora:
        """Place ``adapter`` under ``name`` (replacing an adapter of that name), or raise
        :class:`~worker.model.lora.config.LoraLoadError` with nothing changed."""
        return self._swap(self.prepare(name, adapter), renumber=True)

    def prepare(self, name: str, adapter: LoraAdapter) -> LoadedLora:
        """``adapter`` placed as the next version of ``name``, checked whole but not served yet: :meth:`commit`
        serves it. Tensor parallelism places it on the other ranks in between, so no rank serves a version
        one of them refused."""
        if not isinstance(name, str) or not name:
            raise LoraLoadError(f"an adapter name must be a non-empty string, not {name!r}")
        self._check_room(name)
        return place_adapter(
            adapter, self.placement, max_rank=self.max_lora_rank, name=name, version=self._versions.get(name, 0) + 1
        )

    def commit(self, placed: LoadedLora) -> LoadedLora:
        """Serve an adapter from :meth:`prepare` as it is: :class:`LoraLoadError` if another load of its name
        committed meanwhile (the other ranks hold this very version) or there is no room any more."""
        return self._swap(placed, renumber=False)

    def _swap(self, placed: LoadedLora, *, renumber: bool) -> LoadedLora:
        name = placed.name
        with self._lock:
            self._check_room(name)
            version = self._versions.get(name, 0) + 1
            if version != placed.version:  # another load of this name committed meanwhile
                if not renumber:
                    raise LoraLoadError(f"another load of adapter {name!r} finished first; load it again")
                placed = LoadedLora(name, version, placed.config, placed.layers)
            self._versions[name] = version
            self._loaded[name] = placed
        return placed

    def unload(self, name: str) -> LoadedLora:
        """Stop serving ``name``; returns the adapter that was loaded (sequences holding it may finish)."""
        with self._lock:
            try:
                return self._loaded.pop(name)
            except KeyError:
                raise self._not_found(name) from None

    def get(self, name: str) -> LoadedLora:
        try:
            return self._loaded[name]
        except KeyError:
            raise self._not_found(name) from None

    def names(self) -> list[str]:
        return sorted(self._loaded)

    def __contains__(self, name: object) -> bool:
        return name in self._loaded

    def __len__(self) -> int:
        return len(self._loaded)

    def _check_room(self, name: str) -> None:
        if name not in self._loaded and len(self._loaded) >= self.max_loras:
            raise LoraLoadError(
                f"cannot load adapter {name!r}: max_loras={self.max_loras} adapters are loaded "
                f"({', '.join(self.names())}); unload one first"
            )

    def _not_found(self, name: str) -> LoraNotFoundError:
        loaded = ", ".join(self.names()) or "none"
        return LoraNotFoundError(f"no adapter {name!r} is loaded (loaded: {loaded})")
