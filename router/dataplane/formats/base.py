"""What a bucket format is: how one bucket crosses the weight-update group.

A format holds both sides of one bucket's transfer, which must match broadcast
for broadcast, in order, on every rank: the trainer's :meth:`BucketFormat.post_send`
(rank 0) and each receiver's :meth:`BucketFormat.receive`. Buckets themselves
go in plan order; the receive loop and the sender own that order, the buffers
and the waits between buckets.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import ClassVar

import torch
import torch.distributed as dist

from router.contract.bucket_layout import BucketLayout
from router.dataplane.group import WeightUpdateGroup

#: Seconds left before the update's deadline (raises once it has passed or the receive was cancelled).
Remaining = Callable[[], float]


class BucketFormat(ABC):
    """One way to move a bucket's tensors from the trainer to every receiver."""

    name: ClassVar[str]
    """The registry key."""
    load_format: ClassVar[str | None]
    """The value of the ``load_format`` field that selects this format on the wire."""
    requires_aligned: ClassVar[bool]
    """Every tensor must start at a multiple of its element size within the bucket's bytes."""
    packs: ClassVar[bool]
    """The sender copies a bucket into a staging buffer of ``layout.total_bytes`` before sending it."""

    def receive_layout(self, layout: BucketLayout) -> BucketLayout:
        """Where each tensor lands in the receiver's buffer (the bucket's own layout unless the format may pad)."""
        return layout

    @abstractmethod
    def post_send(
        self,
        group: WeightUpdateGroup,
        layout: BucketLayout,
        tensors: Mapping[str, torch.Tensor],
        buffer: torch.Tensor | None,
    ) -> list[dist.Work]:
        """Rank 0: post every broadcast of one bucket; the caller waits for the returned work."""

    @abstractmethod
    def receive(
        self, group: WeightUpdateGroup, layout: BucketLayout, buffer: torch.Tensor, remaining: Remaining
    ) -> None:
        """A receiver: post and wait every broadcast of one bucket into ``buffer`` (laid out by :meth:`receive_layout`)."""
