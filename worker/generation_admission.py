"""Generation admission: the prompts this worker admits, and their handles until their callers have answers.

Invariants:

- A rid is in flight from :meth:`GenerationService.submit` until its handler calls
  :meth:`GenerationService.release`; a second submit of a rid in flight is refused.
- :meth:`GenerationService.release` is the one place a handle leaves the table. It aborts an
  unfinished request first, so the scheduler never keeps generating for nobody.
- Once draining (shutdown), nothing new is admitted; the routes check :attr:`GenerationService.draining`.
- Everything here runs on the event loop; the scheduler thread is reached only through
  ``submit_request`` / ``submit_abort``, which are thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from router.contract import endpoints as ep
from worker.engine.request import GenerationParams, OutputChannel, Request
from worker.engine.scheduler import Scheduler
from worker.generation_handle import GenerationHandle
from worker.model.lora import LoadedLora
from worker.ranks import Stage

log = logging.getLogger(__name__)

#: Aborting requests on the scheduler thread: the budget of ``/abort_request``.
ABORT_WAIT_S = ep.ABORT_REQUEST.budget.work_s
#: At shutdown, once the grace is over: how long the abort of what is left and its callers' answers
#: may take together (the scheduler acts between two steps, so this is far more than needed).
SHUTDOWN_ABORT_WAIT_S = 5.0
SHUTTING_DOWN = "the worker is shutting down"


class GenerationService:
    """The generations in flight on one worker: submit, release, abort, wait for answers, drain."""

    def __init__(self, stage: Stage):
        self._stage = stage
        self._inflight: dict[str, GenerationHandle] = {}
        self._draining = False

    @property
    def scheduler(self) -> Scheduler:
        return self._stage.leader

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def num_in_flight(self) -> int:
        """Generations admitted and not yet answered (a batch counts each of its prompts)."""
        return len(self._inflight)

    def rid_in_flight(self, rid: str) -> bool:
        return rid in self._inflight

    def submit(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        *,
        rid: str | None = None,
        stream: bool = False,
        return_text_in_logprobs: bool = False,
        wakeup: asyncio.Event | None = None,
        adapter: LoadedLora | None = None,
    ) -> GenerationHandle:
        """Queue one prompt; the caller must :meth:`release` the handle when done."""
        rid = rid or uuid.uuid4().hex
        if rid in self._inflight:
            raise ValueError(f"a request with rid {rid!r} is already in flight")
        channel = OutputChannel(asyncio.get_running_loop(), wakeup)
        request = Request(
            rid=rid, prompt_ids=list(prompt_ids), params=params, channel=channel, stream=stream, adapter=adapter
        )
        handle = GenerationHandle(request, channel, return_text_in_logprobs=return_text_in_logprobs)
        self._inflight[rid] = handle
        self.scheduler.submit_request(request)
        return handle

    def release(self, handle: GenerationHandle) -> None:
        """The handler is done with ``handle``: abort it if unfinished, mark it returned."""
        if not handle.finished:
            self.scheduler.submit_abort(handle.rid, message="Aborted: the client went away")
        if self._inflight.get(handle.rid) is handle:
            del self._inflight[handle.rid]
        handle.returned.set()

    async def abort(self, rid: str | None, *, abort_all: bool = False, message: str = "Aborted") -> list[str]:
        fut = self.scheduler.submit_abort(rid, abort_all=abort_all, message=message)
        result: list[str] = await asyncio.wait_for(asyncio.wrap_future(fut), ABORT_WAIT_S)
        return result

    async def wait_returned(self, rids: list[str], timeout_s: float) -> None:
        """Wait until the handlers of ``rids`` have produced their responses (bounded)."""
        pending = [self._inflight[r].returned.wait() for r in rids if r in self._inflight]
        if not pending:
            return
        try:
            await asyncio.wait_for(asyncio.gather(*pending), timeout_s)
        except TimeoutError:
            log.warning("aborted requests did not all return within %.1fs", timeout_s)

    def start_draining(self) -> None:
        """Admit no new generation from now on (``/generate`` answers 503, ``/health`` ``draining``),
        so that a router retries elsewhere and a readiness probe takes this worker out of service."""
        self._draining = True

    async def drain(self, grace_s: float, cut_short: asyncio.Event | None = None) -> tuple[int, int]:
        """Stop admitting, let the generations in flight finish for up to ``grace_s`` (less if
        ``cut_short`` is set), then abort the rest and wait, bounded, until their callers have
        their answers (``finish_reason`` ``abort`` with the partial output). Returns how many
        finished and how many were aborted."""
        self.start_draining()
        handles = list(self._inflight.values())

        async def all_returned() -> None:
            for handle in handles:
                await handle.returned.wait()

        if handles:
            waits: set[asyncio.Future[Any]] = {asyncio.ensure_future(all_returned())}
            if cut_short is not None:
                waits.add(asyncio.ensure_future(cut_short.wait()))
            try:
                await asyncio.wait(waits, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
        left = [h.rid for h in handles if not h.returned.is_set()]
        if left and self._stage.alive:
            deadline = time.monotonic() + SHUTDOWN_ABORT_WAIT_S
            aborted = self.scheduler.submit_abort(None, abort_all=True, message=f"Aborted: {SHUTTING_DOWN}")
            try:
                await asyncio.wait_for(asyncio.wrap_future(aborted), SHUTDOWN_ABORT_WAIT_S)
            except TimeoutError:
                log.warning("the scheduler did not abort the remaining requests within %.0fs", SHUTDOWN_ABORT_WAIT_S)
            await self.wait_returned(left, max(0.001, deadline - time.monotonic()))
        return len(handles) - len(left), len(left)
