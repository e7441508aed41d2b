"""Check an update's metadata against the served model before anything is received,
and each received bucket against the checksum the trainer announced before it is applied.

A receive that starts on wrong metadata either hangs (fewer broadcasts than
the trainer sends), crashes the process (gloo aborts when a message is longer
than the receive's slack) or loads garbage. So every name, dtype and shape is
checked here, against ``model.checkpoint_spec()`` (names after the
checkpoint→fused mapping), and a refused update starts no receive at all.

Right metadata does not make right bytes: a trainer may broadcast other bytes
than it described. Byte counts are held by the receive itself (over gloo,
:mod:`router.dataplane.canary`); a bucket's ``checksum``, when the two-phase
metadata carries one, is verified by :func:`verify_bucket` after the receive and
before the apply.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from router.contract.bucket_layout import BucketLayout, LayoutError
from router.contract.weight_sync import BucketMetadata, TensorListMeta
from router.dataplane.buckets import NamedTensors, bucket_checksum, dtype_name

Spec = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
MAX_PROBLEMS_SHOWN = 5


class MetadataError(ValueError):
    """Update metadata that does not fit the served model."""


class ChecksumMismatch(ValueError):
    """A received bucket's bytes differ from the checksum the trainer announced for it."""


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


def announced_checksums(buckets: Sequence[TensorListMeta]) -> tuple[str | None, ...]:
    """Each bucket's announced checksum, or ``None`` (SGLang's single-phase body carries none)."""
    return tuple(b.checksum if isinstance(b, BucketMetadata) else None for b in buckets)


def verify_bucket(expected: str | None, named: NamedTensors) -> None:
    """Raise :class:`ChecksumMismatch` unless the bucket's bytes (its tensors in slot order, no
    padding) have the checksum ``expected``; nothing to check when it is ``None``.

    ``zlib.crc32`` releases the GIL over CPU buffers, so a receive on another thread goes on
    meanwhile; on CUDA each tensor is first copied to host (one device-to-host copy of the bucket).
    """
    if expected is None:
        return
    got = bucket_checksum(t for _, t in named)
    if got != expected:
        raise ChecksumMismatch(
            f"checksum mismatch: the received bytes have {got}, the trainer announced {expected} "
            "(the broadcast does not match the metadata)"
        )


def verify_staged(buckets: Sequence[tuple[int, NamedTensors]], expected: Sequence[str | None]) -> None:
    """Atomic updates, before the staged apply: :func:`verify_bucket` for every ``(index, named)``,
    raising :class:`ChecksumMismatch` naming the first bucket that does not match."""
    for index, named in buckets:
        try:
            verify_bucket(expected[index], named)
        except ChecksumMismatch as exc:
            raise ChecksumMismatch(f"bucket {index + 1}/{len(expected)} not applied: {exc}") from None
