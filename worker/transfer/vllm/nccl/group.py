"""vLLM's NCCL weight-transfer group as this worker's receive path sees a group.

The receive loop (:class:`~worker.transfer.group.receiver.BucketReceiver`) and the bucket formats
(:mod:`router.dataplane.formats`) use a :class:`~router.dataplane.group.WeightUpdateGroup`:
``alive``, ``require_usable()``, ``mark_broken()``, ``broadcast(tensor, timeout_s)``,
``broadcast_async(tensor)`` and ``wait(work, timeout_s)``, ``destroy()``, and ``backend``
(``"nccl"``: receives are exact, with no gloo slack). :class:`VllmNcclGroup` is that class over an
NCCL communicator of :mod:`.libnccl` instead of a ``torch.distributed`` group, so the controller can
hold it among its groups and hand it to the receive path unchanged.

Broadcasts run on the group's own CUDA stream (a non-blocking stream, after the work already
queued on the caller's current stream), so a broadcast that never completes cannot hold up the
model's kernels on the default stream; each received tensor is recorded on that stream, so its
memory is not reused before the broadcast has ended. A wait polls the broadcast's CUDA event
until it completes, the deadline passes, the communicator reports an error, or the group is
marked broken (a cancelled receive); in all but the first case the group is broken and its
communicator aborted at once, which also ends the broadcast on the device.

:func:`join_vllm_nccl_group` joins as vLLM's worker ranks do (``nccl_common.worker_init_process_group``):
the id from the trainer's store (:mod:`.rendezvous`) or from ``nccl_unique_id_b64``, then
``ncclCommInitRank`` and the one-element warm-up all-reduce vLLM's trainer waits for.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, ParamSpec

import torch
import torch.distributed as dist

from router.contract.vllm import VLLM_GROUP_NAME, decode_unique_id_b64
from router.dataplane.group import DESTROY_TIMEOUT_S, GroupError, WeightUpdateGroup
from worker.transfer.vllm.nccl.libnccl import NCCL_FLOAT32, Communicator, NcclError, load_library, nccl_type
from worker.transfer.vllm.nccl.rendezvous import receive_unique_id

P = ParamSpec("P")

log = logging.getLogger(__name__)

#: The longest pause between two looks at a broadcast in flight.
MAX_POLL_S = 1e-3


class BroadcastWork(dist.Work):
    """One broadcast posted on a :class:`VllmNcclGroup`: its completion event and its tensor."""

    def __init__(self, group: VllmNcclGroup, event: torch.cuda.Event, tensor: torch.Tensor) -> None:
        super().__init__()
        self.group = group
        self.event = event
        self.tensor = tensor

    def is_completed(self) -> bool:
        return bool(self.event.query())  # type: ignore[no-untyped-call]  # torch leaves Event unannotated

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        self.group.wait(self, timeout.total_seconds() or self.group.timeout_s)
        return True


@dataclass(eq=False)
class VllmNcclGroup(WeightUpdateGroup):
    """A joined vLLM NCCL weight-transfer group (``backend == "nccl"``), usable wherever the receive
    path takes a :class:`~router.dataplane.group.WeightUpdateGroup`.

    ``pg`` holds a placeholder (an unregistered ``ProcessGroup`` with no backend: any torch
    collective on it fails) so that ``pg is None`` keeps meaning "destroyed", as for torch groups."""

    comm: Communicator | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cuda"))
    stream: torch.cuda.Stream | None = None

    def broadcast_async(self, tensor: torch.Tensor) -> dist.Work:
        self.require_usable()
        comm, stream = self.comm, self.stream
        if comm is None or stream is None:
            raise GroupError(f"weight-update group {self.name!r} has no communicator")
        if tensor.device != self.device:
            raise GroupError(f"group {self.name!r} receives on {self.device}, not {tensor.device}")
        if not tensor.is_contiguous():
            raise GroupError(f"group {self.name!r} receives into contiguous tensors only")
        nccl_dtype, itemsize = nccl_type(tensor.dtype)
        count = tensor.numel() * tensor.element_size() // itemsize
        try:
            with torch.cuda.device(self.device):
                stream.wait_stream(torch.cuda.current_stream(self.device))
                if count:  # NCCL returns at once for 0 elements, on every rank
                    comm.broadcast(
                        tensor.data_ptr(), count, nccl_dtype, 0, stream.cuda_stream, time.monotonic() + self.timeout_s
                    )
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event unannotated
                done.record(stream)
                tensor.record_stream(stream)
        except NcclError as exc:
            raise self._abandon(f"broadcast failed: {exc}") from None
        with self._lock:
            self.outstanding += 1
        return BroadcastWork(self, done, tensor)

    def wait(self, work: dist.Work, timeout_s: float) -> None:
        if not isinstance(work, BroadcastWork) or work.group is not self:
            raise GroupError(f"not a broadcast posted on group {self.name!r}")
        comm = self.comm
        if comm is None:
            raise GroupError(f"weight-update group {self.name!r} has no communicator")
        try:
            wait_event(work.event, comm, time.monotonic() + max(timeout_s, 0.001), lambda: self.broken_reason)
        except _Stopped as exc:
            why = f"did not finish within {timeout_s:.1f}s" if exc.reason is None else f"abandoned ({exc.reason})"
            raise self._abandon(why) from None
        except NcclError as exc:
            raise self._abandon(f"broadcast failed: {exc}") from None
        with self._lock:
            self.outstanding -= 1

    def _abandon(self, reason: str) -> GroupError:
        """A broadcast will not complete: the group is broken and its communicator aborted (which
        ends the broadcast on the device). Returns the error to raise."""
        self.mark_broken(reason)
        if self.comm is not None:
            self.comm.abort()
        return GroupError(f"broadcast on group {self.name!r}: {reason}")

    def destroy(self, timeout_s: float | None = None) -> bool:
        """Leave the group (``ncclCommAbort``); idempotent. ``False`` when the abort did not finish
        within ``timeout_s`` (default :data:`DESTROY_TIMEOUT_S`); it goes on on a daemon thread."""
        with self._lock:
            pg, self.pg = self.pg, None
        if pg is None or self.comm is None:
            return True
        wait_s = DESTROY_TIMEOUT_S if timeout_s is None else timeout_s
        finished = self.comm.abort(wait_s)
        if not finished:
            log.error("aborting vLLM NCCL group %r did not finish within %.0fs", self.name, wait_s)
        return finished

    def close(self) -> bool:
        return self.destroy()


class _Stopped(Exception):
    """A wait ended without the event: ``reason`` from ``stop()``, or ``None`` at the deadline."""

    def __init__(self, reason: str | None) -> None:
        super().__init__(reason or "deadline passed")
        self.reason = reason


def wait_event(
    event: torch.cuda.Event, comm: Communicator, deadline: float, stop: Callable[[], str | None] = lambda: None
) -> None:
    """Poll ``event`` until it completes. Raises :class:`NcclError` if the communicator reports an
    error, ``_Stopped`` when ``stop()`` names a reason or the deadline passes."""
    pause = 2e-5
    while not event.query():  # type: ignore[no-untyped-call]  # torch leaves Event unannotated
        reason = stop()
        if reason is not None:
            raise _Stopped(reason)
        comm.check_healthy()
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Stopped(None)
        time.sleep(min(pause, left))
        pause = min(pause * 2, MAX_POLL_S)


# -- joining -------------------------------------------------------------------------------------


def _as_group_error(join: Callable[P, VllmNcclGroup]) -> Callable[P, VllmNcclGroup]:
    """Every failure of ``join`` as a ``GroupError``, the one error the controller's join handles."""

    @functools.wraps(join)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> VllmNcclGroup:
        try:
            return join(*args, **kwargs)
        except GroupError:
            raise
        except Exception as exc:
            raise GroupError(f"joining vLLM's NCCL group failed: {type(exc).__name__}: {exc}") from None

    return wrapper


