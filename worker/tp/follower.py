"""A follower tensor-parallel rank: its own process, one model shard, driven by rank 0.

Rank 0 (the process that serves HTTP) makes every decision: which sequences run
in the next forward step, which admin operation runs. A follower only carries
them out, in the order rank 0 sent them, over a private pipe: a forward step (the
model's all-reduces meet rank 0's inside it), an admin operation (a plain
function of :mod:`worker.engine.admin_ops` or :mod:`worker.engine.weight_ops`
applied to this rank's scheduler state), or a LoRA adapter to place, the last two
answered with their result and a snapshot of this rank's state. Messages on the
pipe are pickled objects built by rank 0's own code; nothing a caller sent is ever
unpickled here.

LoRA adapters: rank 0 reads an adapter once (a directory, or tensors a caller
shared) and hands this rank the full tensors under an id of its own; this rank
places its slice and keeps it by that id. A forward step names each sequence's
adapter by id, so every rank applies the same version to the same sequence, and
tells which ids to drop: those whose last holder on rank 0 (its table, or a
request still running with it) let go. This rank holds no names: which adapter a
request gets is rank 0's decision alone.

A follower exits when rank 0 tells it to, when the pipe closes (rank 0 died), or
when a collective fails (a peer died): it never waits for a rank that is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from worker.engine.weight_state import WeightState

if TYPE_CHECKING:
    from worker.engine.model_worker import ModelWorker
    from worker.engine.results import OpResult
    from worker.engine.scheduler import Scheduler
    from worker.model.kv_cache import KVCache
    from worker.model.lora import LoadedLora, LoraAdapter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSpec:
    """What a rank process needs to join the tensor-parallel group and load its shard."""

    rank: int
    size: int
    master_address: str
    master_port: int
    model_path: str
    device: str
    dtype: str
    timeout_s: float
    num_threads: int | None = None

    @property
    def backend(self) -> str:
        return "nccl" if self.device.startswith("cuda") else "gloo"

    def rank_device(self) -> str:
        """One GPU per rank on CUDA (``cuda:<rank>``); every rank on the CPU otherwise."""
        return f"cuda:{self.rank}" if self.device.startswith("cuda") else "cpu"


@dataclass(frozen=True)
class Forward:
    """One forward step: sequences to open (id, capacity) and to drop, adapters to drop (by id), then
    ``(id, new tokens, adapter id or None for the base model)`` to run."""

    opened: list[tuple[int, int]]
    dropped: list[int]
    batch: list[tuple[int, list[int], int | None]]
    dropped_adapters: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class LoadAdapter:
    """Place this rank's slice of ``adapter`` (the full tensors, on the CPU) and keep it as ``adapter_id``;
    answered like :class:`RunOp`. ``dropped_adapters`` are let go first."""

    adapter_id: int
    name: str
    version: int
    max_rank: int
    adapter: LoraAdapter
    dropped_adapters: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class RunOp:
    """An admin operation to run on this rank's scheduler state: ``op(scheduler)`` → ``OpResult``."""

    action: str
    op: Callable[[Scheduler], OpResult[Any]]


STOP = "stop"


def join_group(spec: RankSpec) -> Any:
    """Join the tensor-parallel process group (bounded by ``spec.timeout_s``); returns the model's TP handle."""
    import torch
    import torch.distributed as dist

    from worker.model.tensor_parallel import TensorParallel

    if spec.device.startswith("cuda"):
        torch.cuda.set_device(spec.rank)
    dist.init_process_group(
        spec.backend,
        init_method=f"tcp://{spec.master_address}:{spec.master_port}",
        rank=spec.rank,
        world_size=spec.size,
        timeout=timedelta(seconds=spec.timeout_s),
    )
    return TensorParallel(rank=spec.rank, size=spec.size, group=dist.group.WORLD)


@dataclass(frozen=True, slots=True)
class RankState:
    """One rank as status reads see it (``/model_info``, ``/health``): rank 0's read at once, a
    follower's as it reported itself after its last operation (sent with every result)."""

    model_path: str | None = None
    weight_version: str | None = None
    is_paused: bool = False
    pause_mode: str | None = None
    weights_partial: bool = False
    weights_released: bool = False
    released_tags: frozenset[str] = frozenset()
    device: str | None = None
    dtype: str | None = None
    weight_state: WeightState = WeightState.SERVING
    alive: bool = True

    @classmethod
    def of(cls, scheduler: Scheduler, *, alive: bool | None = None) -> RankState:
        """``scheduler``'s rank now; ``alive`` overrides its thread's (a follower's is never started)."""
        w = scheduler.worker
        return cls(
            model_path=w.model_path,
            weight_version=w.weight_version,
            is_paused=scheduler.is_paused,
            pause_mode=scheduler.pause_mode,
            weights_partial=w.weights_partial,
            weights_released=w.weights_released,
            released_tags=frozenset(w.released_tags),
            device=str(w.device),
            dtype=w.dtype_name,
            weight_state=w.ledger.state,
            alive=scheduler.alive if alive is None else alive,
        )


