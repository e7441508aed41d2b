"""A restricted unpickler for SGLang's ``serialized_named_tensors`` payloads.

SGLang sends ``base64(ForkingPickler.dumps(obj))`` where ``obj`` is a list of
``(name, tensor)`` pairs, or for ``load_format="flattened_bucket"`` a dict
``{"flattened_tensor": uint8 tensor, "metadata": [FlattenedTensorMetadata]}``. In the
list form a tensor may be wrapped as SGLang's ``LocalSerializedTensor(values=[one
pickle per TP rank])`` (what SGLang's ``update_weights`` helper, and so verl's SGLang
adapter, sends). Plain ``pickle.loads`` would run any callable the caller names, so
:class:`RestrictedUnpickler.find_class` admits ONLY these globals:

* ``torch.multiprocessing.reductions.rebuild_tensor``, ``rebuild_typed_storage``,
  ``rebuild_storage_filename`` (CPU tensors under the ``file_system`` sharing
  strategy) and ``rebuild_cuda_tensor`` (CUDA IPC), plus SGLang's
  ``sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified`` (the same CUDA IPC
  arguments with the device named by GPU UUID);
* ``torch.Tensor``, ``torch.nn.Parameter``, ``torch.storage.UntypedStorage`` and
  ``torch.storage.TypedStorage`` as inert markers (they are only ever passed as
  arguments; calling one fails);
* ``torch.Size``, the torch dtypes of :data:`~router.contract.bucket_layout.DTYPE_ITEMSIZE`,
  ``collections.OrderedDict``, and ``_codecs.encode`` only as ``(str, "latin1")``
  (protocol 2's spelling of ``bytes``);
* any ``<module>.FlattenedTensorMetadata``, mapped onto the local dataclass
  :class:`~worker.transfer.handles.pickle_records.FlattenedTensorMetadata` (its fields are
  checked after loading);
* ``LocalSerializedTensor`` under SGLang's two module paths
  (``sglang.srt.model_executor.model_runner_components.weight_updater``, and
  ``sglang.srt.model_executor.model_runner`` before SGLang 0.5.16), mapped onto
  :class:`~worker.transfer.handles.sglang_wrappers.LocalSerializedRecord`: only as pickle stores
  an instance, with state exactly ``{"values": [bytes | base64 str, ...]}``, only as the
  tensor of a ``(name, tensor)`` pair, with exactly one pickle per TP rank of this
  worker. This worker's rank's pickle (``values[tp_rank]``) is loaded by this same
  unpickler, where a further ``LocalSerializedTensor`` is refused (one level only) and
  the result must be a tensor record; the other ranks' pickles are never loaded.

Anything else — ``os.system``, ``builtins.eval``, ``subprocess.Popen``, even other
torch functions, SGLang's NPU rebuild — raises :class:`UnsafePayload` before any
callable runs. ``rebuild_storage_fd`` (the ``file_descriptor`` strategy) is refused
too: it connects back to the producer's resource-sharer socket to receive a file
descriptor; callers should use the ``file_system`` strategy or the JSON handle
format (:mod:`router.contract.tensor_handles`).

Even the admitted rebuild functions do not run while loading: they are replaced
by records (:mod:`worker.transfer.handles.pickle_records`), so names, dtypes and shapes are
checked against the model first, a CUDA record's device (an index, or SGLang's GPU
UUID) is mapped to this host's index — a UUID of a GPU this host does not have is
refused (:func:`~worker.transfer.handles.sglang_wrappers.on_local_devices`) — and memory is
only opened after that, by :func:`materialize`. What this still trusts:
``rebuild_storage_filename`` opens a shared-memory segment by a name the caller
chose, through the ``torch_shm_manager`` socket path the caller chose (a local Unix
socket), and ``rebuild_cuda_tensor`` opens the CUDA IPC handle the caller chose on the
local GPU the caller named. A caller who can reach this route can make the worker
read any such segment or IPC allocation it can name — which is why the route is off
unless ``--allow-pickled-tensors`` is given. And a pickled storage that declares more
bytes than its segment holds is not refused: torch extends the segment, so the
missing bytes read as zeros (the JSON handle format checks the segment's size and
refuses it).
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from router.contract.bucket_layout import DTYPE_ITEMSIZE
from worker.transfer.handles import pickle_records as rec
from worker.transfer.handles.pickle_records import (
    CUDA_DEVICE_ARG,
    CUDA_HANDLE_ARG,
    CUDA_SIZE_ARG,
    CudaTensor,
    FlattenedTensorMetadata,
    LazyTensor,
    SharedTensor,
    UnsafePayload,
    int_tuple,
    rebuild_cuda_record,
)
from worker.transfer.handles.sglang_wrappers import (
    LOCAL_SERIALIZED_TENSOR,
    LOCAL_SERIALIZED_TENSOR_MODULES,
    MAX_WRAPPER_DEPTH,
    PATCHED_CUDA_REBUILD,
    LocalSerializedRecord,
    rank_payload,
)

_REDUCTIONS = "torch.multiprocessing.reductions"

_FUNCTIONS: dict[tuple[str, str], Any] = {
    (_REDUCTIONS, "rebuild_tensor"): rec.rebuild_tensor,
    (_REDUCTIONS, "rebuild_typed_storage"): rec.rebuild_typed_storage,
    (_REDUCTIONS, "rebuild_storage_filename"): rec.rebuild_storage_filename,
    (_REDUCTIONS, "rebuild_cuda_tensor"): rebuild_cuda_record,
    (_REDUCTIONS, "rebuild_storage_fd"): rec.refuse_fd,
    PATCHED_CUDA_REBUILD: rebuild_cuda_record,
    ("torch", "Size"): torch.Size,
    ("collections", "OrderedDict"): OrderedDict,
    ("_codecs", "encode"): rec.codecs_encode,
}


class RestrictedUnpickler(pickle.Unpickler):
    """``find_class`` resolves only the allowlist of the module docstring.

    ``depth`` is how many ``LocalSerializedTensor`` levels enclose this pickle (0 for a
    ``serialized_named_tensors`` entry); at :data:`MAX_WRAPPER_DEPTH` the wrapper is refused."""

    def __init__(self, file: io.BytesIO, *, depth: int = 0) -> None:
        super().__init__(file)
        self.depth = depth

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in _FUNCTIONS:
            return _FUNCTIONS[key]
        if key in rec.MARKERS:
            return rec.MARKERS[key]
        if module == "torch" and name in DTYPE_ITEMSIZE:
            return getattr(torch, name)
        if name == "FlattenedTensorMetadata":
            return FlattenedTensorMetadata
        if name == LOCAL_SERIALIZED_TENSOR and module in LOCAL_SERIALIZED_TENSOR_MODULES:
            if self.depth >= MAX_WRAPPER_DEPTH:
                raise UnsafePayload(
                    f"LocalSerializedTensor nested more than {MAX_WRAPPER_DEPTH} level(s) deep is not accepted"
                )
            return LocalSerializedRecord
        raise UnsafePayload(f"the payload references {module}.{name}, which is not on the allowlist")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePayload("persistent ids are not accepted")


def load_raw(raw: bytes, *, depth: int = 0) -> Any:
    """Load one raw pickle with :class:`RestrictedUnpickler` (no memory is opened)."""
    try:
        return RestrictedUnpickler(io.BytesIO(raw), depth=depth).load()
    except UnsafePayload:
        raise
    except Exception as exc:  # a malformed stream: any pickle/type error is the caller's
        raise UnsafePayload(f"the payload could not be decoded: {type(exc).__name__}: {exc}") from None


def loads(payload: str | bytes) -> Any:
    """Decode one rank's base64 payload with :class:`RestrictedUnpickler` (no memory is opened)."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise UnsafePayload("serialized_named_tensors entry is not valid base64") from None
    return load_raw(raw)


