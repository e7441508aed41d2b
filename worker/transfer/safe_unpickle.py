"""A restricted unpickler for SGLang's ``serialized_named_tensors`` payloads.

SGLang sends ``base64(ForkingPickler.dumps(obj))`` where ``obj`` is a list of
``(name, tensor)`` pairs, or for ``load_format="flattened_bucket"`` a dict
``{"flattened_tensor": uint8 tensor, "metadata": [FlattenedTensorMetadata]}``.
Plain ``pickle.loads`` would run any callable the caller names, so
:class:`RestrictedUnpickler.find_class` admits ONLY these globals:

* ``torch.multiprocessing.reductions.rebuild_tensor``, ``rebuild_typed_storage``,
  ``rebuild_storage_filename`` (CPU tensors under the ``file_system`` sharing
  strategy) and ``rebuild_cuda_tensor`` (CUDA IPC);
* ``torch.Tensor``, ``torch.nn.Parameter``, ``torch.storage.UntypedStorage`` and
  ``torch.storage.TypedStorage`` as inert markers (they are only ever passed as
  arguments; calling one fails);
* ``torch.Size``, the torch dtypes of :data:`~router.contract.bucket_layout.DTYPE_ITEMSIZE`,
  ``collections.OrderedDict``, and ``_codecs.encode`` only as ``(str, "latin1")``
  (protocol 2's spelling of ``bytes``);
* any ``<module>.FlattenedTensorMetadata``, mapped onto the local dataclass
  :class:`FlattenedTensorMetadata` (its fields are checked after loading).

Anything else — ``os.system``, ``builtins.eval``, ``subprocess.Popen``, even other
torch functions — raises :class:`UnsafePayload` before any callable runs.
``rebuild_storage_fd`` (the ``file_descriptor`` strategy) is refused too: it
connects back to the producer's resource-sharer socket to receive a file
descriptor; callers should use the ``file_system`` strategy or the JSON handle
format (:mod:`router.contract.tensor_handles`).

Even the admitted rebuild functions do not run while loading: they are replaced
by records (:class:`SharedTensor`, :class:`CudaTensor`), so names, dtypes and
shapes are checked against the model first and memory is only opened after that,
by :func:`materialize`. What this still trusts: ``rebuild_storage_filename``
opens a shared-memory segment by a name the caller chose, through the
``torch_shm_manager`` socket path the caller chose (a local Unix socket), and
``rebuild_cuda_tensor`` opens the CUDA IPC handle the caller chose. A caller who
can reach this route can make the worker read any such segment it can name —
which is why the route is off unless ``--allow-pickled-tensors`` is given. And a
pickled storage that declares more bytes than its segment holds is not refused:
torch extends the segment, so the missing bytes read as zeros (the JSON handle
format checks the segment's size and refuses it).
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch

from router.contract.bucket_layout import DTYPE_ITEMSIZE

_REDUCTIONS = "torch.multiprocessing.reductions"


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
class _Marker:
    """A class named by the payload, stood in for so that it can be compared but never called."""

    qualname: str


_MARKERS = {
    ("torch", "Tensor"): _Marker("torch.Tensor"),
    ("torch.nn.parameter", "Parameter"): _Marker("torch.Tensor"),
    ("torch.storage", "UntypedStorage"): _Marker("torch.UntypedStorage"),
    ("torch.storage", "TypedStorage"): _Marker("torch.TypedStorage"),
    ("torch", "UntypedStorage"): _Marker("torch.UntypedStorage"),
    ("torch", "TypedStorage"): _Marker("torch.TypedStorage"),
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
    """``rebuild_cuda_tensor``'s arguments (replayed by :func:`materialize`)."""

    args: tuple[Any, ...] = field(default_factory=tuple)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.args[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.args[5]


LazyTensor = SharedTensor | CudaTensor


def _as_bytes(value: Any, what: str) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes):
        return value
    raise UnsafePayload(f"{what} must be bytes or str")