@_as_group_error
def join_vllm_nccl_group(
    *,
    master_address: str | None,
    master_port: int | None,
    nccl_unique_id_b64: str | None,
    rank: int,
    world_size: int,
    device: torch.device | str | int,
    timeout_s: float,
    group_name: str = VLLM_GROUP_NAME,
    cancel: threading.Event | None = None,
    library_path: str | None = None,
) -> VllmNcclGroup:
    """Join a vLLM trainer's NCCL weight-transfer group as worker ``rank`` (``rank_offset + tp_rank``).

    The rendezvous is the trainer's store at ``master_address:master_port`` or the pre-shared
    ``nccl_unique_id_b64``, exactly one (:func:`router.contract.vllm.decode_unique_id_b64`). Blocks until
    every rank has joined and the warm-up all-reduce has run; call from a thread, never from the
    event loop. Every wait ends within ``timeout_s`` in all (or as soon as ``cancel`` is set) with
    :class:`~router.dataplane.group.GroupError`, leaving no store connection and no communicator
    behind. Nothing touches the network before the device and NCCL have been checked: a CPU worker
    fails at once, without counting itself in the trainer's store.
    Any other failure (a device torch cannot use, say) is raised as a ``GroupError`` too."""
    if not 0 < rank < world_size:
        raise GroupError(f"rank {rank} is not a worker rank of world_size {world_size} (the trainer is rank 0)")
    if timeout_s <= 0:
        raise GroupError(f"timeout_s must be positive, got {timeout_s}")
    deadline = time.monotonic() + timeout_s
    try:
        unique_id = decode_unique_id_b64(
            master_address=master_address, master_port=master_port, nccl_unique_id_b64=nccl_unique_id_b64
        )
    except ValueError as exc:
        raise GroupError(f"init_info: {exc}") from None
    target = _cuda_device(device)
    lib = load_library(library_path)
    if unique_id is None:
        assert master_address is not None and master_port is not None  # checked by decode_unique_id_b64
        unique_id = receive_unique_id(
            master_address=master_address,
            master_port=master_port,
            rank=rank,
            world_size=world_size,
            timeout_s=max(deadline - time.monotonic(), 0.001),
            cancel=cancel,
        )
    index = target.index if target.index is not None else torch.cuda.current_device()
    comm = Communicator.join(
        lib, unique_id, rank=rank, world_size=world_size, device_index=index, deadline=deadline, cancel=cancel
    )
    try:
        stream = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]  # torch leaves Stream unannotated
        _warm_up(comm, torch.device("cuda", index), stream, deadline, cancel)
    except BaseException as exc:
        comm.abort()
        if isinstance(exc, _Stopped):
            why = "was cancelled" if exc.reason is not None else f"did not finish within {timeout_s:g}s"
            raise NcclError(f"vLLM's warm-up all-reduce after ncclCommInitRank {why}") from None
        if isinstance(exc, Exception) and not isinstance(exc, GroupError):
            raise NcclError(f"vLLM's warm-up all-reduce failed: {type(exc).__name__}: {exc}") from None
        raise
    log.info(
        "joined vLLM NCCL group %r as rank %d/%d on cuda:%d (NCCL %s)", group_name, rank, world_size, index, lib.version
    )
    return VllmNcclGroup(
        name=group_name,
        rank=rank,
        world_size=world_size,
        backend="nccl",
        timeout_s=timeout_s,
        pg=_placeholder_pg(rank, world_size),
        comm=comm,
        device=torch.device("cuda", index),
        stream=stream,
    )


