"""Updates whose weights the call itself brings: a checkpoint on disk, tensors in the request, a peer's snapshot.

Each is one transaction of the worker's update pipeline (:mod:`worker.update_pipeline`):
begin (refused before anything is read when the worker cannot take it) → stage the
new weights whole, off the event loop and off the scheduler thread, bounded by the
step's time (inference keeps running meanwhile) → take the worker (abort requests if
asked) → write them in one scheduler step with a rollback copy → commit. A failure at
any point keeps the old weights bit for bit, except where the pipeline says the
weights are now ``partial`` (the answer's ``weights`` says which).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

from router.contract.admin import UpdateWeightsFromDiskRequest, UpdateWeightsFromTensorRequest, WeightsEffect
from router.contract.peer import UpdateWeightsFromPeerRequest
from router.dataplane.buckets import NamedTensors
from worker.engine.daemon_thread import Abandoned, run_on_daemon_thread
from worker.engine.model_worker import StagedCheckpoint, WeightUpdateError
from worker.engine.results import Answered, OpResult
from worker.engine.weight_ops import CommitOptions
from worker.peer.fetch import Receipt
from worker.ranks import AdminTimeout, Stage, StageResult
from worker.update_pipeline import UpdateFailed, UpdatePipeline, UpdateRefused

S = TypeVar("S")


class OneStepUpdates:
    """``/update_weights_from_disk`` and ``/update_weights_from_tensor`` over one pipeline."""

    def __init__(self, stage: Stage, updates: UpdatePipeline, *, noop: bool = False):
        self.stage = stage
        self.updates = updates
        self.noop = noop
        """A fault for tests (``--fault-noop-updates``): an update from disk reloads the checkpoint held."""

    async def from_disk(self, req: UpdateWeightsFromDiskRequest, timeout_s: float) -> StageResult[Any]:
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

        result = await self._run(
            "update_weights_from_disk",
            abort_all=req.abort_all_requests,
            timeout_s=timeout_s,
            stage=lambda bound_s: self._read_checkpoint(req, bound_s),
            tensors=lambda staged: staged.tensors,
            require_complete=True,
            options=options,
        )
        if result.data is not None:
            result.data = replace(result.data, model_path=self.stage.leader.worker.model_path)
        return result

    async def from_tensor(
        self, req: UpdateWeightsFromTensorRequest, stage: Callable[[], NamedTensors], timeout_s: float
    ) -> StageResult[Any]:
        """Like :meth:`from_disk`: ``stage`` (open the shared memory, copy the tensors
        out; already checked against the model) runs off the event loop, then the tensors are written
        in one step with rollback. It may be a subset of the weights."""

        def options(named: NamedTensors) -> CommitOptions:
            return CommitOptions(
                names=tuple(name for name, _ in named), weight_version=req.weight_version, flush_cache=req.flush_cache
            )

        return await self._run(
            "update_weights_from_tensor",
            abort_all=req.abort_all_requests,
            timeout_s=timeout_s,
            stage=lambda bound_s: asyncio.wait_for(asyncio.to_thread(stage), bound_s),
            tensors=lambda named: named,
            require_complete=False,
            options=options,
            staging_errors=(ValueError, OSError, RuntimeError),
        )

    async def from_peer(
        self, req: UpdateWeightsFromPeerRequest, fetch: Callable[[], Awaitable[Receipt]], timeout_s: float
    ) -> StageResult[Any]:
        """Like :meth:`from_disk`, the weights staged whole from a peer's snapshot stream (``fetch``,
        bounded by the step's time; it checks shapes before reading and the checksum after), then
        written in one step with rollback; ``weight_version`` becomes the source's."""

        def options(receipt: Receipt) -> CommitOptions:
            return CommitOptions(
                names=tuple(name for name, _ in receipt.tensors),
                whole=True,
                weight_version=receipt.weight_version,
                flush_cache=req.flush_cache,
            )

        return await self._run(
            "update_weights_from_peer",
            abort_all=req.abort_all_requests,
            timeout_s=timeout_s,
            stage=lambda bound_s: asyncio.wait_for(fetch(), bound_s),
            tensors=lambda receipt: receipt.tensors,
            require_complete=True,
            options=options,
        )

    async def _run(
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
    ) -> StageResult[Any]:
        """begin → ``stage`` (bounded by the step's time) → take → apply (one step, rollback) → commit,
        or fail: the shape of every update whose weights are staged whole before they are written."""
        try:
            txn = await self.updates.begin(
                action, abort_all=abort_all, streaming=False, timeout_s=timeout_s, after_deadline_s=0.0
            )
        except UpdateRefused as exc:
            return answered(self.stage, action, False, str(exc), weights="intact")
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
            return answered(self.stage, action, False, f"{prefix}{exc}", num_aborted=txn.num_aborted, weights=effect)
        result: StageResult[Any] = await self.updates.commit(txn, options(staged))
        result.message = (
            "Succeeded to update model weights." if result.success else f"Failed to update weights: {result.message}"
        )
        if result.data is not None:
            result.data = replace(result.data, num_aborted=txn.num_aborted)
        return result

    async def _read_checkpoint(self, req: UpdateWeightsFromDiskRequest, timeout_s: float) -> StagedCheckpoint:
        """Every rank reads and validates the checkpoint (all ranks share one host today, so the
        leader's read serves them all), on a daemon thread of its own: a read stuck on a hung file
        system then holds up neither the event loop nor the process's exit. At ``timeout_s`` it
        raises :class:`TimeoutError` and the read is abandoned (told to stop, its result dropped); a
        read abandoned because the worker is shutting down fails the update at once."""
        worker = self.stage.leader.worker
        path = worker.model_path if self.noop else req.model_path
        stage = partial(worker.stage_checkpoint, path, req.load_format)
        try:
            return await run_on_daemon_thread(lambda stop: stage(cancel=stop), timeout_s, name="checkpoint-read")
        except Abandoned as exc:
            raise WeightUpdateError(f"the checkpoint read was abandoned: {exc}") from None


def answered(
    stage: Stage,
    action: str,
    ok: bool,
    message: str,
    *,
    weights: WeightsEffect | None = None,
    num_aborted: int | None = None,
    resumed: list[str] | None = None,
) -> StageResult[Answered]:
    """A stage-level answer built here (no scheduler round trip), with every rank's result."""
    data = Answered(stage.leader.num_waiting, weights, num_aborted=num_aborted, resumed=resumed)
    result = OpResult(ok, message, data)
    return stage.describe(action, lambda _rank: result)
