"""The LoRA adapters this worker serves: loads, updates, unloads, and which adapter a request names.

Reading an adapter (a PEFT directory, or tensors a caller shared) and placing it on the model are
blocking work and run in a thread, one load or unload at a time; the table of loaded adapters
(:class:`~worker.model.lora.LoraAdapters`) swaps an adapter in with one assignment once it is placed
whole, so a request admitted meanwhile gets the old adapter or the new one, never a mix. A change
whose caller went away still ends, and the table and the sources it reports stay in step. A request holds the :class:`~worker.model.lora.LoadedLora` it was
admitted with to its end: an update or an unload never changes the adapter of a request in flight
(its KV cache was computed with that adapter), and the memory of an unloaded adapter is freed when
its last request ends.

Names are chosen as SGLang and vLLM choose them: ``lora_path`` on ``/generate`` names the adapter;
``model`` on the OpenAI and token routes is an adapter's name, or ``<base>:<adapter>`` (SGLang,
split at the first ``:``), or the served model (the base).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from router.contract.errors import ApiError
from router.contract.lora import TENSOR_SOURCE, LoadLoraAdapterFromTensorsRequest
from worker.model.lora import LoadedLora, LoraAdapter, LoraAdapters, LoraLoadError, LoraNotFoundError
from worker.model.lora.loaded import LoraHost
from worker.transfer.handles import safe_unpickle
from worker.transfer.handles.pickle_records import UnsafePayload

#: How long a load or unload waits for the one before it.
CHANGE_WAIT_S = 120.0
#: Tensors one adapter sent as a pickle may name (7 projections x 2 matrices x layers, with room).
MAX_ADAPTER_TENSORS = 16384


class LoraDisabled(ApiError):
    def __init__(self) -> None:
        super().__init__(400, "LoRA adapters are not enabled on this worker: start it with --enable-lora")


class AdapterService:
    """The worker's adapters (``None`` table: LoRA is off, every adapter call is a 400)."""

    def __init__(self, model: LoraHost | None, *, max_loras: int, max_lora_rank: int, allow_pickled: bool):
        self._table = None if model is None else LoraAdapters(model, max_loras=max_loras, max_lora_rank=max_lora_rank)
        self._sources: dict[str, str] = {}
        self._change = asyncio.Lock()
        self._allow_pickled = allow_pickled

    @property
    def enabled(self) -> bool:
        return self._table is not None

    @property
    def max_loras(self) -> int:
        return 0 if self._table is None else self._table.max_loras

    @property
    def max_lora_rank(self) -> int:
        return 0 if self._table is None else self._table.max_lora_rank

    def loaded(self) -> dict[str, str]:
        """Every loaded adapter's name and where it came from (its path, or SGLang's ``__tensor__``)."""
        return dict(sorted(self._sources.items()))

    def version(self, name: str) -> int | None:
        table = self._table
        return table.get(name).version if table is not None and name in table else None

    # -- changes --------------------------------------------------------------------
    async def load_path(self, name: str, path: str, *, replace: bool = True) -> LoadedLora:
        """Load (or, when ``replace``, update) ``name`` from a PEFT directory; :class:`LoraLoadError` changes nothing."""
        table = self._require()
        async with self._changing():
            if not replace and name in table:
                raise LoraLoadError(f"an adapter named {name!r} is already loaded")

            def read_and_place() -> LoadedLora:
                loaded = table.load(name, LoraAdapter.from_dir(Path(path)))
                self._sources[name] = path
                return loaded

            return await asyncio.shield(asyncio.to_thread(read_and_place))

    async def load_tensors(self, req: LoadLoraAdapterFromTensorsRequest) -> LoadedLora:
        """Load (or update) an adapter sent as SGLang sends it: its config and one pickled tensor list per rank."""
        table = self._require()
        if not self._allow_pickled:
            raise LoraLoadError(
                "pickled serialized_named_tensors are refused: start the worker with --allow-pickled-tensors "
                "(restricted unpickler)"
            )
        if req.load_format not in (None, "direct"):
            raise LoraLoadError(f"load_format {req.load_format!r} is not supported for adapters; expected direct")
        try:
            payload = safe_unpickle.loads(req.serialized_named_tensors[0])
            # SGLang reads an adapter's tensors as a {name: tensor} dict (verl sends one); a list of pairs, as its
            # weight updates are sent, is read too.
            pairs = list(payload.items()) if isinstance(payload, dict) else payload
            records = safe_unpickle.named_lazy_tensors(pairs, None)
        except UnsafePayload as exc:
            raise LoraLoadError(f"serialized_named_tensors: {exc}") from None
        if len(records) > MAX_ADAPTER_TENSORS:
            raise LoraLoadError(f"an adapter of {len(records)} tensors is more than the {MAX_ADAPTER_TENSORS} allowed")
        config: Mapping[str, Any] = req.config_dict

        def read_and_place() -> LoadedLora:
            tensors = {name: safe_unpickle.materialize(record) for name, record in records}
            loaded = table.load(req.lora_name, LoraAdapter.from_tensors(config, tensors))
            self._sources[req.lora_name] = TENSOR_SOURCE
            return loaded

        async with self._changing():
            return await asyncio.shield(asyncio.to_thread(read_and_place))

    async def unload(self, name: str) -> LoadedLora:
        """Stop admitting requests for ``name``; those running with it finish with it."""
        table = self._require()
        async with self._changing():
            unloaded = table.unload(name)
            self._sources.pop(name, None)
            return unloaded

    # -- requests -------------------------------------------------------------------
    def resolve(self, name: str | None) -> LoadedLora | None:
        """The adapter a request names (``None``: the base model); 404 naming the loaded ones otherwise."""
        if name is None:
            return None
        table = self._table
        if table is None:
            raise ApiError(404, f"no LoRA adapter {name!r}: LoRA adapters are not enabled on this worker")
        try:
            return table.get(name)
        except LoraNotFoundError as exc:
            raise ApiError(404, str(exc)) from None

    def for_model(self, model: str | None, served: str) -> LoadedLora | None:
        """The adapter an OpenAI or token request's ``model`` names: an adapter's own name, or SGLang's
        ``<base>:<adapter>``; ``None`` for the base model. Without LoRA any name is the base model (the worker
        serves one); with LoRA on, a name that is neither the served model nor a loaded adapter is a 404 naming
        the loaded ones, as vLLM answers: an adapter this worker lacks must not be served by the base model."""
        table = self._table
        if model is None or table is None or model == served:
            return None
        if model in table:
            return table.get(model)
        _, sep, adapter = model.partition(":")
        if sep and adapter:
            return self.resolve(adapter)
        loaded = ", ".join(sorted(table.names())) or "none"
        raise ApiError(
            404, f"the model {model!r} does not exist: this worker serves {served!r} (LoRA adapters: {loaded})"
        )

    # -- internals --------------------------------------------------------------------
    def _require(self) -> LoraAdapters:
        if self._table is None:
            raise LoraDisabled()
        return self._table

    def _changing(self) -> _Change:
        return _Change(self._change)


class _Change:
    """One adapter change at a time, waiting at most :data:`CHANGE_WAIT_S` for the one before."""

    def __init__(self, lock: asyncio.Lock):
        self._lock = lock

    async def __aenter__(self) -> None:
        try:
            async with asyncio.timeout(CHANGE_WAIT_S):
                await self._lock.acquire()
        except TimeoutError:
            raise ApiError(503, f"another adapter load or unload held the worker for {CHANGE_WAIT_S:g}s") from None

    async def __aexit__(self, *_exc: object) -> None:
        self._lock.release()