def _warm_up(
    comm: Communicator, device: torch.device, stream: torch.cuda.Stream, deadline: float, cancel: threading.Event | None
) -> None:
    """vLLM's handshake right after ``ncclCommInitRank``: a one-element float32 sum all-reduce,
    which every rank issues before any other collective."""
    with torch.cuda.device(device):
        data = torch.zeros(1, dtype=torch.float32, device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        comm.all_reduce(data.data_ptr(), 1, NCCL_FLOAT32, stream.cuda_stream, deadline)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event unannotated
        done.record(stream)
        data.record_stream(stream)
    wait_event(done, comm, deadline, lambda: "cancelled" if cancel is not None and cancel.is_set() else None)


def _cuda_device(device: torch.device | str | int) -> torch.device:
    target = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if target.type != "cuda":
        raise NcclError(
            f"vLLM's NCCL weight-transfer engine needs a CUDA worker; this one runs on {target.type} "
            "(send master_address and master_port for a gloo group instead)"
        )
    return target


def _placeholder_pg(rank: int, world_size: int) -> dist.ProcessGroup:
    """An unregistered ``ProcessGroup`` without a backend, standing for "joined" in ``pg``."""
    store = dist.HashStore()
    try:
        return dist.ProcessGroup(store, rank, world_size)
    except TypeError:  # torch before 2.6 also takes the group's options
        make: Any = dist.ProcessGroup
        pg: dist.ProcessGroup = make(store, rank, world_size, make.Options(backend="undefined"))
        return pg
