"""``load_format="flattened_bucket"``: one ``uint8`` broadcast per bucket (SGLang's ``FlattenedTensorBucket``).

The sender packs the bucket's tensors back to back into a staging buffer
(:func:`~router.dataplane.buckets.pack`, layout :class:`~router.contract.bucket_layout.BucketLayout`,
no padding) and sends it as one message; a receiver takes it into one buffer and
views the tensors out of it without a copy. Over gloo that buffer has one slack
region after the bucket's bytes, guarded by one pair of canaries
(:mod:`router.dataplane.canary`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import ClassVar

import torch
import torch.distributed as dist

from router.contract.bucket_layout import BucketLayout
from router.dataplane import canary
from router.dataplane.buckets import pack
from router.dataplane.formats.base import BucketFormat, Remaining
from router.dataplane.group import WeightUpdateGroup


class FlattenedBucket(BucketFormat):
    name: ClassVar[str] = "flattened_bucket"
    load_format: ClassVar[str | None] = "flattened_bucket"
    requires_aligned: ClassVar[bool] = True
    packs: ClassVar[bool] = True

    def receive_layout(self, layout: BucketLayout, slack: int = 0) -> BucketLayout:
        # One message: the tensors where the sender packed them, the slack after the last one.
        return replace(layout, total_bytes=layout.total_bytes + slack)

    def post_send(
        self,
        group: WeightUpdateGroup,
        layout: BucketLayout,
        tensors: Mapping[str, torch.Tensor],
        buffer: torch.Tensor | None,
    ) -> list[dist.Work]:
        packed = pack(((name, tensors[name]) for name in layout.names), layout, out=buffer)
        return [group.broadcast_async(packed)]

    def receive(
        self, group: WeightUpdateGroup, layout: BucketLayout, buffer: torch.Tensor, remaining: Remaining
    ) -> None:
        nbytes, slack = layout.total_bytes, canary.receive_slack(group)
        if not slack:  # NCCL: exact counts on every rank, nothing to guard with
            group.broadcast(buffer[:nbytes], remaining())
            return
        view = buffer[: nbytes + slack]
        armed = canary.arm(view, nbytes, canary.sequence_for(group).next())
        group.broadcast(view, remaining())
        verdict = canary.check(view, armed)
        if verdict is not None:
            raise canary.ByteMismatch([(None, verdict)])
