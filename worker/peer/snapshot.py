"""The source side: the worker's current weights as a safetensors stream.

Layout (safetensors): an 8-byte little-endian header length, the header JSON
(:class:`~router.contract.peer.SnapshotTensor` per tensor, ``__metadata__`` a
:class:`~router.contract.peer.SnapshotMetadata`), then every tensor's raw bytes in
header order. Tensors are the weights checker's checkpoint-named views, so the
metadata's ``checksum`` (the checker's rank checksum, computed in a first pass)
equals ``/weights_checker``'s and covers exactly the bytes that follow.

Invariants: the caller holds a read lease (:mod:`worker.peer.lease`) from
:func:`plan_snapshot` to the last chunk, so both passes read one version; each
chunk is copied out of the live tensor off the event loop and checked against the
lease's ``cut`` only after its copy, so a chunk that may have raced a write is never
sent. Memory: one chunk at a time (plus a whole copy of a tensor whose view is not
contiguous).
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from router.contract.peer import SnapshotMetadata, SnapshotTensor
from worker.model import rank_checksum, tensor_digest

#: torch dtype → safetensors dtype name (the dtypes a worker serves).
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
#: safetensors dtype name → torch dtype.
TORCH_DTYPES: dict[str, torch.dtype] = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
#: Bytes copied out of the weights per step: small enough that one copy never holds the event loop's
#: thread pool long, large enough that the per-chunk overhead is negligible.
CHUNK_BYTES = 4 * 1024 * 1024


class SnapshotCut(Exception):
    """An update took the weights back while the snapshot was being prepared or sent."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What one snapshot sends: the header bytes, then ``tensors`` in order (``nbytes`` after the header)."""

    header: bytes
    tensors: list[tuple[str, torch.Tensor]]
    nbytes: int
    checksum: str
    digests: dict[str, str]

    @property
    def content_length(self) -> int:
        return len(self.header) + self.nbytes


def plan_snapshot(
    views: Iterable[tuple[str, torch.Tensor]],
    *,
    weight_version: str,
    instance_id: str,
    cut: threading.Event,
    digests: dict[str, str] | None = None,
) -> Snapshot:
    """The header of the snapshot of ``views`` and its checksum (any thread). ``digests``: the per-tensor
    digests of these very weights, when known; else one read of every tensor computes them."""
    known = digests or {}
    tensors: list[tuple[str, torch.Tensor]] = []
    computed: dict[str, str] = {}
    entries: dict[str, dict[str, object]] = {}
    offset = 0
    for name, view in views:
        if cut.is_set():
            raise SnapshotCut("a weight update arrived while the snapshot was being prepared")
        if view.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: dtype {view.dtype} has no safetensors name")
        computed[name] = known.get(name) or tensor_digest(name, view)
        size = view.numel() * view.element_size()
        entry = SnapshotTensor(
            dtype=SAFETENSORS_DTYPES[view.dtype],  # type: ignore[arg-type]
            shape=list(view.shape),
            data_offsets=(offset, offset + size),
        )
        entries[name] = entry.model_dump(mode="json")
        tensors.append((name, view))
        offset += size
    checksum = rank_checksum(computed)
    metadata = SnapshotMetadata(weight_version=weight_version, instance_id=instance_id, checksum=checksum)
    doc = {"__metadata__": metadata.model_dump(mode="json"), **entries}
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes with spaces
    return Snapshot(struct.pack("<Q", len(text)) + text, tensors, offset, checksum, computed)


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a flat uint8 tensor (a view when it is contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def chunk_bounds(nbytes: int, chunk: int = CHUNK_BYTES) -> Iterator[tuple[int, int]]:
    for start in range(0, nbytes, chunk):
        yield start, min(start + chunk, nbytes)


def copy_chunk(flat: torch.Tensor, start: int, stop: int) -> bytes:
    """Bytes ``start:stop`` of ``flat``, copied to host memory (any thread)."""
    return flat[start:stop].cpu().numpy().tobytes()
