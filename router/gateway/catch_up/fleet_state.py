"""A worker paused, or with its memory released, behind the router's back is brought back to the fleet's state.

A worker can say its generation is paused while the router has not paused it: it was stopped
(SIGSTOP, a stall) while the router broadcast a pause, and applied that pause when it ran again
after the router had continued the rest of the fleet; or someone paused it directly. SGLang, vLLM
and omni-worker park every request sent to a paused engine, so such a worker takes no traffic
(:attr:`~router.gateway.fleet.registry.Worker.paused_behind_router`; its requests that got no
answer yet were sent elsewhere when the probe found it), and this loop brings it to the fleet's state:

- the fleet runs (the router paused none of the other live workers): the worker is continued with
  its engine's route (SGLang's ``/continue_generation``, which omni-worker serves too; vLLM's
  ``/resume``), under the admin update lock, then read again; it takes traffic once it says it runs;
- the fleet is paused by the router (an update in progress): the pause the worker reports is the
  fleet's, so the router records it as its own; the fleet's continue then reaches it with the rest.

Memory is handled the same way: a worker that says its weights are released (omni-worker's
``weight_state``; vLLM and SGLang do not say, so the router goes by its own broadcasts) when the
router released none is not routable (it is ``pending``: "its weights are released"); when the
rest of the live fleet is asleep by the router's own call the state is recorded as the fleet's,
otherwise its memory is restored with its engine's route (``/resume_memory_occupation``; vLLM's
``/wake_up``) under the lock and it is read again. It serves only if it then holds the fleet's
weights: one released without a copy comes back ``partial`` and stays pending until an update.

A continue or a resume changes no weights, so nothing is fenced or journaled. Failures back off per worker as
catch-ups do (:func:`~router.gateway.catch_up.scan.backoff_s`); the reason stays in ``GET /workers``
(``pending``). A worker that is fenced (an operator decides), dead, departed or held by an update is
left alone. It runs only in the control process, and, with ``--leader-election``, only on the leader.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from aiohttp import web

from router.contract import endpoints as ep
from router.contract.admin import ContinueRequest, MemoryOccupationRequest
from router.contract.base import WireRequest
from router.contract.endpoint import AnyEndpoint
from router.contract.vllm import EmptyVllmRequest
from router.contract.vllm_dev import WakeUpQuery
from router.gateway.catch_up.scan import ScanLoop
from router.gateway.engines import engine_of, serves
from router.gateway.fleet.registry import Worker
from router.gateway.tasks import running
from router.gateway.upstream.answer import decode_answer

log = logging.getLogger(__name__)

LOCK_HOLDER = "bringing back a worker paused or released behind the router"


class ControlSync(ScanLoop):
    """The scan loop and one continue at a time (see the module docstring)."""

    scan_name = "control-state scan"
    lock_holder = LOCK_HOLDER

    def eligible(self, worker: Worker) -> bool:
        return (
            (worker.paused_behind_router or worker.released_behind_router)
            and worker.health != "dead"
            and not worker.disabled
            and not worker.removed
            and worker.departed is None
            and worker.update_holds == 0
        )

    def fleet_paused(self, worker: Worker) -> bool:
        """The router has paused the rest of the live fleet (an update is under way)."""
        others = [w for w in self._ctx.registry.live() if w.id != worker.id and not w.disabled]
        return bool(others) and all(w.paused for w in others)

    def fleet_asleep(self, worker: Worker) -> bool:
        """The router has released the memory of the rest of the live fleet (a colocated trainer runs)."""
        others = [w for w in self._ctx.registry.live() if w.id != worker.id and not w.disabled]
        return bool(others) and all(w.asleep for w in others)

    async def scan(self) -> None:
        if self.standby:
            return
        now = self._backoff.now()
        for worker in self._ctx.registry:
            if not self.eligible(worker):
                self._backoff.forget(worker.id)
                continue
            if worker.released_behind_router and self.fleet_asleep(worker):
                worker.asleep = True  # the fleet's own state: its resume will reach this worker too
            if worker.paused_behind_router and self.fleet_paused(worker):
                worker.paused = True  # the fleet's own state: its continue will reach this worker too
            if not self.eligible(worker):
                continue
            if self._backoff.due(worker.id, now):
                await self.bring_back(worker, self._backoff.attempts(worker.id))
                return  # one at a time

    async def bring_back(self, worker: Worker, attempts: int) -> bool:
        """Continue ``worker`` under the update lock and read it again; True once it says it runs."""
        lock = await self.take_lock()
        if lock is None:
            return False  # an update holds the lock; look again at the next scan
        try:
            if not self.eligible(worker):
                return True
            released = worker.released_behind_router
            error = await self._resume(worker) if released else await self._continue(worker)
            if error is None:
                await self._ctx.prober.refresh_metadata(worker)
                if not (worker.paused_behind_router or worker.released_behind_router):
                    self._backoff.forget(worker.id)
                    what = (
                        "had its memory released behind the router: resumed"
                        if released
                        else "was paused behind the router: continued"
                    )
                    log.info("worker %s (%s) %s", worker.id, worker.url, what)
                    return True
                error = "it still says it is paused or released"
        finally:
            lock.release()
        delay = self._backoff.failed(worker, attempts)
        log.warning(
            "bringing worker %s back to the fleet's state failed (%s); next try in %.0fs", worker.id, error, delay
        )
        return False

    async def _continue(self, worker: Worker) -> str | None:
        """Continue the worker's generation; why it failed, or ``None``."""
        return await self._engine_call(
            worker, (ep.CONTINUE_GENERATION, ContinueRequest()), (ep.RESUME, EmptyVllmRequest())
        )

    async def _resume(self, worker: Worker) -> str | None:
        """Restore the worker's released memory; why it failed, or ``None``."""
        return await self._engine_call(
            worker, (ep.RESUME_MEMORY_OCCUPATION, MemoryOccupationRequest()), (ep.WAKE_UP, WakeUpQuery())
        )

    async def _engine_call(
        self,
        worker: Worker,
        sglang: tuple[AnyEndpoint, WireRequest],
        vllm: tuple[AnyEndpoint, WireRequest],
    ) -> str | None:
        """SGLang's route where the worker serves it (omni-worker serves SGLang's), else vLLM's; why it failed,
        or ``None``."""
        engine = engine_of(worker)
        decode = engine.decode if engine is not None else decode_answer
        endpoint, request = sglang if serves(worker, sglang[0].path) else vllm
        answer = await self._workers.call(worker.url, endpoint, request, headers=self._headers, decode=decode)
        return None if answer.value is not None and answer.value.ok else answer.error or "no usable answer"


async def control_sync_ctx(app: web.Application) -> AsyncIterator[None]:
    """An aiohttp cleanup context: the scan loop for as long as the app runs."""
    async with running(ControlSync.from_app(app).run(), "control-state-sync"):
        yield