def unwrap(record: LocalSerializedRecord, tp_rank: int, tp_size: int) -> LazyTensor:
    """The tensor record of TP rank ``tp_rank``'s own pickle in an SGLang ``LocalSerializedTensor``."""
    inner = load_raw(rank_payload(record, tp_rank, tp_size), depth=MAX_WRAPPER_DEPTH)
    if not isinstance(inner, SharedTensor | CudaTensor):
        raise UnsafePayload("LocalSerializedTensor.values must hold pickled shared tensors")
    return inner


def named_lazy_tensors(
    obj: Any, load_format: str | None, *, tp_rank: int = 0, tp_size: int = 1
) -> list[tuple[str, LazyTensor]]:
    """The ``(name, tensor record)`` pairs of a loaded payload (list form), or raise :class:`UnsafePayload`.

    A ``LocalSerializedTensor`` is replaced by the record of its ``values[tp_rank]``
    (:func:`unwrap`). A ``flattened_bucket`` payload is refused here: use
    :func:`flattened_entries` for it."""
    if load_format == "flattened_bucket":
        raise UnsafePayload("use flattened_entries for flattened_bucket payloads")
    if not isinstance(obj, list):
        raise UnsafePayload("the payload must be a list of (name, tensor) pairs")
    pairs: list[tuple[str, LazyTensor]] = []
    for item in obj:
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)):
            raise UnsafePayload("each entry must be a (name, tensor) pair")
        tensor = item[1]
        if isinstance(tensor, LocalSerializedRecord):
            try:
                tensor = unwrap(tensor, tp_rank, tp_size)
            except UnsafePayload as exc:
                raise UnsafePayload(f"{item[0]!r}: {exc}") from None
        if not isinstance(tensor, SharedTensor | CudaTensor):
            raise UnsafePayload(f"{item[0]!r}: not a shared tensor")
        pairs.append((item[0], tensor))
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
        shape = int_tuple(m.shape, f"{m.name}: shape")
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


