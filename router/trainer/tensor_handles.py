"""Trainer side of the JSON handle format: put named CPU tensors into one new shared-memory
segment and describe them (:mod:`router.contract.tensor_handles`).

torch is imported inside :func:`build_cpu_handles` only, so importing this module
stays torch-free like the rest of the router package's contract users.
"""

from __future__ import annotations

from collections.abc import Sequence
from multiprocessing import shared_memory
from typing import TYPE_CHECKING, Any

from router.contract.bucket_layout import BucketLayout, aligned_order
from router.contract.tensor_handles import FORMAT, HandleMessage

if TYPE_CHECKING:
    import torch


def build_cpu_handles(
    named: Sequence[tuple[str, torch.Tensor]], **fields: Any
) -> tuple[dict[str, Any], shared_memory.SharedMemory]:
    """``(request_body, segment)`` for ``/update_weights_from_tensor``.

    The tensors are laid out back to back, larger element sizes first, so every offset is
    aligned (as :func:`~router.contract.bucket_layout.aligned_order` does for flattened
    buckets). The caller keeps ``segment`` alive until the worker has answered (the answer
    comes after the worker copied the tensors out), then calls ``close()`` and ``unlink()``.
    ``fields`` are the request's other fields (``weight_version``, ``flush_cache``, ...).
    """
    import torch

    from router.dataplane.buckets import dtype_name

    order = aligned_order([dtype_name(t.dtype) for _, t in named])
    ordered = [named[i] for i in order]
    layout = BucketLayout.from_meta(
        [n for n, _ in ordered], [dtype_name(t.dtype) for _, t in ordered], [list(t.shape) for _, t in ordered]
    )
    segment = shared_memory.SharedMemory(create=True, size=max(layout.total_bytes, 1))
    try:
        assert segment.buf is not None
        flat = (
            torch.frombuffer(segment.buf, dtype=torch.uint8, count=layout.total_bytes) if layout.total_bytes else None
        )
        for slot, (_, tensor) in zip(layout.slots, ordered, strict=True):
            if slot.nbytes and flat is not None:
                src = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                flat[slot.offset : slot.end].copy_(src)
        del flat
        message = HandleMessage.model_validate(
            {
                "format": FORMAT,
                "buckets": [
                    {
                        "memory": {"kind": "cpu_shm", "name": segment.name, "size": segment.size},
                        "tensors": [
                            {"name": s.name, "dtype": s.dtype, "shape": list(s.shape), "offset": s.offset}
                            for s in layout.slots
                        ],
                    }
                ],
            }
        )
    except BaseException:
        segment.close()
        segment.unlink()
        raise
    return {**fields, "tensor_handles": message.model_dump(mode="json")}, segment
