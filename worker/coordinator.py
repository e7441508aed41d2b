"""Coordinator: the event-loop facade the HTTP handlers use.

It submits generations to the stage leader's scheduler, runs admin operations
on every rank through the :class:`~worker.ranks.Stage`, serializes operations
that change weights or pause state, and bounds every wait with a timeout.
Extension point for other admin routes: :meth:`Coordinator.admin` (an op on
every rank, aggregated into one typed :class:`~worker.ranks.StageResult`), inside
:meth:`Coordinator.admin_section` when the op changes weights.

The worker's lock order, stated once here (a call holding one lock waits only for those below it):

1. the weight-sync call lock (:meth:`~worker.transfer.group.controller.WeightSyncController.holding`):
   one weight-sync call at a time, SGLang's and vLLM's; a complete holds it while it waits for its receive;
2. the writer lock (:class:`~worker.update_pipeline.UpdatePipeline`): one update transaction at a time. A
   transaction holds it, not a call: a prepared two-phase or open vLLM update keeps it between calls,
   and the calls that end it (complete, abort, finish, the expiry) take only the call lock;
3. the admin lock (:meth:`Coordinator.admin_section`): one step that changes weights or pause state.

Beside them, read leases (:mod:`worker.peer.lease`): a snapshot sent to a peer holds one and takes no
lock; it is refused while an update holds the writer lock, and an update holding the writer lock waits
for the leases in flight (bounded), then cuts them and goes on.

Past a lock wait's bound the caller gets 503 naming the holder. A call's own ``timeout_s`` caps every
wait it makes, lock waits included: each lasts at most its usual bound (30 s for the call and writer
locks, 10 s for an abort, the step's bound for the admin lock) or ``timeout_s``, whichever is shorter;
the work after a wait (applying what was received, say) keeps its own bound (:mod:`router.contract.budget`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any, TypeVar, cast

from router.contract.admin import (
    ContinueRequest,
    MemoryOccupationRequest,
    ModelInfo,
    PauseRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromTensorRequest,
    WeightStateName,
)
from router.contract.vllm import SCHEDULER_PAUSE_MODE
from router.contract.vllm_dev import SLEEP_PAUSE_MODE, AbortRequestsRequest, SleepQuery, WakeUpQuery
from router.dataplane.buckets import NamedTensors
from worker.engine import admin_ops
from worker.engine.model_worker import ModelWorker
from worker.engine.request import GenerationParams
from worker.engine.results import AbortedRequests, OpResult, Paused, RankInfo
from worker.engine.scheduler import Scheduler
from worker.engine.weight_state import WeightState
from worker.generation_admission import SHUTDOWN_ABORT_WAIT_S, GenerationService
from worker.ranks import AdminTimeout, RankOp, Stage, StageResult, held
from worker.staged_updates import OneStepUpdates, answered
from worker.tp.follower import RankState
from worker.update_pipeline import UpdatePipeline

log = logging.getLogger(__name__)

S = TypeVar("S")

#: How often a ``drain`` pause looks whether the running requests have ended.
DRAIN_POLL_S = 0.02
_NO_EMPTY = ContinueRequest(torch_empty_cache=False)


class Coordinator:
    """Generation and admin entry points for one worker process."""

    def __init__(self, stage: Stage, *, health_check_timeout_s: float = 20.0, noop_updates: bool = False):
        self.stage = stage
        self.health_check_timeout_s = health_check_timeout_s
        self._admin_lock = asyncio.Lock()
        self.generation = GenerationService(stage)
        """Generation admission: submit, release, abort, drain."""
        self.updates = UpdatePipeline(self)
        """Every weight update of this worker goes through this one pipeline."""
        self.one_step = OneStepUpdates(stage, self.updates, noop=noop_updates)
        """Updates whose weights the call itself brings (a checkpoint on disk, tensors)."""
        self.instance_id = uuid.uuid4().hex
        """Tells a router that this process is new (a restarted worker holds its boot checkpoint)."""

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
        return self.generation.draining

    @property
    def num_in_flight(self) -> int:
        """Generations admitted and not yet answered (a batch counts each of its prompts)."""
        return self.generation.num_in_flight

    @property
    def weight_state(self) -> WeightStateName:
        """The weights' state over every rank: the least servable one."""
        states = [rank.weight_state for rank in self.stage.states()]
        for state in (WeightState.PARTIAL, WeightState.WRITING, WeightState.RELEASED):
            if state in states:
                return cast(WeightStateName, state.value)
        return "serving"

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

    async def admin(
        self, action: str, op: RankOp, timeout_s: float, follower_op: RankOp | None = None
    ) -> StageResult[Any]:
        """Run ``op`` on every rank (scheduler threads) and aggregate with ``rank_results``
        (``follower_op`` on the follower ranks of a tensor-parallel worker, when given)."""
        return await self.stage.run(action, op, timeout_s, follower_op)

    # -- generation ------------------------------------------------------------------------
    async def wait_returned(self, rids: list[str], timeout_s: float) -> None:
        """Wait until the handlers of ``rids`` have produced their responses (bounded)."""
        await self.generation.wait_returned(rids, timeout_s)

    # -- composite admin operations -------------------------------------------------------
    async def pause(self, req: PauseRequest, timeout_s: float) -> StageResult[Paused]:
        """``/pause_generation``: see :meth:`pause_in`."""
        return await self.pause_in(req.mode, timeout_s, action="pause_generation")

    async def pause_in(self, mode: str, timeout_s: float, *, action: str = "pause") -> StageResult[Paused]:
        """Pause in a scheduler mode. ``abort`` returns only after every aborted request has been
        answered; ``drain`` only once the running requests have ended (past ``timeout_s`` the
        drain is called off, generation goes on, and the caller gets :class:`AdminTimeout`)."""
        deadline = time.monotonic() + timeout_s
        async with self.admin_section(action, timeout_s):
            return await self._pause_held(mode, action, deadline, timeout_s)

    async def _pause_held(self, mode: str, action: str, deadline: float, timeout_s: float) -> StageResult[Paused]:
        """:meth:`pause_in`'s work, inside the admin section."""
        result: StageResult[Paused] = await self.admin(action, partial(admin_ops.pause, mode=mode), _left(deadline))
        if mode == "abort" and result.data is not None:
            await self.wait_returned(result.data.aborted_rids, _left(deadline))
        elif mode == "drain":
            await self._drained(action, deadline, timeout_s)
        return result

    @property
    def is_sleeping(self) -> bool:
        """vLLM's ``is_sleeping``: generation paused, or any memory released."""
        return self.is_paused or bool(self.worker.released_tags)

    async def sleep(self, req: SleepQuery, timeout_s: float) -> StageResult[Any]:
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

    async def wake_up(self, req: WakeUpQuery, timeout_s: float) -> StageResult[Any]:
        """vLLM's ``/wake_up``: restore the released memory ``req`` names (all of it by default), then,
        once nothing is released any more, resume generation (vLLM resumes its scheduler when fully awake)."""
        deadline = time.monotonic() + timeout_s
        async with self.admin_section("wake_up", timeout_s):
            tags = req.memory_tags()
            resume = MemoryOccupationRequest.model_validate({"tags": tags or None})
            if tags == []:  # ``scheduling`` alone: no memory to restore
                result: StageResult[Any] = answered(self.stage, "wake_up", True, "nothing to restore", resumed=[])
            else:
                result = await self.admin("wake_up", partial(admin_ops.resume_memory, req=resume), _left(deadline))
            if result.success and not self.worker.released_tags and self.is_paused:
                await self.admin("wake_up", partial(admin_ops.continue_generation, req=_NO_EMPTY), _left(deadline))
            return result

    async def abort_requests(self, req: AbortRequestsRequest, timeout_s: float) -> StageResult[AbortedRequests]:
        """vLLM's ``/abort_requests``: the requests ``req`` names, or all; answers once their callers have
        their (aborted) answers."""
        deadline = time.monotonic() + timeout_s
        op = partial(admin_ops.abort_requests, req=req)
        result: StageResult[AbortedRequests] = await self.admin("abort_requests", op, _left(deadline))
        await self.wait_returned(result.data.aborted_rids if result.data is not None else [], _left(deadline))
        return result

    async def _drained(self, action: str, deadline: float, timeout_s: float) -> None:
        """Wait until a ``drain`` pause has taken hold on the leader (its running requests ended)."""
        while not self.scheduler.is_paused:
            if time.monotonic() >= deadline or self.scheduler.pause_mode != "drain":
                req = ContinueRequest(torch_empty_cache=False)
                await self.admin(action, partial(admin_ops.continue_generation, req=req), SHUTDOWN_ABORT_WAIT_S)
                raise AdminTimeout(f"{action} (waiting for running requests to end)", timeout_s)
            await asyncio.sleep(DRAIN_POLL_S)

    async def update_weights_from_disk(self, req: UpdateWeightsFromDiskRequest, timeout_s: float) -> StageResult[Any]:
        """See :meth:`OneStepUpdates.from_disk`."""
        return await self.one_step.from_disk(req, timeout_s)

    async def update_weights_from_tensor(
        self, req: UpdateWeightsFromTensorRequest, stage: Callable[[], NamedTensors], timeout_s: float
    ) -> StageResult[Any]:
        """See :meth:`OneStepUpdates.from_tensor`."""
        return await self.one_step.from_tensor(req, stage, timeout_s)

    async def flush_cache(self, wait_s: float, timeout_s: float) -> StageResult[None]:
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
        handle = self.generation.submit([0], params, rid=f"HEALTH_CHECK_{uuid.uuid4().hex}")
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
            self.generation.release(handle)

    # -- shutdown --------------------------------------------------------------------------
    def start_draining(self) -> None:
        """See :meth:`GenerationService.start_draining`."""
        self.generation.start_draining()

    async def drain(self, grace_s: float, cut_short: asyncio.Event | None = None) -> tuple[int, int]:
        """See :meth:`GenerationService.drain`."""
        return await self.generation.drain(grace_s, cut_short)

    # -- status ----------------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        """SGLang's ``/model_info`` fields plus the admin state; read without a
        scheduler round trip so it answers even during a long update."""
        worker = self.worker
        cfg = worker.config
        ranks = self.stage.describe("model_info", _rank_info)
        return ModelInfo(
            model_path=worker.model_path,
            tokenizer_path=worker.tokenizer_path,
            weight_version=worker.weight_version,
            model_type=cfg.raw.get("model_type", cfg.architecture),
            architectures=[cfg.hf_architecture],
            served_model_name=worker.served_model_name,
            load_format=worker.load_format,
            tp_size=self.stage.tp_size,
            dtype=worker.dtype_name,
            device=str(worker.device),
            context_length=worker.context_len,
            is_paused=self.scheduler.is_paused,
            pause_mode=self.scheduler.pause_mode,
            weights_partial=any(r.weights_partial for r in self.stage.states()),
            weights_released=worker.weights_released,
            weight_state=self.weight_state,
            instance_id=self.instance_id,
            token_step=worker.token_step,
            rank_results=ranks.rank_results,
        )


def _rank_info(rank: RankState) -> OpResult[RankInfo]:
    return OpResult(
        True,
        "",
        RankInfo(
            model_path=rank.model_path,
            weight_version=rank.weight_version,
            is_paused=rank.is_paused,
            pause_mode=rank.pause_mode,
            weights_partial=rank.weights_partial,
            weights_released=rank.weights_released,
            device=rank.device,
            dtype=rank.dtype,
            alive=rank.alive,
        ),
    )


def _left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())
