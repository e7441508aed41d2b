"""``load_format=None``: one broadcast per tensor, in the bucket's list order (SGLang's default).

Each tensor is sent from its own storage, so nothing is packed on the sender;
the receiver posts every broadcast of the bucket first and then waits
(SGLang's pattern), into views of one buffer laid out with each tensor aligned.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
import torch.distributed as dist

from router.contract.bucket_layout import BucketLayout
from router.dataplane.buckets import dtype_name, slot_view
from router.dataplane.formats.base import BucketFormat, Remaining
from router.dataplane.group import WeightUpdateGroup


class PerTensor(BucketFormat):
    name: ClassVar[str] = "per_tensor"
    load_format: ClassVar[str | None] = None
    requires_aligned: ClassVar[bool] = False
    packs: ClassVar[bool] = False

    def receive_layout(self, layout: BucketLayout) -> BucketLayout:
        # Each tensor arrives on its own: pad so that every view starts aligned.
        return layout.padded()

    def post_send(
        self,
        group: WeightUpdateGroup,
        layout: BucketLayout,
        tensors: Mapping[str, torch.Tensor],
        buffer: torch.Tensor | None,
    ) -> list[dist.Work]:
        works = []
        for slot in layout.slots:
            tensor = tensors[slot.name]
            if dtype_name(tensor.dtype) != slot.dtype or tuple(tensor.shape) != slot.shape:
                raise ValueError(
                    f"tensor {slot.name!r} is {tensor.dtype} {list(tensor.shape)}, the plan says {slot.dtype} {list(slot.shape)}"
                )
            works.append(group.broadcast_async(tensor.contiguous()))
        return works

    def receive(
        self, group: WeightUpdateGroup, layout: BucketLayout, buffer: torch.Tensor, remaining: Remaining
    ) -> None:
        works = [group.broadcast_async(slot_view(buffer, slot)) for slot in layout.slots]
        for work in works:
            group.wait(work, remaining())
