"""The LoRA adapters this worker serves: loads, updates, unloads, and which adapter a request names.

Reading an adapter (a PEFT directory, or tensors a caller shared) and placing it on the model are
blocking work and run in a thread, one load or unload at a time; the table of loaded adapters
(:class:`~worker.model.lora.LoraAdapters`) swaps an adapter in with one assignment once it is placed
whole, so a request admitted meanwhile gets the old adapter or the new one, never a mix. A change
whose caller went away still ends (the next change waits for it), and the table and the sources it
reports stay in step. A request holds the :class:`~worker.model.lora.LoadedLora` it was admitted with
to its end: an update or an unload never changes the adapter of a request in flight (its KV cache was
computed with that adapter), and the memory of an unloaded adapter is freed when its last request ends.

On a tensor-parallel worker rank 0 reads the adapter once and places its own slice; then, on its
scheduler thread (so in order with forward steps), every follower rank places its slice of the same
tensors (:meth:`worker.tp.peers.TPPeers.load_adapter`), and the new version is served only once every
rank holds it. A rank that refuses it leaves the old version serving on every rank; a rank lost
meanwhile fails the worker, as any tensor-parallel operation does. Followers hold no names: forward
steps name each sequence's adapter version for them, and an unload reaches them as the freeing of
rank 0's copy.

Names are chosen as SGLang and vLLM choose them: ``lora_path`` on ``/generate`` names the adapter;
``model`` on the OpenAI and token routes is an adapter's name, or ``<base>:<adapter>`` (SGLang,
split at the first ``:``), or the served model (the base).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from router.contract.errors import ApiError
from router.contract.lora import TENSOR_SOURCE, LoadLoraAdapterFromTensorsRequest
from worker.model.lora import LoadedLora, LoraAdapter, LoraAdapters, LoraLoadError, LoraNotFoundError
from worker.model.lora.loaded import LoraHost
from worker.tp.peers import ADAPTER_LOAD_TIMEOUT_S, TPRankLost
from worker.transfer.handles import safe_unpickle
from worker.transfer.handles.pickle_records import UnsafePayload

if TYPE_CHECKING:
    from worker.ranks import Stage

T = TypeVar("T")

#: How long a load or unload waits for the one before it.
CHANGE_WAIT_S = 120.0
#: Beyond the followers' own bound on placing an adapter: rank 0's scheduler thread may first end a step.
FOLLOWER_MARGIN_S = 30.0
#: Tensors one adapter sent as a pickle may name (7 projections x 2 matrices x layers, with room).
MAX_ADAPTER_TENSORS = 16384


class LoraDisabled(ApiError):
    def __init__(self) -> None:
        super().__init__(400, "LoRA adapters are not enabled on this worker: start it with --enable-lora")


class AdapterService:
    """The worker's adapters (``None`` table: LoRA is off, every adapter call is a 400); on a tensor-parallel
    worker, ``stage`` holds the follower ranks every adapter is placed on too (``model`` is rank 0's)."""

    def __init__(
        self,
        model: LoraHost | None,
        *,
        max_loras: int,
        max_lora_rank: int,
        allow_pickled: bool,
        stage: Stage | None = None,
    ):
        self._table = None if model is None else LoraAdapters(model, max_loras=max_loras, max_lora_rank=max_lora_rank)
        self._sources: dict[str, str] = {}
        self._checksums: dict[str, str] = {}
        """Each loaded adapter's :meth:`LoraAdapter.checksum`, reported with a load so the router can check it."""
        self._change = asyncio.Lock()
        self._running: set[asyncio.Future[Any]] = set()
        self._allow_pickled = allow_pickled
        self._stage = stage if stage is not None and stage.peers is not None else None

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

    def checksum(self, name: str) -> str | None:
        """The checksum of the tensors ``name`` holds (``None``: not loaded)."""
        return self._checksums.get(name)

    # -- changes --------------------------------------------------------------------
    async def load_path(self, name: str, path: str, *, replace: bool = True) -> LoadedLora:
        """Load (or, when ``replace``, update) ``name`` from a PEFT directory; :class:`LoraLoadError` changes nothing."""
        table = self._require()

        async def change() -> LoadedLora:
            if not replace and name in table:
                raise LoraLoadError(f"an adapter named {name!r} is already loaded")
            return await self._load(table, name, path, lambda: LoraAdapter.from_dir(Path(path)))

        return await self._changing(change)

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
            # Entry 0 serves every rank (each slices the full tensors): the follower ranks get the tensors this
            # rank materialized from it, never a caller's bytes.
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

        def read() -> LoraAdapter:
            tensors = {name: safe_unpickle.materialize(record) for name, record in records}
            return LoraAdapter.from_tensors(config, tensors)

        return await self._changing(lambda: self._load(table, req.lora_name, TENSOR_SOURCE, read))

    async def unload(self, name: str) -> LoadedLora:
        """Stop admitting requests for ``name``; those running with it finish with it. The follower ranks of a
        tensor-parallel worker let their copy go when rank 0's is freed (:mod:`worker.tp.peers`)."""
        table = self._require()

        async def change() -> LoadedLora:
            unloaded = table.unload(name)
            self._sources.pop(name, None)
            self._checksums.pop(name, None)
            return unloaded

        return await self._changing(change)

    async def _load(self, table: LoraAdapters, name: str, source: str, read: Callable[[], LoraAdapter]) -> LoadedLora:
        """Read and place on this rank (in a thread), then on every follower rank, then serve: all ranks or none."""

        def read_and_prepare() -> tuple[LoraAdapter, LoadedLora, str]:
            adapter = read()
            return adapter, table.prepare(name, adapter), adapter.checksum()

        adapter, placed, checksum = await asyncio.to_thread(read_and_prepare)
        if self._stage is not None:
            await self._on_followers(self._stage, placed, adapter)
        table.commit(placed)
        self._sources[name] = source
        self._checksums[name] = checksum
        return placed

    async def _on_followers(self, stage: Stage, placed: LoadedLora, adapter: LoraAdapter) -> None:
        """Every follower rank places ``adapter`` as ``placed``, sent from rank 0's scheduler thread (in order with
        forward steps): :class:`LoraLoadError` naming the ranks that refused it; 503 when a rank is lost (the
        worker then fails) or the followers do not answer in time."""
        peers = stage.peers
        assert peers is not None
        if not stage.alive:
            raise ApiError(503, f"adapter {placed.name!r} not loaded: a rank of this worker is not running")
        assert self._table is not None
        run = functools.partial(peers.load_adapter, placed, adapter, max_rank=self._table.max_lora_rank)
        future = stage.leader.submit_admin(run)
        try:
            async with asyncio.timeout(ADAPTER_LOAD_TIMEOUT_S + FOLLOWER_MARGIN_S):
                results = await asyncio.wrap_future(future)
        except TimeoutError:
            future.cancel()  # if it has not started, nothing reached the followers
            raise ApiError(503, f"the follower ranks did not place adapter {placed.name!r} in time") from None
        except TPRankLost as exc:
            raise ApiError(503, f"adapter {placed.name!r} not loaded: {exc}") from None
        except Exception as exc:  # it reached no follower (the scheduler thread stopped, say)
            raise LoraLoadError(f"adapter {placed.name!r} not placed on the follower ranks: {exc}") from None
        refused = [f"rank {rank}: {r.message}" for rank, r in enumerate(results, start=1) if not r.success]
        if refused:
            raise LoraLoadError(
                f"adapter {placed.name!r} was refused by tensor-parallel {'; '.join(refused)}; no rank serves this "
                "version (one loaded before it still serves)"
            )

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

    async def _changing(self, change: Callable[[], Awaitable[T]]) -> T:
        """``change()`` once the change before it ended (waiting at most :data:`CHANGE_WAIT_S`). It runs to its
        end even if its caller goes away, and holds the turn until then: changes never overlap."""
        try:
            async with asyncio.timeout(CHANGE_WAIT_S):
                await self._change.acquire()
        except TimeoutError:
            raise ApiError(503, f"another adapter load or unload held the worker for {CHANGE_WAIT_S:g}s") from None

        async def run() -> T:
            try:
                return await change()
            finally:
                self._change.release()

        task = asyncio.ensure_future(run())
        self._running.add(task)  # the loop holds a task weakly
        task.add_done_callback(self._running.discard)
        return await asyncio.shield(task)
