"""What a bucket format is: how one bucket crosses the weight-update group.

A format holds both sides of one bucket's transfer, which must match broadcast
for broadcast, in order, on every rank: the trainer's :meth:`BucketFormat.post_send`
(rank 0) and each receiver's :meth:`BucketFormat.receive`. Buckets themselves
go in plan order; the receive loop and the sender own that order, the buffers
and the waits between buckets.

A receive holds every broadcast to the bytes announced for it. Over gloo each
broadcast lands in a ``uint8`` view of its announced bytes plus
:data:`~router.dataplane.canary.RECEIVE_SLACK_BYTES`, guarded by canaries
(:mod:`router.dataplane.canary`), and a message of another length fails the
bucket with :class:`~router.dataplane.canary.ByteMismatch` while the group stays
usable; one longer than the slack still aborts the process inside gloo. Over
NCCL counts must match on every rank, so the receive posts exactly the announced
bytes and cannot see a mismatch (see :meth:`BucketFormat.receive`).
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

    @abstractmethod
    def receive_layout(self, layout: BucketLayout, slack: int = 0) -> BucketLayout:
        """Where each tensor lands in the receiver's buffer, with ``slack`` free bytes after each
        broadcast's announced bytes; its ``total_bytes`` is the buffer size a receive needs."""

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
        """A receiver: post and wait every broadcast of the bucket announced as ``layout`` into
        ``buffer``, laid out by ``receive_layout(layout, receive_slack(group))``.

        Raises :class:`~router.dataplane.group.GroupError` when a broadcast fails or
        times out (the group is broken), and, over gloo,
        :class:`~router.dataplane.canary.ByteMismatch` when every broadcast completed
        but one carried another byte count than announced (the group stays usable).

        Over NCCL nothing here can see a wrong byte count: NCCL does not frame its
        messages, and a broadcast whose count differs between ranks is undefined —
        usually a hang until the group's timeout (reported, and the group is marked
        broken), possibly wrong bytes with no error at all. Against that, a
        hand-written SGLang-style trainer is protected only by what it sends besides
        the bytes: the metadata check before the receive (names, dtypes, shapes),
        and, in the two-phase protocol, the bucket's ``nbytes`` (checked at prepare)
        and ``checksum`` (checked after the receive, before the bucket is applied).
        One that sends no checksum (SGLang's own trainers send none) and broadcasts
        other bytes than it announced is not protected.
        """
