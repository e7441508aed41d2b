"""A worker that joins or restarts is given the fleet's LoRA adapters before any request naming them goes there.

The fleet's adapter table (:mod:`router.gateway.fleet.adapters`) says who holds each adapter's fleet
version, and in which process. A worker that holds none of a serving adapter (it joined after the
load, it restarted, or a rollback left it without one) is simply not a candidate for requests naming
it; this loop gives it the adapter: the fleet version's path, loaded with SGLang's
``/load_lora_adapter`` (omni-worker, SGLang) or vLLM's ``/v1/load_lora_adapter`` with ``load_inplace``
(a vLLM server that kept the name across a weight change takes it again) under the admin update lock,
one worker and one adapter at a time. Once the
load succeeds the worker holds the fleet version, in the process it was loaded into, and the next
routing snapshot sends it requests naming the adapter.

Each version of an adapter loaded as ``name@version`` is an adapter of its own here: a restarted worker is
given every version the fleet still holds, the latest first (requests naming the adapter without a version
go to holders of the latest). An SGLang server that answers a load "already loaded" (a copy the router does not
know, such as one a failed rollback left) has it unloaded and loaded again from the fleet's path: SGLang has no
update in place, and reports no digest that could prove the copy it holds is the fleet's.

An adapter the fleet received as tensors cannot be given (the router does not keep them): such a worker
gets no request naming it until the next fleet-wide load. Only workers that serve the route and take
traffic are given adapters (a pending, fenced, dead or departed worker is left alone; one that catches
up on its weights first gets them afterwards). Failures back off per worker as catch-ups do. It runs
only in the control process, and with ``--leader-election`` only on the leader.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from router.contract.base import WireRequest
from router.contract.endpoint import AnyEndpoint
from router.contract.fleet_adapters import FleetAdapter
from router.contract.lora import (
    TENSOR_SOURCE,
    LoadLoraAdapterRequest,
    LoraUpdateResult,
    UnloadLoraAdapterRequest,
)
from router.contract.lora_endpoints import LOAD_LORA_ADAPTER, UNLOAD_LORA_ADAPTER, V1_LOAD_LORA_ADAPTER
from router.gateway.catch_up.scan import ScanLoop
from router.gateway.engines import engine_of
from router.gateway.fleet.registry import Worker
from router.gateway.tasks import running
from router.gateway.upstream.answer import WorkerAnswer, decode_answer, decode_plain

log = logging.getLogger(__name__)

LOCK_HOLDER = "giving a worker the fleet's LoRA adapters"


class AdapterCatchUp(ScanLoop):
    """The scan loop and one adapter load at a time (see the module docstring)."""

    scan_name = "adapter catch-up scan"
    lock_holder = LOCK_HOLDER

    def missing(self, worker: Worker) -> FleetAdapter | None:
        """The first adapter ``worker`` should hold and does not, if it can be given one now."""
        registry = self._ctx.registry
        if not registry.is_routable(worker) or worker.update_holds or worker.instance_id is None:
            return None
        engine = engine_of(worker)
        if engine is not None and engine.lora_load_route(worker) is None:
            return None  # its server takes no LoRA load (a worker of unknown engine is tried)
        entries = (registry.adapters.get(name) for name in registry.adapters.serving_names())
        # The latest first: requests naming a versioned adapter without its version go to holders of its latest.
        for entry in sorted((e for e in entries if e is not None), key=lambda e: -e.published):
            if entry.source != TENSOR_SOURCE and not registry.adapters.holds(worker, entry.name):
                return entry
        return None

    async def scan(self) -> None:
        if not self._ctx.registry.adapters or self.standby:
            return
        now = self._backoff.now()
        for worker in self._ctx.registry:
            entry = self.missing(worker)
            if entry is None:
                self._backoff.forget(worker.id)
                continue
            if self._backoff.due(worker.id, now):
                await self.give(worker, entry.name, self._backoff.attempts(worker.id))
                return  # one at a time

    async def give(self, worker: Worker, name: str, attempts: int) -> bool:
        """Load the fleet version of ``name`` into ``worker`` under the update lock; True once it holds it."""
        lock = await self.take_lock()
        if lock is None:
            return False  # an update holds the lock; look again at the next scan
        try:
            entry = self.missing(worker)  # the table may have changed while the lock was taken
            if entry is None or entry.name != name:
                return True
            instance = worker.instance_id
            endpoint, request = _load_call(worker, name, entry.source)
            decode = decode_plain if endpoint is V1_LOAD_LORA_ADAPTER else decode_answer
            answer = await self._workers.call(worker.url, endpoint, request, headers=self._headers, decode=decode)
            if endpoint is LOAD_LORA_ADAPTER and _already_loaded(answer):
                answer = await self._load_again(worker, name, request)
            if answer.value is not None and answer.value.ok:
                self._ctx.registry.adapters.add_holder(name, worker.id, entry.version, instance)
                self._ctx.barrier.announce()
                await self._ctx.registry.adapters.save()
                self._backoff.forget(worker.id)
                log.info(
                    "worker %s (%s) was given LoRA adapter %r (fleet version %d)",
                    worker.id,
                    worker.url,
                    name,
                    entry.version,
                )
                return True
            error = answer.error or "no usable answer"
        finally:
            lock.release()
        delay = self._backoff.failed(worker, attempts)
        log.warning("giving worker %s LoRA adapter %r failed (%s); next try in %.0fs", worker.id, name, error, delay)
        return False

    async def _load_again(self, worker: Worker, name: str, load: WireRequest) -> WorkerAnswer[Any]:
        """Unload the copy of ``name`` the worker holds unknown to the router (no request naming it goes there),
        then load the fleet version; the unload's answer when it failed."""
        unload = UnloadLoraAdapterRequest(lora_name=name)
        gone = await self._workers.call(
            worker.url, UNLOAD_LORA_ADAPTER, unload, headers=self._headers, decode=decode_answer
        )
        if gone.value is None or not gone.value.ok:
            return gone
        log.info(
            "worker %s held a copy of LoRA adapter %r the router did not know: unloaded, loading it", worker.id, name
        )
        return await self._workers.call(
            worker.url, LOAD_LORA_ADAPTER, load, headers=self._headers, decode=decode_answer
        )


def _already_loaded(answer: WorkerAnswer[Any]) -> bool:
    """SGLang's refusal of a name it holds ("Failed to load LoRA adapter X because it is already loaded")."""
    body = answer.body
    said = [answer.error or "", body.error_message or "" if isinstance(body, LoraUpdateResult) else ""]
    return answer.status == 400 and any("already loaded" in text for text in said)


def _load_call(worker: Worker, name: str, path: str) -> tuple[AnyEndpoint, WireRequest]:
    """The load route ``worker``'s engine takes (:meth:`~router.gateway.engines.base.Engine.lora_load`); SGLang's
    for a worker whose engine is not known yet."""
    engine = engine_of(worker)
    call = engine.lora_load(worker, name, path) if engine is not None else None
    if call is None:
        return LOAD_LORA_ADAPTER, LoadLoraAdapterRequest(lora_name=name, lora_path=path)
    return call.endpoint, call.request


async def adapter_catch_up_ctx(app: web.Application) -> AsyncIterator[None]:
    """An aiohttp cleanup context: the scan loop for as long as the app runs."""
    async with running(AdapterCatchUp.from_app(app).run(), "adapter-catch-up"):
        yield
