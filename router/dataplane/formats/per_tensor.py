"""``load_format=None``: one broadcast per tensor, in the bucket's list order (SGLang's default).

Each tensor is sent from its own storage, so nothing is packed on the sender;
the receiver posts every broadcast of the bucket first and then waits
(SGLang's pattern), into views of one buffer laid out with each tensor aligned.
Over gloo every tensor's view is ``uint8`` and has its own slack and canaries
(:mod:`router.dataplane.canary`): one broadcast each, so each can be short or long
on its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
import torch.distributed as dist

from router.contract.bucket_layout import BucketLayout
from router.dataplane import canary
from router.dataplane.buckets import dtype_name, slot_view
from router.dataplane.formats.base import BucketFormat, Remaining
from router.dataplane.group import WeightUpdateGroup


class PerTensor(BucketFormat):
    name: ClassVar[str] = "per_tensor"
    load_format: ClassVar[str | None] = None
    requires_aligned: ClassVar[bool] = False
    packs: ClassVar[bool] = False

    def receive_layout(self, layout: BucketLayout, slack: int = 0) -> BucketLayout:
        # Each tensor arrives on its own: pad so that every view starts aligned, each with its own slack.
        return layout.padded(gap=slack)

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
        slack = canary.receive_slack(group)
        landing = self.receive_layout(layout, slack)
        if not slack:  # NCCL: exact counts on every rank, nothing to guard with
            works = [group.broadcast_async(slot_view(buffer, slot)) for slot in landing.slots]
            for work in works:
                group.wait(work, remaining())
            return
        sequence = canary.sequence_for(group)
        posted = []
        for slot in landing.slots:
            view = buffer[slot.offset : slot.end + slack]
            armed = canary.arm(view, slot.nbytes, sequence.next())
            posted.append((slot.name, view, armed, group.broadcast_async(view)))
        for _, _, _, work in posted:
            group.wait(work, remaining())
        problems = [(name, v) for name, view, armed, _ in posted if (v := canary.check(view, armed)) is not None]
        if problems:
            raise canary.ByteMismatch(problems)
