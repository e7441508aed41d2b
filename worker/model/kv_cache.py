"""Per-sequence key/value cache."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of one sequence for every layer.

    Storage is ``[layers, kv_heads, capacity, head_dim]`` and grows by doubling,
    so a sequence never needs its final length up front. ``length`` counts the
    positions already written; the model appends after it.
    """

    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, capacity: int, *, dtype: torch.dtype, device: torch.device
    ):
        capacity = max(1, capacity)
        self.keys = torch.empty(layers, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def reserve(self, total: int) -> None:
        """Make room for ``total`` positions, keeping what is written."""
        if total <= self.capacity:
            return
        new_cap = max(total, 2 * self.capacity)
        shape = (*self.keys.shape[:2], new_cap, self.keys.shape[3])
        keys = self.keys.new_empty(shape)
        values = self.values.new_empty(shape)
        keys[:, :, : self.length] = self.keys[:, :, : self.length]
        values[:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values = keys, values

    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()