def _int_tuple(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or not all(isinstance(v, int) and v >= 0 for v in value):
        raise UnsafePayload(f"{what} must be a tuple of non-negative ints")
    return tuple(value)


def _rebuild_storage_filename(cls: Any, manager: Any, handle: Any, size: Any, dtype: Any = None) -> SharedStorage:
    if not isinstance(cls, _Marker) or cls.qualname not in ("torch.UntypedStorage", "torch.TypedStorage"):
        raise UnsafePayload("rebuild_storage_filename: unexpected storage class")
    if not isinstance(size, int) or size < 0 or (dtype is not None and not isinstance(dtype, torch.dtype)):
        raise UnsafePayload("rebuild_storage_filename: bad size or dtype")
    return SharedStorage(_as_bytes(manager, "manager"), _as_bytes(handle, "handle"), size, dtype)


def _rebuild_typed_storage(storage: Any, dtype: Any) -> SharedStorage:
    if not isinstance(storage, SharedStorage) or not isinstance(dtype, torch.dtype) or storage.dtype is not None:
        raise UnsafePayload("rebuild_typed_storage: unexpected arguments")
    return SharedStorage(storage.manager, storage.handle, storage.size // dtype.itemsize, dtype)


def _rebuild_tensor(cls: Any, storage: Any, metadata: Any) -> SharedTensor:
    if not isinstance(cls, _Marker) or cls.qualname != "torch.Tensor" or not isinstance(storage, SharedStorage):
        raise UnsafePayload("rebuild_tensor: unexpected arguments")
    if not isinstance(metadata, tuple) or len(metadata) != 4 or not isinstance(metadata[0], int):
        raise UnsafePayload("rebuild_tensor: bad metadata")
    offset, shape, stride, _requires_grad = metadata
    return SharedTensor(storage, offset, _int_tuple(shape, "size"), _int_tuple(stride, "stride"))


def rebuild_cuda_record(*args: Any) -> CudaTensor:
    if len(args) != 15 or not isinstance(args[5], torch.dtype):
        raise UnsafePayload("rebuild_cuda_tensor: unexpected arguments")
    _int_tuple(args[1], "size")
    return CudaTensor(args)


def _codecs_encode(text: Any, encoding: Any = "utf-8") -> bytes:
    if not isinstance(text, str) or encoding != "latin1":
        raise UnsafePayload("_codecs.encode is admitted only as (str, 'latin1')")
    return text.encode("latin1")


def _refuse_fd(*_args: Any) -> Any:
    raise UnsafePayload(
        "rebuild_storage_fd (the file_descriptor sharing strategy) is not accepted: it connects back to the "
        "sender's socket; call torch.multiprocessing.set_sharing_strategy('file_system') before serializing, "
        "or send the JSON handle format (tensor_handles)"
    )


_FUNCTIONS: dict[tuple[str, str], Any] = {
    (_REDUCTIONS, "rebuild_tensor"): _rebuild_tensor,
    (_REDUCTIONS, "rebuild_typed_storage"): _rebuild_typed_storage,
    (_REDUCTIONS, "rebuild_storage_filename"): _rebuild_storage_filename,
    (_REDUCTIONS, "rebuild_cuda_tensor"): rebuild_cuda_record,
    (_REDUCTIONS, "rebuild_storage_fd"): _refuse_fd,
    ("torch", "Size"): torch.Size,
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
    ("_codecs", "encode"): _codecs_encode,
}


class RestrictedUnpickler(pickle.Unpickler):
    """``find_class`` resolves only the allowlist of the module docstring."""

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in _FUNCTIONS:
            return _FUNCTIONS[key]
        if key in _MARKERS:
            return _MARKERS[key]
        if module == "torch" and name in DTYPE_ITEMSIZE:
            return getattr(torch, name)
        if name == "FlattenedTensorMetadata":
            return FlattenedTensorMetadata
        raise UnsafePayload(f"the payload references {module}.{name}, which is not on the allowlist")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePayload("persistent ids are not accepted")


def loads(payload: str | bytes) -> Any:
    """Decode one rank's base64 payload with :class:`RestrictedUnpickler` (no memory is opened)."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise UnsafePayload("serialized_named_tensors entry is not valid base64") from None
    try:
        return RestrictedUnpickler(io.BytesIO(raw)).load()
    except UnsafePayload:
        raise
    except Exception as exc:  # a malformed stream: any pickle/type error is the caller's
        raise UnsafePayload(f"the payload could not be decoded: {type(exc).__name__}: {exc}") from None


def named_lazy_tensors(obj: Any, load_format: str | None) -> list[tuple[str, LazyTensor]]:
    """The ``(name, tensor record)`` pairs of a loaded payload (list form), or raise :class:`UnsafePayload`.

    A ``flattened_bucket`` payload is returned as one pair ``("", uint8 record)``;
    use :func:`flattened_entries` for its metadata."""
    if load_format == "flattened_bucket":
        raise UnsafePayload("use flattened_entries for flattened_bucket payloads")
    if not isinstance(obj, list):
        raise UnsafePayload("the payload must be a list of (name, tensor) pairs")
    pairs: list[tuple[str, LazyTensor]] = []
    for item in obj:
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)):
            raise UnsafePayload("each entry must be a (name, tensor) pair")
        if not isinstance(item[1], SharedTensor | CudaTensor):
            raise UnsafePayload(f"{item[0]!r}: not a shared tensor")
        pairs.append((item[0], item[1]))
    return pairs


@dataclass(frozen=True)
class FlatEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    """Byte offset into the flattened uint8 buffer."""
    end: int


def flattened_entries(obj: Any) -> tuple[LazyTensor, list[FlatEntry]]:
    """A ``flattened_bucket`` payload's uint8 buffer record and its checked metadata."""
    if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
        raise UnsafePayload("a flattened_bucket payload must be {'flattened_tensor', 'metadata'}")
    flat, metadata = obj["flattened_tensor"], obj["metadata"]
    if not isinstance(flat, SharedTensor | CudaTensor) or flat.dtype != torch.uint8 or len(flat.shape) != 1:
        raise UnsafePayload("flattened_tensor must be a 1-D uint8 shared tensor")
    if not isinstance(metadata, list):
        raise UnsafePayload("metadata must be a list of FlattenedTensorMetadata")
    entries = []
    for m in metadata:
        if not isinstance(m, FlattenedTensorMetadata) or set(vars(m)) - set(
            FlattenedTensorMetadata.__dataclass_fields__
        ):
            raise UnsafePayload("metadata entries must be FlattenedTensorMetadata")
        if not isinstance(m.name, str) or not isinstance(m.dtype, torch.dtype):
            raise UnsafePayload("FlattenedTensorMetadata: bad name or dtype")
        shape = _int_tuple(m.shape, f"{m.name}: shape")
        start, end = m.start_idx, m.end_idx
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= flat.shape[0]):
            raise UnsafePayload(f"{m.name}: [{start}, {end}) is outside the flattened buffer")
        numel = 1
        for d in shape:
            numel *= d
        if end - start != numel * m.dtype.itemsize or start % m.dtype.itemsize:
            raise UnsafePayload(f"{m.name}: byte range does not match its shape and dtype (or is unaligned)")
        entries.append(FlatEntry(m.name, m.dtype, shape, start, end))
    return flat, entries


def materialize(record: LazyTensor) -> torch.Tensor:
    """Open the memory a checked record names and return an owned CPU copy (the mapping is dropped)."""
    if isinstance(record, CudaTensor):  # pragma: no cover - needs a GPU and a CUDA producer
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        args = list(record.args)
        args[0], args[4] = torch.Tensor, torch.UntypedStorage
        return rebuild_cuda_tensor(*args).clone()
    from torch.multiprocessing.reductions import rebuild_storage_filename

    st = record.storage
    itemsize = st.dtype.itemsize if st.dtype is not None else 1
    extent = record.offset + sum((n - 1) * s for n, s in zip(record.shape, record.stride, strict=True)) + 1
    if 0 not in record.shape and extent > st.size:
        raise UnsafePayload(f"a tensor reaches element {extent} of a {st.size}-element storage")
    storage = rebuild_storage_filename(torch.UntypedStorage, st.manager, st.handle, st.size * itemsize)
    view = torch.empty(0, dtype=record.dtype).set_(
        storage.untyped(), record.offset, torch.Size(record.shape), record.stride
    )
    copy = view.clone()
    del view, storage
    return copy
