"""Check an update's metadata against the served model before anything is received.

A receive that starts on wrong metadata either hangs (fewer broadcasts than
the trainer sends), crashes the process (gloo aborts on a size mismatch in its
I/O thread) or loads garbage. So every name, dtype and shape is checked here,
against ``model.checkpoint_spec()`` (names after the checkpoint→fused mapping),
and a refused update starts no receive at all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from router.contract.bucket_layout import BucketLayout, LayoutError
from router.contract.weight_sync import TensorListMeta
from router.dataplane.buckets import dtype_name

Spec = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
MAX_PROBLEMS_SHOWN = 5


class MetadataError(ValueError):
    """Update metadata that does not fit the served model."""


def validate_buckets(
    buckets: Sequence[TensorListMeta],
    spec: Spec,
    *,
    flattened: bool,
    is_ignored: Callable[[str], bool] = lambda _name: False,
) -> list[BucketLayout]:
    """The layouts of ``buckets``, or :class:`MetadataError` listing what is wrong.

    ``is_ignored`` names (a tied ``lm_head.weight``, rotary caches) are accepted
    and skipped by the model's loader, so they only need a valid dtype.
    """
    problems: list[str] = []
    layouts: list[BucketLayout] = []
    seen: set[str] = set()
    for index, bucket in enumerate(buckets):
        where = f"bucket {index + 1}: " if len(buckets) > 1 else ""
        try:
            if flattened:
                bucket.layout.check_aligned()
        except LayoutError as exc:
            problems.append(f"{where}{exc}")
            continue
        layouts.append(bucket.layout)
        for slot in layouts[-1].slots:
            if slot.name in seen:
                problems.append(f"{where}tensor {slot.name!r} is sent twice")
                continue
            seen.add(slot.name)
            if is_ignored(slot.name):
                continue
            expected = spec.get(slot.name)
            if expected is None:
                problems.append(f"{where}unknown parameter name {slot.name!r}")
                continue
            want_dtype, want_shape = dtype_name(expected[0]), tuple(expected[1])
            if slot.dtype != want_dtype:
                problems.append(f"{where}{slot.name}: dtype {slot.dtype} does not match the model's {want_dtype}")
            if slot.shape != want_shape:
                problems.append(
                    f"{where}{slot.name}: shape {list(slot.shape)} does not match the model's {list(want_shape)}"
                )
    if problems:
        shown = "; ".join(problems[:MAX_PROBLEMS_SHOWN])
        more = f" (and {len(problems) - MAX_PROBLEMS_SHOWN} more)" if len(problems) > MAX_PROBLEMS_SHOWN else ""
        raise MetadataError(f"{len(problems)} problem(s) in the update metadata: {shown}{more}")
    return layouts