def _materialize_cuda(record: CudaTensor) -> torch.Tensor:  # pragma: no cover - needs a GPU and a CUDA producer
    """Open a CUDA IPC record on its (already local) device and return an owned copy on that device."""
    device = record.device
    if not isinstance(device, int):
        raise UnsafePayload("a CUDA record's device must be mapped to a local index first (on_local_devices)")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(record.args)
    if args[CUDA_HANDLE_ARG] is None or args[CUDA_SIZE_ARG] == 0:
        # An empty storage has no IPC handle; torch's rebuild would construct the storage class.
        return torch.empty(record.shape, dtype=record.dtype, device=torch.device("cuda", device))
    args[0], args[4], args[CUDA_DEVICE_ARG] = torch.Tensor, torch.UntypedStorage, device
    # torch leaves its reductions unannotated.
    shared: torch.Tensor = rebuild_cuda_tensor(*args)  # type: ignore[no-untyped-call]
    return shared.clone()


def materialize(record: LazyTensor) -> torch.Tensor:
    """Open the memory a checked record names and return an owned copy (the mapping is dropped):
    on the CPU for shared memory, on the record's local GPU for CUDA IPC."""
    if isinstance(record, CudaTensor):
        return _materialize_cuda(record)
    from torch.multiprocessing.reductions import rebuild_storage_filename

    st = record.storage
    itemsize = st.dtype.itemsize if st.dtype is not None else 1
    extent = record.offset + sum((n - 1) * s for n, s in zip(record.shape, record.stride, strict=True)) + 1
    if 0 not in record.shape and extent > st.size:
        raise UnsafePayload(f"a tensor reaches element {extent} of a {st.size}-element storage")
    # torch leaves its reductions unannotated.
    storage: torch.UntypedStorage = rebuild_storage_filename(  # type: ignore[no-untyped-call]
        torch.UntypedStorage, st.manager, st.handle, st.size * itemsize
    )
    untyped = storage.untyped()  # type: ignore[no-untyped-call]  # torch leaves it unannotated too
    view = torch.empty(0, dtype=record.dtype).set_(untyped, record.offset, torch.Size(record.shape), record.stride)
    copy = view.clone()
    del view, untyped, storage
    return copy
