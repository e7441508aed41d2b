"""``load_format="flattened_bucket"``: one ``uint8`` broadcast per bucket (SGLang's ``FlattenedTensorBucket``).

The sender packs the bucket's tensors back to back into a staging buffer
(:func:`~router.dataplane.buckets.pack`, layout :class:`~router.contract.bucket_layout.BucketLayout`,
no padding) and sends it as one message; a receiver takes it into one buffer and
views the tensors out of it without a copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
import torch.distributed as dist

from router.contract.bucket_layout import BucketLayout
from router.dataplane.buckets import pack
from router.dataplane.formats.base import BucketFormat, Remaining
from router.dataplane.group import WeightUpdateGroup


class FlattenedBucket(BucketFormat):
    name: ClassVar[str] = "flattened_bucket"
    load_format: ClassVar[str | None] = "flattened_bucket"
    requires_aligned: ClassVar[bool] = True
    packs: ClassVar[bool] = True

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
        group.broadcast(buffer[: layout.total_bytes], remaining())
