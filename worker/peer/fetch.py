"""The sink side: read a peer's snapshot stream into tensors, checked before anything is written.

Checks, in order, each failing with :class:`PeerTransferError` (the update then fails
with the weights intact, as nothing is written until the stream has been read whole):

1. the header parses as safetensors (bounded size), its offsets tile the buffer, and the
   announced length (``Content-Length``) equals header + buffer;
2. the source serves the expected ``weight_version``, when one is expected;
3. every tensor's name, dtype and shape fit this worker's model, and every tensor is there
   (:class:`PeerMismatch`: before a single tensor byte is read);
4. the bytes received equal the bytes announced (a source that ends early, is killed or is
   cut by an update gives a short read);
5. the checker's checksum over what was received equals the source's announced one and the
   expected one, when given.

Every read is bounded: the connection and each read by ``timeout_s`` (a silent source), the
whole transfer by the caller's bound. Memory: one host copy of the weights.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import torch
from pydantic import ValidationError

from router.contract.peer import (
    MAX_HEADER_BYTES,
    SNAPSHOT_PATH,
    SnapshotMetadata,
    SnapshotTensor,
    UpdateWeightsFromPeerRequest,
)
from router.dataplane.buckets import NamedTensors
from worker.engine.model_worker import WeightUpdateError
from worker.model import WeightLoadError, rank_checksum, tensor_digest
from worker.peer.snapshot import TORCH_DTYPES

#: Bytes read from the socket per step into the tensor being filled.
READ_BYTES = 1024 * 1024

Validate = Callable[[NamedTensors], None]


class PeerTransferError(WeightUpdateError):
    """The peer's stream could not be loaded; nothing was written."""


class PeerMismatch(PeerTransferError):
    """The peer serves tensors that do not fit this model (names, dtypes or shapes)."""


@dataclass
class Receipt:
    """What a transfer learnt about its source, filled in as it goes (also when it fails)."""

    source_instance_id: str | None = None
    weight_version: str | None = None
    checksum: str | None = None
    bytes_received: int = 0
    tensors: NamedTensors = field(default_factory=list)


async def fetch_snapshot(
    req: UpdateWeightsFromPeerRequest, *, bearer: str | None, validate: Validate, receipt: Receipt
) -> Receipt:
    """Read ``req.source_url``'s snapshot into ``receipt.tensors``; see the module docstring for the checks."""
    url = req.source_url + SNAPSHOT_PATH
    headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=req.timeout_s, sock_read=req.timeout_s)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(url, headers=headers, allow_redirects=False) as resp,
        ):
            if resp.status != 200:
                text = (await resp.content.read(2048)).decode(errors="replace")
                raise PeerTransferError(f"the source answered {resp.status} to {SNAPSHOT_PATH}: {text}")
            await _read(resp, req, validate, receipt)
    except (aiohttp.ClientError, TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
        got = receipt.bytes_received
        raise PeerTransferError(
            f"reading the snapshot from {req.source_url} failed after {got} bytes: {type(exc).__name__}: {exc}"
        ) from None
    return receipt


async def _read(
    resp: aiohttp.ClientResponse, req: UpdateWeightsFromPeerRequest, validate: Validate, receipt: Receipt
) -> None:
    (length,) = struct.unpack("<Q", await resp.content.readexactly(8))
    if length > MAX_HEADER_BYTES:
        raise PeerTransferError(f"the snapshot header announces {length} bytes (at most {MAX_HEADER_BYTES})")
    metadata, entries = _parse_header(await resp.content.readexactly(length))
    receipt.source_instance_id = metadata.instance_id
    receipt.weight_version = metadata.weight_version
    nbytes = entries[-1][1].data_offsets[1] if entries else 0
    if resp.content_length is not None and resp.content_length != 8 + length + nbytes:
        raise PeerTransferError(
            f"the source announced {resp.content_length} bytes but its header describes {8 + length + nbytes}"
        )
    if req.weight_version is not None and metadata.weight_version != req.weight_version:
        raise PeerMismatch(
            f"the source serves weight_version {metadata.weight_version!r}, not the expected {req.weight_version!r}"
        )
    shapes = [(name, torch.empty(e.shape, dtype=TORCH_DTYPES[e.dtype], device="meta")) for name, e in entries]
    try:
        validate(shapes)
    except (WeightLoadError, WeightUpdateError) as exc:
        raise PeerMismatch(f"the source's tensors do not fit this model: {exc}") from None
    digests: dict[str, str] = {}
    for name, entry in entries:
        tensor = await _read_tensor(resp, entry, receipt)
        digests[name] = await asyncio.to_thread(tensor_digest, name, tensor)
        receipt.tensors.append((name, tensor))
    if await resp.content.read(1):
        raise PeerTransferError(f"the source sent more than the {nbytes} bytes its header announced")
    checksum = rank_checksum(digests)
    receipt.checksum = checksum
    if checksum != metadata.checksum:
        raise PeerTransferError(
            f"checksum mismatch: received {checksum}, the source announced {metadata.checksum}; nothing was loaded"
        )
    if req.checksum is not None and checksum != req.checksum:
        raise PeerTransferError(
            f"checksum mismatch: received {checksum}, the caller expected {req.checksum}; nothing was loaded"
        )


def _parse_header(raw: bytes) -> tuple[SnapshotMetadata, list[tuple[str, SnapshotTensor]]]:
    """The header's metadata and tensor entries in offset order, or :class:`PeerTransferError`."""
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise ValueError("the header is not a JSON object")
        metadata = SnapshotMetadata.model_validate(doc.pop("__metadata__", None))
        entries = [(str(name), SnapshotTensor.model_validate(entry)) for name, entry in doc.items()]
    except (ValueError, ValidationError) as exc:
        raise PeerTransferError(f"the snapshot header is not valid: {exc}") from None
    entries.sort(key=lambda item: item[1].data_offsets)
    offset = 0
    for name, entry in entries:
        begin, end = entry.data_offsets
        numel = 1
        for dim in entry.shape:
            numel *= dim
        size = numel * TORCH_DTYPES[entry.dtype].itemsize
        if begin != offset or end - begin != size:
            raise PeerTransferError(f"the snapshot header's offsets for {name!r} do not tile the buffer")
        offset = end
    return metadata, entries


async def _read_tensor(resp: aiohttp.ClientResponse, entry: SnapshotTensor, receipt: Receipt) -> torch.Tensor:
    begin, end = entry.data_offsets
    raw = torch.empty(end - begin, dtype=torch.uint8)
    view = raw.numpy().data
    filled = 0
    while filled < len(raw):
        data = await resp.content.read(min(READ_BYTES, len(raw) - filled))
        if not data:
            raise PeerTransferError(
                f"short read: the source ended the stream after {receipt.bytes_received} bytes of its snapshot"
            )
        view[filled : filled + len(data)] = data
        filled += len(data)
        receipt.bytes_received += len(data)
    return raw.view(TORCH_DTYPES[entry.dtype]).reshape(entry.shape)
