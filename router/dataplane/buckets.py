"""Pack tensors into, and view them out of, one flattened ``uint8`` bucket.

The byte layout is :class:`router.contract.bucket_layout.BucketLayout` — the
single definition the sender, the receivers and the router validate against.
A bucket is always one allocation; unpacking returns zero-copy views into it,
so a received bucket costs its bytes once, not twice (SGLang v0.5.9 allocates
every tensor and then ``torch.cat``s them).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence

import torch

from router.contract.bucket_layout import DTYPE_ITEMSIZE, BucketLayout, LayoutError, TensorSlot

NamedTensors = list[tuple[str, torch.Tensor]]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a protocol dtype name (from the fixed table only)."""
    if name not in DTYPE_ITEMSIZE:
        raise LayoutError(f"unsupported dtype {name!r}")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (the wire spelling)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_ITEMSIZE:
        raise LayoutError(f"unsupported dtype {dtype}")
    return name


def layout_of(named: Sequence[tuple[str, torch.Tensor]], *, require_aligned: bool = True) -> BucketLayout:
    """The layout of ``named`` in the given order."""
    return BucketLayout.from_meta(
        [n for n, _ in named],
        [dtype_name(t.dtype) for _, t in named],
        [list(t.shape) for _, t in named],
        require_aligned=require_aligned,
    )


def allocate(layout: BucketLayout, device: torch.device | str = "cpu") -> torch.Tensor:
    """One uninitialised ``uint8`` buffer big enough for ``layout``."""
    return allocate_bytes(layout.total_bytes, device)


def allocate_bytes(nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """One uninitialised ``uint8`` buffer of ``nbytes`` (reused for buckets up to that size)."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def slot_view(buffer: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    """A zero-copy, correctly typed and shaped view of one slot of ``buffer``."""
    raw = buffer[slot.offset : slot.end]
    if slot.nbytes == 0:
        return torch.empty(slot.shape, dtype=torch_dtype(slot.dtype), device=buffer.device)
    # view(dtype) needs the slice to start at a multiple of the element size:
    # guaranteed by the alignment check done when the layout was validated.
    return raw.view(torch_dtype(slot.dtype)).view(slot.shape)


def unpack(buffer: torch.Tensor, layout: BucketLayout) -> NamedTensors:
    """Views of every tensor of ``layout`` inside ``buffer`` (no copy)."""
    _check_buffer(buffer, layout, "bucket buffer")
    return [(slot.name, slot_view(buffer, slot)) for slot in layout.slots]


def pack(
    named: Iterable[tuple[str, torch.Tensor]], layout: BucketLayout, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy tensors into a flattened buffer laid out as ``layout``.

    ``named`` must follow the layout's order, names, dtypes and shapes exactly;
    a mismatch raises :class:`LayoutError` rather than sending wrong bytes.
    ``out`` (at least ``layout.total_bytes`` long) is reused when given, so a
    sender can keep one registered buffer across steps.
    """
    if out is None:
        out = allocate(layout, device="cpu")
    else:
        _check_buffer(out, layout, "output buffer")
    count = 0
    for (name, tensor), slot in zip(named, layout.slots, strict=False):
        count += 1
        if name != slot.name or dtype_name(tensor.dtype) != slot.dtype or tuple(tensor.shape) != slot.shape:
            raise LayoutError(
                f"tensor {name!r} ({tensor.dtype}, {list(tensor.shape)}) does not match the planned slot "
                f"{slot.name!r} ({slot.dtype}, {list(slot.shape)})"
            )
        if slot.nbytes:
            slot_view(out, slot).copy_(tensor)
    if count != len(layout.slots):
        raise LayoutError(f"expected {len(layout.slots)} tensors for this bucket, got {count}")
    return out[: layout.total_bytes]


def bucket_checksum(tensors: Iterable[torch.Tensor]) -> str:
    """``"crc32:%08x"`` of the tensors' raw bytes in the given order, no padding.

    In slot order these are exactly the bytes of the bucket's flattened buffer,
    whichever format carries them, so the trainer computes it from its tensors and
    a receiver from its views. ``zlib.crc32`` releases the GIL over a CPU buffer;
    a CUDA tensor is copied to host first (one device-to-host copy of the bucket).
    """
    crc = 0
    for tensor in tensors:
        if tensor.numel():
            crc = zlib.crc32(raw_bytes(tensor).numpy().data, crc)
    return f"crc32:{crc:08x}"


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat ``uint8`` CPU tensor (a view when it is already contiguous on CPU)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8)


def _check_buffer(buffer: torch.Tensor, layout: BucketLayout, what: str) -> None:
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < layout.total_bytes:
        raise LayoutError(
            f"{what} must be 1-D uint8 of at least {layout.total_bytes} bytes, got {buffer.dtype} {list(buffer.shape)}"
        )
