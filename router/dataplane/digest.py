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


#: PEFT's prefix of an adapter's tensor names (a ``PeftModel`` wrapping the causal LM); optional in a saved adapter.
PEFT_PREFIX = "base_model.model."


def adapter_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The checksum of a LoRA adapter's ``lora_A`` / ``lora_B`` tensors named as PEFT saves them, in the
    scheme of :func:`rank_checksum`, each name without :data:`PEFT_PREFIX` (saved with it or not, the same
    adapter has one checksum): what an omni-worker reports of an adapter it loaded, and what a trainer
    computes from ``get_peft_model_state_dict`` or the saved ``adapter_model.safetensors``."""
    return rank_checksum({name: tensor_digest(name, t) for name, t in ((_unprefixed(n), t) for n, t in named)})


def _unprefixed(name: str) -> str:
    return name[len(PEFT_PREFIX) :] if name.startswith(PEFT_PREFIX) else name


def digest_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[dict[str, str], str]:
    """Per-tensor digests and the rank checksum of ``named``."""
    digests = {name: tensor_digest(name, tensor) for name, tensor in named}
    return digests, rank_checksum(digests)
