"""Which token rows of a ragged batch use which adapter.

The forward pass concatenates the new tokens of every sequence; each sequence
names its adapter or none (the base model). Rows are grouped by adapter, and
each projection adds one group's update at a time, from that group's rows only:
a base-model row is never touched, and a row's update depends only on its own
input and its adapter, as the base projections do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.model.lora.loaded import LoadedLora, Projection


class LoraBatch:
    """The adapters of one ragged batch and their token rows."""

    def __init__(self, groups: Sequence[tuple[LoadedLora, slice | torch.Tensor]]):
        self.groups = tuple(groups)

    @classmethod
    def of(
        cls, adapters: Sequence[LoadedLora | None], lengths: Sequence[int], device: torch.device
    ) -> LoraBatch | None:
        """The groups of a batch whose sequence ``i`` has ``lengths[i]`` new tokens and uses ``adapters[i]``;
        None when every sequence uses the base model (nothing to add)."""
        spans: dict[int, tuple[LoadedLora, list[tuple[int, int]]]] = {}
        start = 0
        for adapter, n in zip(adapters, lengths, strict=True):
            if adapter is not None:
                runs = spans.setdefault(id(adapter), (adapter, []))[1]
                if runs and runs[-1][1] == start:
                    runs[-1] = (runs[-1][0], start + n)
                else:
                    runs.append((start, start + n))
            start += n
        if not spans:
            return None
        return cls([(adapter, _rows(runs, device)) for adapter, runs in spans.values()])

    def add(self, layer: int, projection: Projection, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add every adapter's update of ``projection`` in ``layer`` (input ``x``) to its rows of ``out``."""
        for adapter, rows in self.groups:
            update = adapter.layers[layer].get(projection)
            if update is not None:
                update.add_to(out, x, rows)


def _rows(runs: list[tuple[int, int]], device: torch.device) -> slice | torch.Tensor:
    # One run (the usual case: one sequence, or neighbours) is a slice: its rows are updated in place.
    if len(runs) == 1:
        return slice(*runs[0])
    return torch.cat([torch.arange(a, b, device=device) for a, b in runs])
