"""The records the restricted unpickler (:mod:`worker.transfer.handles.safe_unpickle`) builds instead of tensors.

Each admitted torch rebuild function is replaced here by a function of the same
arguments that checks their types and returns a record (:class:`SharedTensor`,
:class:`CudaTensor`); nothing here opens memory or calls into torch's rebuild code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch

#: ``rebuild_cuda_tensor``'s argument that names the producer's device (an index, or with
#: SGLang's patched reductions a GPU UUID string).
CUDA_DEVICE_ARG = 6
#: ``rebuild_cuda_tensor``'s arguments: the IPC handle and the storage's size in bytes.
CUDA_HANDLE_ARG, CUDA_SIZE_ARG = 7, 8
#: A GPU UUID string is 36 characters (``str(torch.cuda.get_device_properties(i).uuid)``);
#: longer strings are refused before they are compared with anything.
MAX_DEVICE_UUID_CHARS = 64


class UnsafePayload(ValueError):
    """A payload that is not a tensor list this worker will load (the message says why)."""


@dataclass
class FlattenedTensorMetadata:
    """SGLang's ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata``."""

    name: str = ""
    shape: Any = None
    dtype: Any = None
    start_idx: int = 0
    end_idx: int = 0
    numel: int = 0


@dataclass(frozen=True)
class Marker:
    """A class named by the payload, stood in for so that it can be compared but never called."""

    qualname: str


MARKERS = {
    ("torch", "Tensor"): Marker("torch.Tensor"),
    ("torch.nn.parameter", "Parameter"): Marker("torch.Tensor"),
    ("torch.storage", "UntypedStorage"): Marker("torch.UntypedStorage"),
    ("torch.storage", "TypedStorage"): Marker("torch.TypedStorage"),
    ("torch", "UntypedStorage"): Marker("torch.UntypedStorage"),
    ("torch", "TypedStorage"): Marker("torch.TypedStorage"),
}


@dataclass
class SharedStorage:
    """``rebuild_storage_filename``'s arguments: a CPU storage not opened yet."""

    manager: bytes
    handle: bytes
    size: int
    """Elements of ``dtype`` (bytes when untyped)."""
    dtype: torch.dtype | None = None


@dataclass
class SharedTensor:
    """``rebuild_tensor``'s arguments over a :class:`SharedStorage`."""

    storage: SharedStorage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype or torch.uint8


@dataclass
class CudaTensor:
    """``rebuild_cuda_tensor``'s arguments (replayed by :func:`~worker.transfer.handles.safe_unpickle.materialize`).

    ``args[6]`` is the producer's device: an index, or (SGLang's patched reductions) a GPU
    UUID; :func:`~worker.transfer.handles.sglang_wrappers.on_local_devices` turns it into this
    host's index before anything is opened."""

    args: tuple[Any, ...] = field(default_factory=tuple)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.args[1])

    # ``args`` were checked when the record was built (``rebuild_cuda_record``): the casts name what they hold.
    @property
    def dtype(self) -> torch.dtype:
        return cast(torch.dtype, self.args[5])

    @property
    def device(self) -> int | str:
        return cast(int | str, self.args[CUDA_DEVICE_ARG])


LazyTensor = SharedTensor | CudaTensor


def as_bytes(value: Any, what: str) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes):
        return value
    raise UnsafePayload(f"{what} must be bytes or str")


def int_tuple(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or not all(isinstance(v, int) and v >= 0 for v in value):
        raise UnsafePayload(f"{what} must be a tuple of non-negative ints")
    return tuple(value)


def rebuild_storage_filename(cls: Any, manager: Any, handle: Any, size: Any, dtype: Any = None) -> SharedStorage:
    if not isinstance(cls, Marker) or cls.qualname not in ("torch.UntypedStorage", "torch.TypedStorage"):
        raise UnsafePayload("rebuild_storage_filename: unexpected storage class")
    if not isinstance(size, int) or size < 0 or (dtype is not None and not isinstance(dtype, torch.dtype)):
        raise UnsafePayload("rebuild_storage_filename: bad size or dtype")
    return SharedStorage(as_bytes(manager, "manager"), as_bytes(handle, "handle"), size, dtype)


def rebuild_typed_storage(storage: Any, dtype: Any) -> SharedStorage:
    if not isinstance(storage, SharedStorage) or not isinstance(dtype, torch.dtype) or storage.dtype is not None:
        raise UnsafePayload("rebuild_typed_storage: unexpected arguments")
    return SharedStorage(storage.manager, storage.handle, storage.size // dtype.itemsize, dtype)


def rebuild_tensor(cls: Any, storage: Any, metadata: Any) -> SharedTensor:
    if not isinstance(cls, Marker) or cls.qualname != "torch.Tensor" or not isinstance(storage, SharedStorage):
        raise UnsafePayload("rebuild_tensor: unexpected arguments")
    if not isinstance(metadata, tuple) or len(metadata) != 4 or not isinstance(metadata[0], int):
        raise UnsafePayload("rebuild_tensor: bad metadata")
    offset, shape, stride, _requires_grad = metadata
    return SharedTensor(storage, offset, int_tuple(shape, "size"), int_tuple(stride, "stride"))


def rebuild_cuda_record(*args: Any) -> CudaTensor:
    """``torch.multiprocessing.reductions.rebuild_cuda_tensor`` and SGLang's
    ``_rebuild_cuda_tensor_modified`` (the same 15 arguments; SGLang's names the device by UUID)."""
    if len(args) != 15 or not isinstance(args[5], torch.dtype):
        raise UnsafePayload("rebuild_cuda_tensor: unexpected arguments")
    int_tuple(args[1], "size")
    device = args[CUDA_DEVICE_ARG]
    if isinstance(device, bool) or not (
        (isinstance(device, int) and device >= 0)
        or (isinstance(device, str) and 0 < len(device) <= MAX_DEVICE_UUID_CHARS)
    ):
        raise UnsafePayload("rebuild_cuda_tensor: the device must be an index or a GPU UUID string")
    return CudaTensor(args)


def codecs_encode(text: Any, encoding: Any = "utf-8") -> bytes:
    if not isinstance(text, str) or encoding != "latin1":
        raise UnsafePayload("_codecs.encode is admitted only as (str, 'latin1')")
    return text.encode("latin1")


def refuse_fd(*_args: Any) -> Any:
    raise UnsafePayload(
        "rebuild_storage_fd (the file_descriptor sharing strategy) is not accepted: it connects back to the "
        "sender's socket; call torch.multiprocessing.set_sharing_strategy('file_system') before serializing, "
        "or send the JSON handle format (tensor_handles)"
    )
