"""Strict weight digests (the weights checker's scheme).

``tensor_digest`` hashes a tensor's name, dtype, shape and raw bytes;
``rank_checksum`` hashes the sorted ``(name, digest)`` pairs of one rank. The
worker computes them over its checkpoint-named views and a trainer computes
them over the tensors it sent, so equal checksums mean bit-identical weights.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


def tensor_digest(name: str, tensor: torch.Tensor) -> str:
    h = hashlib.sha256()
    h.update(name.encode())
    h.update(str(tensor.dtype).encode())
    h.update(str(tuple(tensor.shape)).encode())
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    h.update(raw.numpy().data)
    return h.hexdigest()


def rank_checksum(digests: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name, digest in sorted(digests.items()):
        h.update(name.encode())
        h.update(digest.encode())
    return h.hexdigest()


def digest_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[dict[str, str], str]:
    """Per-tensor digests and the rank checksum of ``named``."""
    digests = {name: tensor_digest(name, tensor) for name, tensor in named}
    return digests, rank_checksum(digests)
