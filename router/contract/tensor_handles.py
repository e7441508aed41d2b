"""The project's JSON handle format for tensors that already sit in shared memory.

A colocated trainer does not send tensor bytes over HTTP: it writes them into a
shared buffer and sends only where they are. One message describes several
buckets; each bucket is ONE buffer (a POSIX shared-memory segment on the CPU, a
CUDA IPC allocation on a GPU) holding many tensors at byte offsets — the
flattened-bucket form of :mod:`router.contract.bucket_layout`; a single tensor
is a bucket of one::

    {"format": "omni-handles/v1",
     "buckets": [{"memory": {"kind": "cpu_shm", "name": "psm_1a2b", "size": 4096},
                  "tensors": [{"name": "model.norm.weight", "dtype": "float32",
                               "shape": [64], "offset": 0}]}]}

It is plain JSON on purpose: the receiver never unpickles anything to read it.
Everything checkable without opening the memory is checked here (known dtypes,
offsets aligned to the element size, every tensor inside its buffer, no two
tensors overlapping, bounded list sizes), so a receiver only checks the names
and shapes against its model and that the buffer really is as large as declared.

This module never imports torch; the router and the trainer client use it too.
"""

from __future__ import annotations

import base64
import binascii
import itertools
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from router.contract.bucket_layout import DTYPE_ITEMSIZE, LayoutError, normalize_dtype_name

FORMAT = "omni-handles/v1"
#: Bounds that keep one message's validation cheap (a model has far fewer tensors).
MAX_BUCKETS = 4096
MAX_TENSORS = 65_536
MAX_DIMS = 16
MAX_BYTES = 2**48
#: Base64 of a CUDA IPC handle is ~88 characters; this leaves room without admitting megabytes.
MAX_B64_CHARS = 1024


class _Strict(BaseModel):
    # Unknown fields are refused: a handle message is this project's own format, not SGLang's.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


def _check_b64(value: str) -> str:
    try:
        base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not valid base64") from None
    return value


B64 = Annotated[str, Field(min_length=1, max_length=MAX_B64_CHARS)]


class CpuShmMemory(_Strict):
    """A ``multiprocessing.shared_memory`` segment, opened by name (never created) by the receiver."""

    kind: Literal["cpu_shm"]
    name: Annotated[str, Field(pattern=r"^/?[A-Za-z0-9_.\-]{1,200}$")]
    size: Annotated[int, Field(ge=0, le=MAX_BYTES)]

    @property
    def capacity(self) -> int:
        return self.size


class CudaIpcMemory(_Strict):
    """The fields ``torch.UntypedStorage._share_cuda_()`` returns, base64 where they are bytes."""

    kind: Literal["cuda_ipc"]
    device: Annotated[int, Field(ge=0, le=1023)]
    handle: B64
    storage_size: Annotated[int, Field(ge=0, le=MAX_BYTES)]
    storage_offset: Annotated[int, Field(ge=0, le=MAX_BYTES)]
    ref_counter_handle: B64
    ref_counter_offset: Annotated[int, Field(ge=0, le=MAX_BYTES)]
    event_handle: B64 | None = None
    event_sync_required: bool = False

    @field_validator("handle", "ref_counter_handle", "event_handle")
    @classmethod
    def _b64(cls, value: str | None) -> str | None:
        return value if value is None else _check_b64(value)

    @property
    def capacity(self) -> int:
        return self.storage_size


class HandleTensor(_Strict):
    """One tensor of a bucket: contiguous, row-major, starting ``offset`` bytes into the buffer."""

    name: Annotated[str, Field(min_length=1, max_length=256)]
    dtype: Annotated[str, Field(max_length=32)]
    shape: Annotated[list[Annotated[int, Field(ge=0, le=MAX_BYTES)]], Field(max_length=MAX_DIMS)]
    offset: Annotated[int, Field(ge=0, le=MAX_BYTES)]

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        try:
            return normalize_dtype_name(value)
        except LayoutError as exc:
            raise ValueError(str(exc)) from None

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for dim in self.shape:
            n *= dim
        return n


class HandleBucket(_Strict):
    """One buffer and the tensors laid out in it."""

    memory: Annotated[CpuShmMemory | CudaIpcMemory, Field(discriminator="kind")]
    tensors: Annotated[list[HandleTensor], Field(min_length=1, max_length=MAX_TENSORS)]

    @model_validator(mode="after")
    def _fits(self) -> HandleBucket:
        capacity = self.memory.capacity
        spans = []
        for t in self.tensors:
            if t.offset % t.itemsize:
                raise ValueError(f"tensor {t.name!r}: offset {t.offset} is not a multiple of its {t.dtype} size")
            if t.offset + t.nbytes > capacity:
                raise ValueError(
                    f"tensor {t.name!r} ends at byte {t.offset + t.nbytes}, outside its {capacity}-byte buffer"
                )
            if t.nbytes:
                spans.append((t.offset, t.offset + t.nbytes, t.name))
        # Overlapping tensors would be legal to read but are always a sender bug: refuse them.
        spans.sort()
        for (_, end, name), (start, _, other) in itertools.pairwise(spans):
            if start < end:
                raise ValueError(f"tensors {name!r} and {other!r} overlap in the buffer")
        return self


class HandleMessage(_Strict):
    """A whole update's tensors: every name at most once over all buckets."""

    format: Literal["omni-handles/v1"]
    buckets: Annotated[list[HandleBucket], Field(min_length=1, max_length=MAX_BUCKETS)]

    @model_validator(mode="after")
    def _distinct(self) -> HandleMessage:
        seen: set[str] = set()
        total = 0
        for bucket in self.buckets:
            for t in bucket.tensors:
                if t.name in seen:
                    raise ValueError(f"tensor {t.name!r} appears twice in the message")
                seen.add(t.name)
                total += 1
        if total > MAX_TENSORS:
            raise ValueError(f"{total} tensors in one message; at most {MAX_TENSORS}")
        return self
