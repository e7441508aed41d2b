"""Trainer side of vLLM's weight-transfer API over a ``torch.distributed`` group.

The trainer is rank 0 of the group the workers joined through
``/init_weight_transfer_engine`` (join it with :class:`router.trainer.sender.TrainerWeightSender`).
Per sync it calls ``/start_weight_update``, then for each chunk of weights posts
``/update_weights`` with :func:`update_info` and, while that call is open, runs
:func:`send`; then ``/finish_weight_update``. Packed sends use vLLM's buffer
boundaries (:func:`router.contract.vllm.packed_chunks`), so a vLLM receiver and this
project's workers take the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from router.contract.budget import DEFAULT_RECEIVE_TIMEOUT_S
from router.contract.vllm import DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS, packed_chunks
from router.dataplane.buckets import dtype_name
from router.dataplane.group import WeightUpdateGroup

NamedTensors = Sequence[tuple[str, torch.Tensor]]


def update_info(
    named: NamedTensors,
    *,
    packed: bool = False,
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
) -> dict[str, Any]:
    """The ``update_info`` announcing ``named`` (in the order :func:`send` sends them)."""
    return {
        "names": [name for name, _ in named],
        "dtype_names": [dtype_name(t.dtype) for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
        "packed": packed,
        "packed_buffer_size_bytes": packed_buffer_size_bytes,
        "packed_num_buffers": packed_num_buffers,
    }


def send(
    group: WeightUpdateGroup,
    named: NamedTensors,
    *,
    packed: bool = False,
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    timeout_s: float = DEFAULT_RECEIVE_TIMEOUT_S,
) -> int:
    """Broadcast ``named`` as rank 0: one buffer per packed chunk, or one broadcast per tensor.
    Returns the number of broadcasts."""
    if packed:
        # One buffer is built at a time, so at most one chunk's copy is held.
        flat = [t.detach().contiguous().view(torch.uint8).reshape(-1) for _, t in named]
        chunks = packed_chunks([f.numel() for f in flat], packed_buffer_size_bytes)
        for r in chunks:
            group.broadcast(torch.cat([flat[i] for i in r]), timeout_s)
        return len(chunks)
    for _, tensor in named:
        group.broadcast(tensor.detach().contiguous(), timeout_s)
    return len(named)
