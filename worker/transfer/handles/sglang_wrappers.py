"""SGLang's wrappers around pickled tensors, admitted by the restricted unpickler as records.

SGLang's ``update_weights`` helper (``sglang.srt.weight_sync.utils``, which verl's SGLang
adapter calls) posts ``serialized_named_tensors`` whose list holds ``(name,
LocalSerializedTensor(values=[...]))`` pairs: ``values[r]`` is TP rank ``r``'s own
``ForkingPickler`` pickle (bytes) of that tensor, and SGLang's rank ``r`` loads only
``values[r]`` (``LocalSerializedTensor.get(rank)``). Before pickling, the helper applies
SGLang's patched torch reductions, so each inner pickle names
``sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified`` with the producer's device
as a GPU UUID string (``str(torch.cuda.get_device_properties(i).uuid)``) instead of an
index; SGLang's receiver maps the UUID back to the local index by comparing it with every
visible device's UUID. (That patch only serializes CUDA tensors: a CPU tensor has no device
argument for it to replace, which is why verl moves CPU tensors to the GPU first.)

Here neither SGLang class nor function is ever constructed or called:

* :class:`LocalSerializedRecord` stands in for ``LocalSerializedTensor`` (under its 0.5.16+
  module ``...model_runner_components.weight_updater`` and its older one
  ``...model_runner``). Its state must be exactly ``{"values": [bytes | str, ...]}``;
  :func:`rank_payload` checks the list against this worker's TP size and returns its own
  rank's pickle, which the restricted unpickler then loads again, one level deep only.
* ``_rebuild_cuda_tensor_modified`` becomes the same :class:`~worker.transfer.handles.pickle_records.CudaTensor`
  record as torch's ``rebuild_cuda_tensor``; :func:`on_local_devices` maps its device
  (UUID or index) to this host's index before any IPC handle is opened, and refuses a
  UUID that is not on this host.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from worker.transfer.handles.pickle_records import CUDA_DEVICE_ARG, CudaTensor, LazyTensor, UnsafePayload

#: The modules SGLang's ``LocalSerializedTensor`` has lived in (0.5.16 moved it).
LOCAL_SERIALIZED_TENSOR_MODULES = (
    "sglang.srt.model_executor.model_runner_components.weight_updater",
    "sglang.srt.model_executor.model_runner",
)
LOCAL_SERIALIZED_TENSOR = "LocalSerializedTensor"
#: SGLang's patched ``rebuild_cuda_tensor`` (same arguments, device given by GPU UUID).
PATCHED_CUDA_REBUILD = ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")
#: How many ``LocalSerializedTensor`` levels a payload may nest: the outer list's wrappers
#: only. A wrapper inside a wrapper's pickle is refused (SGLang's rank would fail on it
#: too: it expects a tensor there).
MAX_WRAPPER_DEPTH = 1


class LocalSerializedRecord:
    """SGLang's ``LocalSerializedTensor(values=[one pickle per TP rank])`` as loaded: the
    per-rank pickles, none of them loaded yet.

    Only the way ``pickle`` stores a dataclass instance is accepted (``NEWOBJ`` with no
    arguments, then ``BUILD`` with the instance dict); calling the class is refused."""

    __slots__ = ("values",)

    values: list[bytes | str]

    def __new__(cls, *args: Any, **kwargs: Any) -> LocalSerializedRecord:
        if args or kwargs:
            raise UnsafePayload("LocalSerializedTensor is admitted only as pickle stores an instance (no arguments)")
        return super().__new__(cls)

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or set(state) != {"values"}:
            raise UnsafePayload("LocalSerializedTensor's state must be exactly {'values': [...]}")
        values = state["values"]
        if not isinstance(values, list) or not all(isinstance(v, bytes | str) for v in values):
            raise UnsafePayload("LocalSerializedTensor.values must be a list of pickles (bytes, or base64 str)")
        self.values = values


def rank_payload(record: LocalSerializedRecord, tp_rank: int, tp_size: int) -> bytes:
    """The raw pickle TP rank ``tp_rank`` loads (``values[tp_rank]``, as SGLang's rank does).

    ``values`` must hold exactly ``tp_size`` pickles: SGLang's helper writes one per rank of
    the inference TP group the trainer was configured with, so another count means the
    trainer and this worker disagree about the TP size (SGLang itself would index blindly)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is outside tp_size {tp_size}")
    values = getattr(record, "values", None)
    if values is None:
        raise UnsafePayload("LocalSerializedTensor without values")
    if len(values) != tp_size:
        raise UnsafePayload(
            f"LocalSerializedTensor holds {len(values)} per-rank pickles, this worker has tp_size {tp_size}: "
            "the trainer's inference TP size must match the worker's"
        )
    value = values[tp_rank]
    if isinstance(value, bytes):
        return value
    try:  # SGLang's deserializer takes a str as base64
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise UnsafePayload("LocalSerializedTensor.values entry is a str but not valid base64") from None


# -- GPU UUIDs -----------------------------------------------------------------------------


def local_device_uuids() -> list[str]:
    """This process's CUDA devices' UUIDs, in device-index order (empty without CUDA), written as
    SGLang's patched reductions write them."""
    if not torch.cuda.is_available():
        return []
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def device_index(device: int | str, uuids: Sequence[str]) -> int:
    """The local index of ``device`` (an index, or a GPU UUID) among ``uuids``; raise
    :class:`UnsafePayload` for a device that is not on this host."""
    seen = f"this worker sees {len(uuids)} CUDA device(s)" if uuids else "this worker sees no CUDA device"
    if isinstance(device, str):
        for index, uuid in enumerate(uuids):
            if uuid == device:
                return index
        raise UnsafePayload(
            f"the payload's tensor is on GPU {device!r}, which is not on this host ({seen}): CUDA IPC handles "
            "open only on the GPU that holds them; colocate the trainer or send CPU shared memory"
        )
    if isinstance(device, int) and not isinstance(device, bool) and 0 <= device < len(uuids):
        return device
    raise UnsafePayload(f"the payload's tensor is on CUDA device {device!r}, which {seen}")


def on_local_devices(records: Sequence[LazyTensor], uuids: Sequence[str] | None = None) -> list[LazyTensor]:
    """``records`` with every CUDA record's device replaced by its local index.

    ``uuids`` is this host's device table (:func:`local_device_uuids`, read only when a CUDA
    record is present); tests pass their own."""
    if not any(isinstance(r, CudaTensor) for r in records):
        return list(records)
    table = local_device_uuids() if uuids is None else uuids
    out: list[LazyTensor] = []
    for record in records:
        if isinstance(record, CudaTensor):
            args = list(record.args)
            args[CUDA_DEVICE_ARG] = device_index(record.device, table)
            record = dataclasses.replace(record, args=tuple(args))
        out.append(record)
    return out
