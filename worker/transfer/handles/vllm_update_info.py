"""The shared-memory form of vLLM's ``/update_weights``: check ``update_info``, return the staging step.

Two encodings, both through the project's one handle layer:

* ``tensor_handles``: the JSON handle message (:mod:`router.contract.tensor_handles`);
  its tensors must be exactly those ``names``/``dtype_names``/``shapes`` announce.
* ``ipc_handles_pickled``: vLLM's HTTP form, ``base64(pickle([{gpu_uuid: (rebuild_cuda_tensor,
  args)}, ...]))``, one entry per name. Refused unless the worker runs with
  ``--allow-pickled-tensors``; decoded with the restricted unpickler
  (:mod:`worker.transfer.handles.safe_unpickle`), which admits ``rebuild_cuda_tensor`` as a
  record, never as a call. The handle for this worker's GPU is picked by its UUID and
  its device index replaced by the local one, as vLLM's receiver does.

Nothing is opened here: :func:`prepare` checks, and the returned step (run off the
event loop, inside the update) opens the memory and copies the tensors out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from router.contract.vllm import WeightTransferUpdateInfo
from router.contract.weight_sync import TensorListMeta
from router.dataplane.buckets import NamedTensors, dtype_name
from worker.transfer.handles import json_message, safe_unpickle
from worker.transfer.handles.pickle_records import CudaTensor, rebuild_cuda_record
from worker.transfer.validation import Spec, validate_buckets

#: ``rebuild_cuda_tensor``'s argument that holds the producer's device index.
_DEVICE_INDEX_ARG = 6


def prepare(
    info: WeightTransferUpdateInfo,
    spec: Spec,
    is_ignored: Callable[[str], bool],
    device: torch.device,
    *,
    allow_pickled: bool,
) -> Callable[[], NamedTensors]:
    """Raise ``ValueError`` (400) unless ``info`` describes tensors of the model that this worker can open."""
    announced = TensorListMeta(names=info.names, dtypes=info.dtype_names, shapes=info.shapes)
    validate_buckets([announced], spec, flattened=False, is_ignored=is_ignored)
    wanted = {n: (d, tuple(s)) for n, d, s in zip(info.names, info.dtype_names, info.shapes, strict=True)}
    if info.tensor_handles is not None:
        message = info.tensor_handles
        carried = {t.name: (t.dtype, tuple(t.shape)) for b in message.buckets for t in b.tensors}
        if carried != wanted:
            raise ValueError("tensor_handles must carry exactly the tensors names/dtype_names/shapes announce")
        return lambda: json_message.load(message)
    if not allow_pickled:
        raise ValueError(
            "ipc_handles_pickled is refused: start the worker with --allow-pickled-tensors (restricted unpickler), "
            "or send the JSON handle format in tensor_handles"
        )
    records = _pickled_records(info, device)
    for name, record in zip(info.names, records, strict=True):
        if (dtype_name(record.dtype), tuple(record.shape)) != wanted[name]:
            raise ValueError(f"{name!r}: the IPC handle's dtype or shape differs from the announced one")
    return lambda: [(name, safe_unpickle.materialize(r)) for name, r in zip(info.names, records, strict=True)]


def _pickled_records(info: WeightTransferUpdateInfo, device: torch.device) -> list[CudaTensor]:
    assert info.ipc_handles_pickled is not None
    handles = safe_unpickle.loads(info.ipc_handles_pickled)
    if not isinstance(handles, list) or len(handles) != len(info.names):
        raise ValueError(f"ipc_handles_pickled must hold one handle per name ({len(info.names)})")
    if device.type != "cuda":
        raise ValueError("CUDA IPC handles need a CUDA worker; a CPU worker takes tensor_handles")
    uuid = str(torch.cuda.get_device_properties(device).uuid)  # pragma: no cover - needs a GPU
    records = []  # pragma: no cover - needs a GPU
    for name, per_gpu in zip(info.names, handles, strict=True):  # pragma: no cover - needs a GPU
        if not isinstance(per_gpu, dict) or uuid not in per_gpu:
            raise ValueError(f"{name!r}: no IPC handle for this worker's GPU {uuid}")
        handle = per_gpu[uuid]
        if not (isinstance(handle, tuple) and len(handle) == 2 and handle[0] is rebuild_cuda_record):
            raise ValueError(f"{name!r}: the handle is not a (rebuild_cuda_tensor, args) pair")
        args = list(handle[1])
        args[_DEVICE_INDEX_ARG] = device.index if device.index is not None else torch.cuda.current_device()
        records.append(rebuild_cuda_record(*args))
    return records