def snapshot(scheduler: Scheduler) -> RankState:
    """The state rank 0 reports for this rank between operations (``/model_info`` ``rank_results``)."""
    return RankState.of(scheduler, alive=True)


def follower_main(conn: Connection, spec: RankSpec) -> None:
    """The follower process: join, load, say ready, then serve rank 0's messages until told to stop."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp{spec.rank} %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group: rank 0 decides when this rank stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        import torch

        if spec.num_threads is not None:
            torch.set_num_threads(spec.num_threads)
        from worker.engine.model_worker import ModelWorker
        from worker.engine.results import OpResult
        from worker.engine.scheduler import Scheduler

        tp = join_group(spec)
        worker = ModelWorker(spec.model_path, device=spec.rank_device(), dtype=spec.dtype, tp=tp)
        # Never started: it holds this rank's pause and memory state for admin operations.
        scheduler = Scheduler(worker, rank=spec.rank)
        conn.send(("ready", snapshot(scheduler)))
    except BaseException as exc:
        _report_startup_failure(conn, exc)
        os._exit(3)
    caches: dict[int, KVCache] = {}
    adapters: dict[int, LoadedLora] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            log.warning("rank 0 went away; exiting")
            os._exit(4)
        if message == STOP:
            break
        try:
            if isinstance(message, Forward):
                _forward(worker, caches, adapters, message)
                conn.send(("ok", None))
            elif isinstance(message, LoadAdapter):
                result = _load_adapter(worker, adapters, message)
                conn.send(("result", (result, snapshot(scheduler))))
            elif isinstance(message, RunOp):
                try:
                    result = message.op(scheduler)
                except Exception as exc:  # the operation's own failure (a refused join, say): reported, not fatal
                    result = OpResult(False, f"{message.action} failed: {type(exc).__name__}: {exc}")
                conn.send(("result", (result, snapshot(scheduler))))
        except Exception:
            # A failed collective means a peer is gone: report and exit rather than serve without it.
            log.error("tp rank %d failed:\n%s", spec.rank, traceback.format_exc())
            try:
                conn.send(("error", traceback.format_exc(limit=3)))
            finally:
                os._exit(5)
    _leave(spec)


def _forward(worker: ModelWorker, caches: dict[int, KVCache], adapters: dict[int, LoadedLora], step: Forward) -> None:
    from worker.model import SeqInput

    for seq in step.dropped:
        caches.pop(seq, None)
    for adapter_id in step.dropped_adapters:
        adapters.pop(adapter_id, None)
    for seq, capacity in step.opened:
        caches[seq] = worker.model.new_kv_cache(capacity)
    # An adapter id this rank does not hold is a broken pipe protocol, not a request's problem: the KeyError
    # fails this rank (and so the worker) rather than serve a sequence without the adapter rank 0 applies.
    worker.model.forward_batch(
        [
            SeqInput(tokens, caches[seq], None if adapter_id is None else adapters[adapter_id])
            for seq, tokens, adapter_id in step.batch
        ]
    )


def _load_adapter(worker: ModelWorker, adapters: dict[int, LoadedLora], message: LoadAdapter) -> OpResult[None]:
    """Place this rank's slice; a refusal (a check of this rank's shapes, memory) is answered, not fatal:
    rank 0 then serves the adapter on no rank."""
    from worker.engine.results import OpResult
    from worker.model.lora import Placement, place_adapter

    for adapter_id in message.dropped_adapters:
        adapters.pop(adapter_id, None)
    try:
        adapters[message.adapter_id] = place_adapter(
            message.adapter,
            Placement.of(worker.model),
            max_rank=message.max_rank,
            name=message.name,
            version=message.version,
        )
    except Exception as exc:
        return OpResult(False, f"{type(exc).__name__}: {exc}")
    return OpResult(True, "")


def _report_startup_failure(conn: Connection, exc: BaseException) -> None:
    try:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
    except OSError:
        pass


def _leave(spec: RankSpec) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
