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
from worker.transfer import safe_unpickle, sglang_wrappers, tensor_handles
from worker.transfer.validation import Spec, validate_buckets

PICKLE_FORMATS = (None, "direct", "flattened_bucket")
#: The route serves pickled payloads at tp_size 1 only, so this worker is TP rank 0 of 1: it
#: loads ``serialized_named_tensors[0]`` and, of each ``LocalSerializedTensor``, ``values[0]``.
TP_RANK, TP_SIZE = 0, 1


def prepare(
    req: UpdateWeightsFromTensorRequest, spec: Spec, is_ignored: Callable[[str], bool], *, allow_pickled: bool
) -> Callable[[], NamedTensors]:
    if req.tensor_handles is not None:
        if req.serialized_named_tensors or req.load_format is not None:
            raise ValueError("send either tensor_handles or serialized_named_tensors (with load_format), not both")
        message = req.tensor_handles
        tensor_handles.check_against_model(message, spec, is_ignored)
        return lambda: tensor_handles.load(message)
    if not req.serialized_named_tensors:
        raise ValueError("serialized_named_tensors (one entry per TP rank) or tensor_handles is required")
    if req.load_format not in PICKLE_FORMATS:
        raise ValueError(f"load_format {req.load_format!r} is not supported; expected one of {list(PICKLE_FORMATS)}")
    if not allow_pickled:
        raise ValueError(
            "pickled serialized_named_tensors are refused: start the worker with --allow-pickled-tensors "
            "(restricted unpickler), or send the JSON handle format in tensor_handles"
        )
    obj = safe_unpickle.loads(req.serialized_named_tensors[TP_RANK])
    if req.load_format == "flattened_bucket":
        flat, entries = safe_unpickle.flattened_entries(obj)
        _check([(e.name, dtype_name(e.dtype), e.shape) for e in entries], spec, is_ignored)
        [flat] = sglang_wrappers.on_local_devices([flat])

        def stage_flat() -> NamedTensors:
            buffer = safe_unpickle.materialize(flat)
            return [(e.name, buffer[e.start : e.end].view(e.dtype).reshape(e.shape).clone()) for e in entries]

        return stage_flat
    pairs = safe_unpickle.named_lazy_tensors(obj, req.load_format, tp_rank=TP_RANK, tp_size=TP_SIZE)
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
