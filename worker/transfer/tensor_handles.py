"""Open a JSON handle message (:mod:`router.contract.tensor_handles`) and copy its tensors out.

Names, dtypes and shapes are checked against the served model first
(:func:`~worker.transfer.validation.validate_buckets`), so a wrong message opens
no memory at all. The tensors are then COPIED out of the shared buffer: the
segment is closed before this returns, so the trainer may unlink it as soon as
the worker has answered, and the model never aliases memory another process writes.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory

import torch

from router.contract.tensor_handles import CpuShmMemory, CudaIpcMemory, HandleBucket, HandleMessage
from router.contract.weight_sync import TensorListMeta
from router.dataplane.buckets import NamedTensors, torch_dtype
from worker.transfer.validation import Spec, validate_buckets


class HandleError(ValueError):
    """A handle message this worker cannot load (the message says why)."""


def check_against_model(message: HandleMessage, spec: Spec, is_ignored: Callable[[str], bool]) -> None:
    """Raise :class:`~worker.transfer.validation.MetadataError` unless every tensor fits the model."""
    metas = [
        TensorListMeta(
            names=[t.name for t in b.tensors], dtypes=[t.dtype for t in b.tensors], shapes=[t.shape for t in b.tensors]
        )
        for b in message.buckets
    ]
    validate_buckets(metas, spec, flattened=False, is_ignored=is_ignored)


def _copy_out(bucket: HandleBucket, buffer: memoryview | torch.Tensor) -> NamedTensors:
    out: NamedTensors = []
    for t in bucket.tensors:
        dtype = torch_dtype(t.dtype)
        if not t.nbytes:
            out.append((t.name, torch.empty(t.shape, dtype=dtype)))
            continue
        if isinstance(buffer, torch.Tensor):
            raw = buffer[t.offset : t.offset + t.nbytes]
        else:
            raw = torch.frombuffer(buffer, dtype=torch.uint8, count=t.nbytes, offset=t.offset)
        out.append((t.name, raw.view(dtype).reshape(t.shape).clone()))
        del raw
    return out


def _open_cpu(bucket: HandleBucket, memory: CpuShmMemory) -> NamedTensors:
    try:
        segment = shared_memory.SharedMemory(name=memory.name.lstrip("/"))
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise HandleError(f"shared memory segment {memory.name!r} cannot be opened: {exc}") from None
    # Python < 3.13 registers a segment it merely attached to with this process's resource
    # tracker, which would unlink the trainer's segment when the worker exits: unregister it.
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    try:
        if segment.size < memory.capacity:
            raise HandleError(f"segment {memory.name!r} holds {segment.size} bytes, the message declares {memory.size}")
        assert segment.buf is not None
        return _copy_out(bucket, segment.buf)
    finally:
        segment.close()


def _open_cuda(bucket: HandleBucket, memory: CudaIpcMemory) -> NamedTensors:  # pragma: no cover - needs a GPU
    if not torch.cuda.is_available():
        raise HandleError("cuda_ipc handles need a CUDA worker")
    storage = torch.UntypedStorage._new_shared_cuda(
        memory.device,
        base64.b64decode(memory.handle),
        memory.storage_size,
        memory.storage_offset,
        base64.b64decode(memory.ref_counter_handle),
        memory.ref_counter_offset,
        base64.b64decode(memory.event_handle) if memory.event_handle else b"",
        memory.event_sync_required,
    )
    flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{memory.device}").set_(storage)
    try:
        return _copy_out(bucket, flat)
    finally:
        del flat, storage


def load(message: HandleMessage) -> NamedTensors:
    """Every tensor of a checked message, copied out of its buffer (raises :class:`HandleError`)."""
    named: NamedTensors = []
    for bucket in message.buckets:
        memory = bucket.memory
        named.extend(_open_cuda(bucket, memory) if isinstance(memory, CudaIpcMemory) else _open_cpu(bucket, memory))
    return named
