"""Loading a worker's weights from a live peer: the sink's request and answer, and the snapshot's layout.

A source worker serves ``GET /weights_snapshot``: its current weights in safetensors
layout (an 8-byte little-endian header length, the header JSON, then every tensor's raw
bytes back to back in header order). The header's ``__metadata__`` is
:class:`SnapshotMetadata`; each tensor entry is :class:`SnapshotTensor`. A sink worker
answers ``POST /update_weights_from_peer`` (:class:`UpdateWeightsFromPeerRequest`) by
reading that stream and loading it through its own update pipeline.

Invariants: ``checksum`` in the metadata is the weights checker's rank checksum over
exactly the bytes sent, so it equals the source's ``/weights_checker`` ``checksum``; the
tensor entries' ``data_offsets`` tile the byte buffer with no gap or overlap, so the
stream's length is known from its header alone.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from router.contract.admin import UpdateWeightsFromDiskResult
from router.contract.base import Label, WireRequest, canonical_worker_url
from router.contract.budget import DEFAULT_RECEIVE_TIMEOUT_S, MAX_TIMEOUT_S

#: The source's route (an admin route of the worker; its answer is a byte stream, not JSON).
SNAPSHOT_PATH = "/weights_snapshot"
#: The media type of the snapshot stream (safetensors has none registered).
SNAPSHOT_MEDIA_TYPE = "application/octet-stream"
#: The longest header a sink reads: names, dtypes, shapes and offsets of any model served here fit many times over.
MAX_HEADER_BYTES = 64 * 1024 * 1024
#: ``format`` in the metadata, as ``safetensors`` writes it for torch tensors.
SNAPSHOT_FORMAT = "pt"

#: A SHA256 hex digest (the checker's checksum).
Checksum = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
#: The safetensors dtype names of the dtypes a worker serves.
SnapshotDtype = Literal["F32", "BF16", "F16"]

# Hosts a peer URL may never point at: cloud metadata endpoints (the same list the router refuses as workers).


def check_peer_url(raw: str) -> str:
    """A source worker's base URL, canonical, under the router's rules for worker URLs; or ``ValueError``."""
    return canonical_worker_url(raw, "source_url")


class UpdateWeightsFromPeerRequest(WireRequest):
    """``POST /update_weights_from_peer``: load the weights a live peer serves (``GET /weights_snapshot``).

    ``weight_version`` and ``checksum``, when given, are what the caller expects the source to
    serve: a source serving another version is refused before anything is read past its header,
    and bytes whose checksum differs are never reported loaded. ``timeout_s`` bounds the whole
    transfer and every read in it."""

    source_url: Annotated[str, Field(min_length=1, max_length=2048)]
    weight_version: Label | None = None
    checksum: Checksum | None = None
    timeout_s: float = Field(DEFAULT_RECEIVE_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S)
    flush_cache: bool = True
    abort_all_requests: bool = False

    @field_validator("source_url")
    @classmethod
    def _peer_url(cls, value: str) -> str:
        return check_peer_url(value)


class UpdateWeightsFromPeerResult(UpdateWeightsFromDiskResult):
    """``/update_weights_from_disk``'s answer plus what was loaded: its ``checksum`` (verified before
    success is reported) and the source's ``source_instance_id``."""

    checksum: str | None = None
    source_instance_id: str | None = None
    bytes_received: int = 0


class SnapshotMetadata(BaseModel):
    """``__metadata__`` of a snapshot (safetensors allows only string values)."""

    model_config = ConfigDict(extra="allow")

    format: str = SNAPSHOT_FORMAT
    weight_version: str
    instance_id: str
    checksum: Checksum


class SnapshotTensor(BaseModel):
    """One tensor entry of a snapshot header."""

    model_config = ConfigDict(extra="forbid")

    dtype: SnapshotDtype
    shape: list[Annotated[int, Field(ge=0)]]
    data_offsets: tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)]]
