"""The flattened-bucket byte layout, shared by the sender and every receiver.

A flattened bucket is one ``uint8`` buffer holding the raw bytes of several
tensors concatenated in list order with **no padding** — the layout SGLang's
``FlattenedTensorBucket`` uses, so a slime/miles trainer and this project's
workers agree on every byte. Tensor ``i`` starts at the sum of the byte sizes
of tensors ``0..i-1``.

Because there is no padding, a tensor can land at an offset that is not a
multiple of its element size (a ``bfloat16`` of odd element count followed by
a ``float32``). Such a slice cannot be reinterpreted as its dtype without a
copy; SGLang v0.5.23 raises "Unaligned received tensor" in the middle of a
receive. Here the check runs when the metadata is validated, before anything
is received, and the sender avoids the case altogether: :func:`aligned_order`
places larger element sizes first, and since every element size is a power of
two, each offset is then a multiple of every element size that follows it.

This module never imports torch; the router and the trainer client use it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

#: Element size in bytes of every dtype a weight update may carry. Names are
#: torch's without the ``torch.`` prefix, as trainers send them.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


class LayoutError(ValueError):
    """Bucket metadata that cannot describe a valid flattened buffer."""


def normalize_dtype_name(name: str) -> str:
    """``"torch.bfloat16"`` → ``"bfloat16"``; unknown names raise :class:`LayoutError`."""
    short = name[len("torch.") :] if name.startswith("torch.") else name
    if short not in DTYPE_ITEMSIZE:
        raise LayoutError(f"unsupported dtype {name!r}; expected one of {sorted(DTYPE_ITEMSIZE)}")
    return short


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Where one tensor lives inside a flattened bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def numel(self) -> int:
        return self.nbytes // self.itemsize

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    @property
    def aligned(self) -> bool:
        return self.offset % self.itemsize == 0


@dataclass(frozen=True, slots=True)
class BucketLayout:
    """The ordered slots of one bucket and its total size in bytes."""

    slots: tuple[TensorSlot, ...]
    total_bytes: int

    @classmethod
    def from_meta(
        cls,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        require_aligned: bool = True,
    ) -> BucketLayout:
        """Lay the tensors out back to back in list order.

        Raises :class:`LayoutError` when the three lists differ in length, a
        dtype is unknown, a dimension is negative, a name repeats, or (with
        ``require_aligned``) a tensor would start at an offset that is not a
        multiple of its element size.
        """
        if not (len(names) == len(dtypes) == len(shapes)):
            raise LayoutError(
                f"names, dtypes and shapes must have equal lengths, got {len(names)}, {len(dtypes)} and {len(shapes)}"
            )
        slots: list[TensorSlot] = []
        seen: set[str] = set()
        offset = 0
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            if name in seen:
                raise LayoutError(f"tensor {name!r} appears twice in one bucket")
            seen.add(name)
            dims = tuple(int(d) for d in shape)
            if any(d < 0 for d in dims):
                raise LayoutError(f"tensor {name!r} has a negative dimension in shape {list(dims)}")
            short = normalize_dtype_name(dtype)
            nbytes = _numel(dims) * DTYPE_ITEMSIZE[short]
            slots.append(TensorSlot(name=name, dtype=short, shape=dims, offset=offset, nbytes=nbytes))
            offset += nbytes
        layout = cls(slots=tuple(slots), total_bytes=offset)
        if require_aligned:
            layout.check_aligned()
        return layout

    def check_aligned(self) -> None:
        """Raise :class:`LayoutError` naming the first tensor whose offset is unaligned."""
        for slot in self.slots:
            if not slot.aligned:
                raise LayoutError(
                    f"unaligned tensor {slot.name!r} in flattened bucket: byte offset {slot.offset} is not a "
                    f"multiple of its {slot.dtype} element size {slot.itemsize}; order the bucket by "
                    "descending element size (or pad) so every offset is aligned"
                )

    def padded(self, gap: int = 0) -> BucketLayout:
        """The same tensors, each offset rounded up to a multiple of its element size, with
        ``gap`` free bytes after each tensor (``total_bytes`` includes the last one).

        A per-tensor receive writes each tensor on its own, so its buffer may pad
        where a flattened bucket (one contiguous message) cannot; the gap is its
        receive slack."""
        slots: list[TensorSlot] = []
        offset = 0
        for slot in self.slots:
            offset = -(-offset // slot.itemsize) * slot.itemsize
            slots.append(replace(slot, offset=offset))
            offset += slot.nbytes + gap
        return BucketLayout(slots=tuple(slots), total_bytes=offset)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]

    @property
    def dtypes(self) -> list[str]:
        return [s.dtype for s in self.slots]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(s.shape) for s in self.slots]

    def __len__(self) -> int:
        return len(self.slots)


def aligned_order(dtypes: Sequence[str]) -> list[int]:
    """Indices that sort tensors by descending element size, stable otherwise.

    Element sizes are powers of two, so laying tensors out in this order makes
    every offset a multiple of the element size of the tensor placed there.
    """
    sizes = [DTYPE_ITEMSIZE[normalize_dtype_name(d)] for d in dtypes]
    return sorted(range(len(sizes)), key=lambda i: -sizes[i])
