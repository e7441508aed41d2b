"""Coordinator: the event-loop facade the HTTP handlers use.

It submits generations to the stage leader's scheduler, runs admin operations
on every rank through the :class:`~worker.stage.Stage`, serializes operations
that change weights or pause state, and bounds every wait with a timeout.
Extension point for other admin routes: :meth:`Coordinator.run_on_scheduler`
(a callable on the leader's scheduler thread) and :meth:`Coordinator.admin`
(an op on every rank, aggregated with ``rank_results``), inside
:meth:`Coordinator.admin_section` when the op changes weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

from router.contract import endpoints as ep
from router.contract.admin import (
    ContinueRequest,
    MemoryOccupationRequest,
    PauseRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromTensorRequest,
)
from router.contract.vllm import SCHEDULER_PAUSE_MODE
from router.contract.vllm_dev import SLEEP_PAUSE_MODE, AbortRequestsRequest, SleepQuery, WakeUpQuery
from router.dataplane.buckets import NamedTensors
from worker.engine import admin_ops
from worker.engine.admin_ops import OpResult
from worker.engine.daemon_thread import Abandoned, run_on_daemon_thread
from worker.engine.model_worker import ModelWorker, StagedCheckpoint, WeightUpdateError
from worker.engine.request import GenerationParams, OutputChannel, Request
from worker.engine.scheduler import Scheduler
from worker.engine.weight_ops import CommitOptions
from worker.engine.weight_state import WeightState
from worker.generation import GenerationHandle
from worker.stage import AdminTimeout, RankOp, SchedulerUnavailable, Stage, StageResult, held
from worker.updates import UpdateFailed, UpdatePipeline, UpdateRefused

log = logging.getLogger(__name__)

S = TypeVar("S")

#: Aborting requests on the scheduler thread: the budget of ``/abort_request``.
ABORT_WAIT_S = ep.ABORT_REQUEST.budget.work_s
#: At shutdown, once the grace is over: how long the abort of what is left and its callers' answers
#: may take together (the scheduler acts between two steps, so this is far more than needed).
SHUTDOWN_ABORT_WAIT_S = 5.0
SHUTTING_DOWN = "the worker is shutting down"
#: How often a ``drain`` pause looks whether the running requests have ended.
DRAIN_POLL_S = 0.02
_NO_EMPTY = ContinueRequest(torch_empty_cache=False)


class Coordinator:
    """Generation and admin entry points for one worker process."""

    def __init__(self, stage: Stage, *, health_check_timeout_s: float = 20.0):
        self.stage = stage
        self.health_check_timeout_s = health_check_timeout_s
        self._admin_lock = asyncio.Lock()
        self._inflight: dict[str, GenerationHandle] = {}
        self.updates = UpdatePipeline(self)
        """Every weight update of this worker goes through this one pipeline."""
        self.instance_id = uuid.uuid4().hex
        """Tells a router that this process is new (a restarted worker holds its boot checkpoint)."""
        self._draining = False

    # -- accessors -------------------------------------------------------------------
    @property
    def scheduler(self) -> Scheduler:
        return self.stage.leader

    @property
    def worker(self) -> ModelWorker:
        return self.stage.leader.worker

    @property
    def alive(self) -> bool:
        return self.stage.alive

    @property
    def is_paused(self) -> bool:
        return self.scheduler.is_paused

    @property
    def draining(self) -> bool:
        """The process is shutting down: no new generation is admitted."""
        return self._draining

    @property
    def num_in_flight(self) -> int:
        """Generations admitted and not yet answered (a batch counts each of its prompts)."""
        return len(self._inflight)

    @property
    def weight_state(self) -> str:
        """The weights' state over every rank: the least servable one."""
        states = [rank.worker.ledger.state for rank in self.stage.views()]
        for state in (WeightState.PARTIAL, WeightState.WRITING, WeightState.RELEASED):
            if state in states:
                return state.value
        return WeightState.SERVING.value

    @property
    def cannot_serve(self) -> str | None:
        """Why a request would wait with no end in sight (weights partial or released), or None.

        A paused worker or one being updated can serve again soon, so its requests wait (as
        SGLang's do); a worker whose weights are partial or released cannot, so it refuses."""
        state = self.weight_state
        if state == WeightState.PARTIAL.value:
            return "the weights are partially updated (a weight update failed midway); a full update or a reload must replace them first"
        if state == WeightState.RELEASED.value:
            return "the weights are released (release_memory_occupation); call /resume_memory_occupation first"
        return None

    @property
    def generation_blocked(self) -> str | None:
        """Why generation cannot make progress right now, or None."""
        s = self.scheduler
        if s.is_paused:
            return f"generation is paused (mode={s.pause_mode})"
        if self.worker.released_tags:
            return f"memory is released ({', '.join(sorted(self.worker.released_tags))})"
        if self.worker.weights_partial:
            return "weights are partially updated"
        return None

    # -- admin plumbing ----------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def admin_section(self, action: str, timeout_s: float) -> AsyncIterator[None]:
        """Hold the lock that serializes weight and pause changes (waiting at most ``timeout_s``)."""
        busy = f"{action}: another admin operation held the worker for {timeout_s:g}s"
        async with held(self._admin_lock, timeout_s, busy):
            yield

    async def admin(self, action: str, op: RankOp, timeout_s: float, follower_op: RankOp | None = None) -> StageResult:
        """Run ``op`` on every rank (scheduler threads) and aggregate with ``rank_results``
        (``follower_op`` on the follower ranks of a tensor-parallel worker, when given)."""
        return await self.stage.run(action, op, timeout_s, follower_op)

    async def run_on_scheduler(self, fn: Callable[[], Any], timeout_s: float, action: str = "admin") -> Any:
        """Run ``fn()`` on the leader's scheduler thread between steps; its raw result."""
        if not self.scheduler.alive:
            raise SchedulerUnavailable(f"{action}: the scheduler thread is not running")
        fut = self.scheduler.submit_admin(fn)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s)
        except TimeoutError:
            fut.cancel()
            raise AdminTimeout(action, timeout_s) from None

    # -- generation ------------------------------------------------------------------------
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
    ) -> GenerationHandle:
        """Queue one prompt; the caller must :meth:`release` the handle when done."""
        rid = rid or uuid.uuid4().hex
        if rid in self._inflight:
            raise ValueError(f"a request with rid {rid!r} is already in flight")
        channel = OutputChannel(asyncio.get_running_loop(), wakeup)
        request = Request(rid=rid, prompt_ids=list(prompt_ids), params=params, channel=channel, stream=stream)
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
        return await asyncio.wait_for(asyncio.wrap_future(fut), ABORT_WAIT_S)

    async def wait_returned(self, rids: list[str], timeout_s: float) -> None:
        """Wait until the handlers of ``rids`` have produced their responses (bounded)."""
        pending = [self._inflight[r].returned.wait() for r in rids if r in self._inflight]
        if not pending:
            return
        try:
            await asyncio.wait_for(asyncio.gather(*pending), timeout_s)
        except TimeoutError:
            log.warning("aborted requests did not all return within %.1fs", timeout_s)

    # -- composite admin operations -------------------------------------------------------
    async def pause(self, req: PauseRequest, timeout_s: float) -> StageResult:
        """``/pause_generation``: see :meth:`pause_in`."""
        return await self.pause_in(req.mode, timeout_s, action="pause_generation")

    async def pause_in(self, mode: str, timeout_s: float, *, action: str = "pause") -> StageResult:
        """Pause in a scheduler mode. ``abort`` returns only after every aborted request has been
        answered; ``drain`` only once the running requests have ended (past ``timeout_s`` the
        drain is called off, generation goes on, and the caller gets :class:`AdminTimeout`)."""
        deadline = time.monotonic() + timeout_s
        async with self.admin_section(action, timeout_s):
            return await self._pause_held(mode, action, deadline, timeout_s)

    async def _pause_held(self, mode: str, action: str, deadline: float, timeout_s: float) -> StageResult:
        """:meth:`pause_in`'s work, inside the admin section."""
        result = await self.admin(action, partial(admin_ops.pause, mode=mode), _left(deadline))
        if mode == "abort":
            await self.wait_returned(list(result.data.get("aborted_rids", [])), _left(deadline))
        elif mode == "drain":
            await self._drained(action, deadline, timeout_s)
        return result

    @property
    def is_sleeping(self) -> bool:
        """vLLM's ``is_sleeping``: generation paused, or any memory released."""
        return self.is_paused or bool(self.worker.released_tags)

    async def sleep(self, req: SleepQuery, timeout_s: float) -> StageResult:
        """vLLM's ``/sleep``: pause in ``req.mode`` (at level 1 or 2 ``keep`` retracts: the KV is about
        to be freed), then at level 1 or 2 release the memory, the weights with a host copy at level 1
        and without one at level 2. A release that is refused un-pauses a worker this call paused,
        so the refusal leaves generation as it found it (requests a pause in ``abort`` mode ended stay
        ended, as in vLLM, whose sleep aborts them first too)."""
        deadline = time.monotonic() + timeout_s
        async with self.admin_section("sleep", timeout_s):
            was_paused = self.is_paused
            mode = (SLEEP_PAUSE_MODE if req.level else SCHEDULER_PAUSE_MODE)[req.mode]
            paused = await self._pause_held(mode, "sleep", deadline, timeout_s)
            if not req.level:
                return paused
            release = MemoryOccupationRequest(tags=req.tags, keep_weights=req.keep_weights)
            result = await self.admin("sleep", partial(admin_ops.release_memory, req=release), _left(deadline))
            if not result.success and not was_paused:
                await self.admin("sleep", partial(admin_ops.continue_generation, req=_NO_EMPTY), _left(deadline))
            return result

    async def wake_up(self, req: WakeUpQuery, timeout_s: float) -> StageResult:
        """vLLM's ``/wake_up``: restore the released memory ``req`` names (all of it by default), then,
        once nothing is released any more, resume generation (vLLM resumes its scheduler when fully awake)."""
        deadline = time.monotonic() + timeout_s
        async with self.admin_section("wake_up", timeout_s):
            tags = req.memory_tags()
            resume = MemoryOccupationRequest.model_validate({"tags": tags or None})
            if tags == []:  # ``scheduling`` alone: no memory to restore
                result = self._answer("wake_up", True, "nothing to restore", resumed=[])
            else:
                result = await self.admin("wake_up", partial(admin_ops.resume_memory, req=resume), _left(deadline))
            if result.success and not self.worker.released_tags and self.is_paused:
                await self.admin("wake_up", partial(admin_ops.continue_generation, req=_NO_EMPTY), _left(deadline))
            return result

    async def abort_requests(self, req: AbortRequestsRequest, timeout_s: float) -> StageResult:
        """vLLM's ``/abort_requests``: the requests ``req`` names, or all; answers once their callers have
        their (aborted) answers."""
        deadline = time.monotonic() + timeout_s
        result = await self.admin("abort_requests", partial(admin_ops.abort_requests, req=req), _left(deadline))
        await self.wait_returned(list(result.data.get("aborted_rids", [])), _left(deadline))
        return result

    async def _drained(self, action: str, deadline: float, timeout_s: float) -> None:
        """Wait until a ``drain`` pause has taken hold on the leader (its running requests ended)."""
        while not self.scheduler.is_paused:
            if time.monotonic() >= deadline or self.scheduler.pause_mode != "drain":
                req = ContinueRequest(torch_empty_cache=False)
                await self.admin(action, partial(admin_ops.continue_generation, req=req), SHUTDOWN_ABORT_WAIT_S)
                raise AdminTimeout(f"{action} (waiting for running requests to end)", timeout_s)
            await asyncio.sleep(DRAIN_POLL_S)

    async def update_weights_from_disk(self, req: UpdateWeightsFromDiskRequest, timeout_s: float) -> StageResult:
        """One update transaction: check, read and validate the checkpoint off the scheduler
        thread (inference keeps running), abort requests if asked, write it in one step."""

        def options(staged: StagedCheckpoint) -> CommitOptions:
            return CommitOptions(
                names=tuple(name for name, _ in staged.tensors),
                whole=True,
                weight_version=req.weight_version,
                flush_cache=req.flush_cache,
                keep_pause=req.keep_pause,
                empty_cache=req.torch_empty_cache,
                token_step=req.token_step,
                model_path=staged.path,
                load_format=staged.load_format,
            )

        result = await self._update_in_one_step(
            "update_weights_from_disk",
            abort_all=req.abort_all_requests,
            timeout_s=timeout_s,
            stage=lambda bound_s: self._read_checkpoint(req, bound_s),
            tensors=lambda staged: staged.tensors,
            require_complete=True,
            options=options,
        )
        result.data.update(model_path=self.worker.model_path)
        return result

    async def update_weights_from_tensor(
        self, req: UpdateWeightsFromTensorRequest, stage: Callable[[], NamedTensors], timeout_s: float
    ) -> StageResult:
        """Like :meth:`update_weights_from_disk`: ``stage`` (open the shared memory, copy the tensors
        out; already checked against the model) runs off the event loop, then the tensors are written
        in one step with rollback. It may be a subset of the weights."""

        def options(named: NamedTensors) -> CommitOptions:
            return CommitOptions(
                names=tuple(name for name, _ in named), weight_version=req.weight_version, flush_cache=req.flush_cache
            )

        return await self._update_in_one_step(
            "update_weights_from_tensor",
            abort_all=req.abort_all_requests,
            timeout_s=timeout_s,
            stage=lambda bound_s: asyncio.wait_for(asyncio.to_thread(stage), bound_s),
            tensors=lambda named: named,
            require_complete=False,
            options=options,
            staging_errors=(ValueError, OSError, RuntimeError),
        )

    async def _update_in_one_step(
        self,
        action: str,
        *,
        abort_all: bool,
        timeout_s: float,
        stage: Callable[[float], Awaitable[S]],
        tensors: Callable[[S], NamedTensors],
        require_complete: bool,
        options: Callable[[S], CommitOptions],
        staging_errors: tuple[type[Exception], ...] = (),
    ) -> StageResult:
        """begin → ``stage`` (bounded by the step's time) → take → apply (one step, rollback) → commit,
        or fail: the shape of every update whose weights are staged whole before they are written."""
        try:
            txn = await self.updates.begin(
                action, abort_all=abort_all, streaming=False, timeout_s=timeout_s, after_deadline_s=0.0
            )
        except UpdateRefused as exc:
            return self._answer(action, False, str(exc), weights="intact")
        refusals: tuple[type[Exception], ...] = (UpdateRefused, UpdateFailed, WeightUpdateError, *staging_errors)
        try:
            staged = await stage(txn.step_s())
            await self.updates.take(txn)
            await self.updates.apply(txn, tensors(staged), require_complete=require_complete)
        except TimeoutError:  # before the refusals: a TimeoutError is an OSError too
            await self.updates.fail(txn)
            raise AdminTimeout(action, timeout_s) from None
        except refusals as exc:
            effect = await self.updates.fail(txn)
            if isinstance(exc, UpdateFailed):
                effect = exc.effect
            prefix = "" if isinstance(exc, UpdateRefused) else "Failed to update weights: "
            return self._answer(action, False, f"{prefix}{exc}", num_aborted=txn.num_aborted, weights=effect)
        result = await self.updates.commit(txn, options(staged))
        result.message = (
            "Succeeded to update model weights." if result.success else f"Failed to update weights: {result.message}"
        )
        result.data.update(num_aborted=txn.num_aborted)
        return result

    async def _read_checkpoint(self, req: UpdateWeightsFromDiskRequest, timeout_s: float) -> StagedCheckpoint:
        """Every rank reads and validates the checkpoint (all ranks share one host today, so the
        leader's read serves them all), on a daemon thread of its own: a read stuck on a hung file
        system then holds up neither the event loop nor the process's exit. At ``timeout_s`` it
        raises :class:`TimeoutError` and the read is abandoned (told to stop, its result dropped); a
        read abandoned because the worker is shutting down fails the update at once."""
        stage = partial(self.worker.stage_checkpoint, req.model_path, req.load_format)
        try:
            return await run_on_daemon_thread(lambda stop: stage(cancel=stop), timeout_s, name="checkpoint-read")
        except Abandoned as exc:
            raise WeightUpdateError(f"the checkpoint read was abandoned: {exc}") from None

    def _answer(self, action: str, ok: bool, message: str, **data: Any) -> StageResult:
        """A stage-level answer built here (no scheduler round trip), with every rank's result."""
        result = OpResult(ok, message, {"num_paused_requests": self.scheduler.num_waiting, **data})
        return self.stage.describe(action, lambda _s: result)

    async def flush_cache(self, wait_s: float, timeout_s: float) -> StageResult:
        """Flush; with ``wait_s`` > 0, retry until the worker is idle or the time is up."""
        deadline = time.monotonic() + wait_s
        while True:
            result = await self.admin("flush_cache", admin_ops.flush_cache, timeout_s)
            if result.success or time.monotonic() >= deadline:
                return result
            await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    async def health_generate(self) -> tuple[bool, str]:
        """A one-token generation. While generation is deliberately stopped (pause,
        released memory) it answers healthy at once instead of timing out, unlike
        SGLang, whose health request waits behind the pause and fails after 20 s.
        Partially written weights are unhealthy."""
        if self.worker.weights_partial:
            return False, "weights are partially updated; reload them (e.g. update_weights_from_disk) before serving"
        blocked = self.generation_blocked
        if blocked:
            return True, f"{blocked}; the worker is up but not generating"
        params = GenerationParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        handle = self.submit([0], params, rid=f"HEALTH_CHECK_{uuid.uuid4().hex}")
        try:
            deadline = time.monotonic() + self.health_check_timeout_s
            while not handle.finished and time.monotonic() < deadline:
                await handle.next_event(min(0.5, _left(deadline)))
                if not self.alive:
                    return False, "the scheduler thread is not running"
                blocked = self.generation_blocked
                if blocked and not handle.finished:
                    return True, f"{blocked}; the worker is up but not generating"
            if handle.finished:
                return True, "ok"
            return False, f"no output within {self.health_check_timeout_s:g}s"
        finally:
            self.release(handle)

    # -- shutdown --------------------------------------------------------------------------
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
        if left and self.alive:
            deadline = time.monotonic() + SHUTDOWN_ABORT_WAIT_S
            aborted = self.scheduler.submit_abort(None, abort_all=True, message=f"Aborted: {SHUTTING_DOWN}")
            try:
                await asyncio.wait_for(asyncio.wrap_future(aborted), SHUTDOWN_ABORT_WAIT_S)
            except TimeoutError:
                log.warning("the scheduler did not abort the remaining requests within %.0fs", SHUTDOWN_ABORT_WAIT_S)
            await self.wait_returned(left, _left(deadline))
        return len(handles) - len(left), len(left)

    # -- status ----------------------------------------------------------------------------
    def model_info(self) -> dict[str, Any]:
        """SGLang's ``/model_info`` fields plus the admin state; read without a
        scheduler round trip so it answers even during a long update."""
        worker = self.worker
        cfg = worker.config
        ranks = self.stage.describe("model_info", _rank_info)
        return {
            "model_path": worker.model_path,
            "tokenizer_path": worker.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": worker.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": cfg.raw.get("model_type", cfg.architecture),
            "architectures": [cfg.hf_architecture],
            "served_model_name": worker.served_model_name,
            "load_format": worker.load_format,
            "tp_size": self.stage.tp_size,
            "dtype": worker.dtype_name,
            "device": str(worker.device),
            "context_length": worker.context_len,
            "is_paused": self.scheduler.is_paused,
            "pause_mode": self.scheduler.pause_mode,
            "weights_partial": any(r.worker.weights_partial for r in self.stage.views()),
            "weights_released": worker.weights_released,
            "weight_state": self.weight_state,
            "instance_id": self.instance_id,
            "token_step": worker.token_step,
            "supports_weight_update": True,
            "supports_weight_checker": True,
            "rank_results": ranks.rank_results,
        }


def _rank_info(s: Scheduler) -> OpResult:
    w = s.worker
    return OpResult(
        True,
        "",
        {
            "model_path": w.model_path,
            "weight_version": w.weight_version,
            "is_paused": s.is_paused,
            "pause_mode": s.pause_mode,
            "weights_partial": w.weights_partial,
            "weights_released": w.weights_released,
            "device": str(w.device),
            "dtype": w.dtype_name,
            "alive": s.alive,
        },
    )


def _left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())
