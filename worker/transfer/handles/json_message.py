"""Open a JSON handle message (:mod:`router.contract.tensor_handles`) as tensors the update writes from.

Names, dtypes and shapes are checked against the served model first
(:func:`~worker.transfer.validation.validate_buckets`), so a wrong message opens
no memory at all. CPU shared memory is mapped by this worker and its tensors are
views of that mapping: the update copies them straight into the model (one copy,
no staging) and then drops them, which unmaps it; the trainer may unlink the
segment at any time and must not rewrite it before the worker has answered. CUDA
IPC buffers are copied out at once (the producer's handle is released before the
update runs). The model never keeps a reference to memory another process writes.
"""

from __future__ import annotations

import base64
import mmap
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


def _tensors_in(bucket: HandleBucket, flat: torch.Tensor | None, *, copy: bool) -> NamedTensors:
    """Each tensor of ``bucket`` inside ``flat`` (its buffer as ``uint8``): a view, or a copy."""
    out: NamedTensors = []
    for t in bucket.tensors:
        dtype = torch_dtype(t.dtype)
        if not t.nbytes or flat is None:
            out.append((t.name, torch.empty(t.shape, dtype=dtype)))
            continue
        tensor = flat[t.offset : t.offset + t.nbytes].view(dtype).reshape(t.shape)
        out.append((t.name, tensor.clone() if copy else tensor))
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
        # A mapping of this worker's own, owned by the views returned: the update copies from it
        # straight into the model, and it is unmapped once the last view is dropped, whatever the
        # trainer does with the segment's name meanwhile (unlinking a mapped segment is safe).
        mapping = mmap.mmap(segment._fd, memory.capacity) if memory.capacity else None  # type: ignore[attr-defined]
    finally:
        segment.close()
    flat = torch.frombuffer(mapping, dtype=torch.uint8) if mapping is not None else None
    return _tensors_in(bucket, flat, copy=False)


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
        return _tensors_in(bucket, flat, copy=True)
    finally:
        del flat, storage


def load(message: HandleMessage) -> NamedTensors:
    """Every tensor of a checked message, as views of this worker's mapping (CPU) or copies (CUDA);
    raises :class:`HandleError`."""
    named: NamedTensors = []
    for bucket in message.buckets:
        memory = bucket.memory
        named.extend(_open_cuda(bucket, memory) if isinstance(memory, CudaIpcMemory) else _open_cpu(bucket, memory))
    return named
