"""Turn an ``/update_weights_from_tensor`` body into a checked staging step.

:func:`prepare` runs on the event loop and opens nothing: it decodes the body
(the JSON handle message, or a pickled payload through the restricted unpickler,
SGLang's ``LocalSerializedTensor`` wrappers included), checks every name, dtype and
shape against the model, maps every CUDA IPC record's device (an index, or SGLang's
GPU UUID) to this host's index, and returns the step that later opens the shared
memory and copies the tensors out (run off the event loop inside the update
transaction). Any problem raises a ``ValueError`` subclass: 400.
"""

from __future__ import annotations

from collections.abc import Callable

from router.contract.admin import UpdateWeightsFromTensorRequest
from router.contract.weight_sync import TensorListMeta
from router.dataplane.buckets import NamedTensors, dtype_name
from worker.transfer.handles import json_message, safe_unpickle, sglang_wrappers
from worker.transfer.validation import Spec, validate_buckets

PICKLE_FORMATS = (None, "direct", "flattened_bucket")
#: The TP rank whose part of a pickled payload is opened. SGLang's trainers send one entry per TP
#: rank, each wrapping one copy of the full tensor per rank (``LocalSerializedTensor.values``), and
#: every rank of an SGLang server opens its own. Here TP rank 0 opens ``serialized_named_tensors[0]``
#: and ``values[0]`` and hands the full tensors to its followers as every other update does, so the
#: other ranks' handles are never opened (on a GPU: they stay the trainer's memory, untouched).
OPENING_RANK = 0


def prepare(
    req: UpdateWeightsFromTensorRequest,
    spec: Spec,
    is_ignored: Callable[[str], bool],
    *,
    allow_pickled: bool,
    tp_size: int = 1,
) -> Callable[[], NamedTensors]:
    if req.tensor_handles is not None:
        if req.serialized_named_tensors or req.load_format is not None:
            raise ValueError("send either tensor_handles or serialized_named_tensors (with load_format), not both")
        message = req.tensor_handles
        json_message.check_against_model(message, spec, is_ignored)
        return lambda: json_message.load(message)
    if not req.serialized_named_tensors:
        raise ValueError("serialized_named_tensors (one entry per TP rank) or tensor_handles is required")
    if req.load_format not in PICKLE_FORMATS:
        raise ValueError(f"load_format {req.load_format!r} is not supported; expected one of {list(PICKLE_FORMATS)}")
    if not allow_pickled:
        raise ValueError(
            "pickled serialized_named_tensors are refused: start the worker with --allow-pickled-tensors "
            "(restricted unpickler), or send the JSON handle format in tensor_handles"
        )
    if len(req.serialized_named_tensors) < tp_size:
        raise ValueError(
            f"serialized_named_tensors has {len(req.serialized_named_tensors)} entries; this worker has "
            f"tp_size {tp_size} and, as SGLang, needs one per TP rank"
        )
    obj = safe_unpickle.loads(req.serialized_named_tensors[OPENING_RANK])
    if req.load_format == "flattened_bucket":
        flat, entries = safe_unpickle.flattened_entries(obj)
        _check([(e.name, dtype_name(e.dtype), e.shape) for e in entries], spec, is_ignored)
        [flat] = sglang_wrappers.on_local_devices([flat])

        def stage_flat() -> NamedTensors:
            buffer = safe_unpickle.materialize(flat)
            return [(e.name, buffer[e.start : e.end].view(e.dtype).reshape(e.shape).clone()) for e in entries]

        return stage_flat
    pairs = safe_unpickle.named_lazy_tensors(obj, req.load_format, tp_rank=OPENING_RANK, tp_size=tp_size)
    _check([(name, dtype_name(r.dtype), r.shape) for name, r in pairs], spec, is_ignored)
    records = sglang_wrappers.on_local_devices([r for _, r in pairs])
    pairs = [(name, r) for (name, _), r in zip(pairs, records, strict=True)]
    return lambda: [(name, safe_unpickle.materialize(r)) for name, r in pairs]


def _check(entries: list[tuple[str, str, tuple[int, ...]]], spec: Spec, is_ignored: Callable[[str], bool]) -> None:
    if not entries:
        raise ValueError("the payload holds no tensors")
    meta = TensorListMeta(
        names=[n for n, _, _ in entries], dtypes=[d for _, d, _ in entries], shapes=[list(s) for _, _, s in entries]
    )
    validate_buckets([meta], spec, flattened=False, is_ignored=is_ignored)
