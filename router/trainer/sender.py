"""Trainer side of the data plane: plan buckets once, join the group as rank 0, broadcast.

A trainer imports it from :mod:`router.trainer` (it needs torch)::

    plan = BucketPlan.from_named_tensors(model.named_parameters())   # once per model
    sender = TrainerWeightSender(master_port=port, world_size=1 + n_worker_ranks)
    client.sync_weights(buckets=plan.metadata(tensors), broadcast=lambda i: sender.send_bucket(plan, i, tensors), ...)

The sync driver (:mod:`router.trainer.driver`) orders the HTTP calls; this
module only joins, sends and leaves.

Cross-rank contract: every receiver issues the same broadcasts in the same
order as :meth:`TrainerWeightSender.send` — buckets in plan order; per tensor
in bucket order (``load_format=None``) or one ``uint8`` buffer per bucket laid
out by ``BucketLayout`` (``"flattened_bucket"``). The plan orders each bucket
by descending element size, so every flattened offset is aligned and a
receiver never rejects it (SGLang v0.5.23's "Unaligned received tensor").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from router.contract.bucket_layout import BucketLayout, aligned_order
from router.contract.budget import DEFAULT_GROUP_TIMEOUT_S
from router.contract.weight_sync import (
    DEFAULT_GROUP_NAME,
    BucketMetadata,
    InitWeightsUpdateGroupRequest,
    PrepareWeightsUpdateRequest,
)
from router.dataplane.buckets import allocate_bytes, bucket_checksum, dtype_name
from router.dataplane.digest import digest_named_tensors
from router.dataplane.formats import for_load_format
from router.dataplane.group import GroupError, WeightUpdateGroup, init_weight_update_group
from router.trainer.driver import GroupSpec

DEFAULT_BUCKET_BYTES = 1 << 30
Progress = Callable[[int, int, int], None]  # (buckets done, buckets total, bytes done)


@dataclass(frozen=True)
class BucketPlan:
    """A fixed split of a model's tensors into buckets, reused every step."""

    buckets: tuple[BucketLayout, ...]
    budget_bytes: int

    @classmethod
    def from_named_tensors(
        cls,
        named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        budget_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> BucketPlan:
        items = named.items() if isinstance(named, Mapping) else named
        return cls.from_spec(((n, dtype_name(t.dtype), tuple(t.shape)) for n, t in items), budget_bytes)

    @classmethod
    def from_spec(
        cls, spec: Iterable[tuple[str, str, Sequence[int]]], budget_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> BucketPlan:
        """Group ``(name, dtype, shape)`` entries in order until a bucket would exceed
        ``budget_bytes`` (a tensor larger than the budget gets a bucket of its own)."""
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        groups: list[list[tuple[str, str, list[int]]]] = []
        current: list[tuple[str, str, list[int]]] = []
        current_bytes = 0
        for name, dtype, shape in spec:
            nbytes = BucketLayout.from_meta([name], [dtype], [list(shape)]).total_bytes
            if current and current_bytes + nbytes > budget_bytes:
                groups.append(current)
                current, current_bytes = [], 0
            current.append((name, dtype, list(shape)))
            current_bytes += nbytes
        if current:
            groups.append(current)
        buckets = []
        for entries in groups:
            order = aligned_order([d for _, d, _ in entries])
            entries = [entries[i] for i in order]
            buckets.append(
                BucketLayout.from_meta([e[0] for e in entries], [e[1] for e in entries], [e[2] for e in entries])
            )
        return cls(buckets=tuple(buckets), budget_bytes=budget_bytes)

    @property
    def total_bytes(self) -> int:
        return sum(b.total_bytes for b in self.buckets)

    @property
    def num_tensors(self) -> int:
        return sum(len(b) for b in self.buckets)

    @property
    def max_bucket_bytes(self) -> int:
        return max((b.total_bytes for b in self.buckets), default=0)

    def bucket(self, index: int) -> BucketPlan:
        """A plan holding only bucket ``index`` (for callers that send bucket by bucket)."""
        return BucketPlan(buckets=(self.buckets[index],), budget_bytes=self.budget_bytes)

    def metadata(self, tensors: Mapping[str, torch.Tensor] | None = None) -> list[BucketMetadata]:
        """The ``buckets`` of a prepare request (what ``sync_weights(buckets=...)`` takes).

        With ``tensors`` (the ones about to be sent) each bucket also carries ``nbytes`` (what
        its tensors hold: a tensor that no longer fits the plan makes the prepare fail before
        anything is sent) and ``checksum`` (``zlib.crc32`` of its bytes in slot order, which every
        worker verifies before applying the bucket). That costs one pass over the tensors'
        bytes, plus a copy to host for CUDA tensors; pass them at every sync.
        """
        out = []
        for b in self.buckets:
            fields: dict[str, Any] = {}
            if tensors is not None:
                named = [tensors[name] for name in b.names]
                fields["nbytes"] = sum(t.numel() * t.element_size() for t in named)
                fields["checksum"] = bucket_checksum(named)
            out.append(BucketMetadata(names=b.names, dtypes=b.dtypes, shapes=b.shapes, **fields))
        return out

    def prepare_request(
        self,
        group_name: str = DEFAULT_GROUP_NAME,
        tensors: Mapping[str, torch.Tensor] | None = None,
        **fields: Any,
    ) -> PrepareWeightsUpdateRequest:
        """A ``/prepare_weights_update`` request for this plan (``fields``: load_format, weight_version,
        atomic, ...); with ``tensors``, its buckets carry their sizes and checksums (:meth:`metadata`)."""
        given = {k: v for k, v in fields.items() if v is not None}
        return PrepareWeightsUpdateRequest(
            num_buckets=len(self.buckets), buckets=self.metadata(tensors), group_name=group_name, **given
        )


@dataclass(frozen=True)
class SendStats:
    """What one :meth:`TrainerWeightSender.send` broadcast, and how long it took."""

    buckets: int
    tensors: int
    bytes: int
    elapsed_s: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.elapsed_s / 1e9 if self.elapsed_s > 0 else float("inf")


class TrainerWeightSender:
    """Rank 0 of one weight-update group: joins it, broadcasts planned buckets."""

    def __init__(
        self,
        *,
        master_port: int,
        world_size: int,
        master_address: str = "127.0.0.1",
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str | None = None,
        timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
        device: torch.device | str = "cpu",
        load_format: str | None = None,
    ):
        """``load_format``: how every send packs its buckets unless the send names another (the workers must be
        told the same: ``RouterClient.sync_weights(..., load_format=sender.load_format)``)."""
        self.load_format = load_format
        self.master_address = master_address
        self.master_port = master_port
        self.world_size = world_size
        self.group_name = group_name
        self.backend = backend
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        self.group: WeightUpdateGroup | None = None
        self._buffers: list[torch.Tensor] = []

    def group_spec(self, **options: Any) -> GroupSpec:
        """The group this sender hosts as rank 0, as :meth:`RouterClient.sync_weights` takes it: its address,
        name and timeout, joined with this sender (giving up at once when the router refuses the workers' side)
        and left with :meth:`close`. ``options``: :class:`GroupSpec`'s other fields (``backend``)."""
        cancel = threading.Event()

        def join(world_size: int) -> None:
            self.join(cancel, world_size=world_size)

        return GroupSpec(
            master_address=self.master_address,
            master_port=self.master_port,
            join=join,
            group_name=self.group_name,
            timeout_s=self.timeout_s,
            leave=self.close,
            cancel=cancel,
            **options,
        )

    def broadcaster(self, plan: BucketPlan, tensors: Mapping[str, torch.Tensor]) -> Callable[[int], None]:
        """The ``broadcast(i)`` callback of :meth:`RouterClient.sync_weights`: bucket ``i`` of ``plan``, sent
        in this sender's ``load_format``."""

        def broadcast(index: int) -> None:
            self.send_bucket(plan, index, tensors)

        return broadcast

    def init_request(self, rank_offset: int, **fields: Any) -> InitWeightsUpdateGroupRequest:
        """An ``/init_weights_update_group`` request for the worker whose first rank is ``rank_offset``."""
        given: dict[str, Any] = {"world_size": self.world_size, "timeout_s": self.timeout_s, **fields}
        if self.backend is not None:
            given.setdefault("backend", self.backend)
        return InitWeightsUpdateGroupRequest(
            master_address=self.master_address,
            master_port=self.master_port,
            rank_offset=rank_offset,
            group_name=self.group_name,
            **given,
        )

    # -- group lifecycle -----------------------------------------------------------------------

    def join(self, cancel: threading.Event | None = None, *, world_size: int | None = None) -> WeightUpdateGroup:
        """Host the rendezvous and join as rank 0 (blocks until every rank arrives, or
        until ``cancel`` is set: then :class:`GroupError` at once, e.g. when the router
        refused the workers' side of the init; ``GroupSpec.cancel`` is such an event).

        ``world_size`` replaces the one given at construction: a group rebuilt after the
        fleet grew or shrank has another (``GroupSpec.join`` receives it)."""
        if self.group is not None and self.group.pg is not None:
            raise GroupError(f"already joined group {self.group_name!r}; call close() first")
        if world_size is not None:
            self.world_size = world_size
        self.group = init_weight_update_group(
            master_address=self.master_address,
            master_port=self.master_port,
            rank=0,
            world_size=self.world_size,
            group_name=self.group_name,
            backend=self.backend,
            timeout_s=self.timeout_s,
            cancel=cancel,
        )
        return self.group

    def close(self) -> None:
        """Leave the group (idempotent); pair with ``/destroy_weights_update_group`` on the workers."""
        if self.group is not None:
            self.group.destroy()
        self._buffers = []

    # -- sending -------------------------------------------------------------------------------

    def send(
        self,
        plan: BucketPlan,
        tensors: Mapping[str, torch.Tensor],
        *,
        load_format: str | None = None,
        progress: Progress | None = None,
    ) -> SendStats:
        """Broadcast every bucket of ``plan`` (blocking until all have left).

        At most two buckets are in flight: bucket ``i`` is posted once bucket ``i - 2``
        has left, so a packing format reuses two staging buffers.
        """
        group = self._require_group()
        fmt = for_load_format(load_format if load_format is not None else self.load_format)
        started = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        if fmt.packs:
            self._ensure_buffers(plan.max_bucket_bytes, min(2, len(plan.buckets)))
        in_flight: dict[int, list[dist.Work]] = {}
        done_bytes = 0
        for index, layout in enumerate(plan.buckets):
            for work in in_flight.pop(index - 2, []):
                group.wait(work, deadline - time.monotonic())
            buffer = self._buffers[index % 2] if fmt.packs else None
            in_flight[index] = fmt.post_send(group, layout, tensors, buffer)
            done_bytes += layout.total_bytes
            if progress is not None:
                progress(index + 1, len(plan.buckets), done_bytes)
        for index in sorted(in_flight):
            for work in in_flight[index]:
                group.wait(work, deadline - time.monotonic())
        return SendStats(len(plan.buckets), plan.num_tensors, plan.total_bytes, time.perf_counter() - started)

    def send_bucket(
        self, plan: BucketPlan, index: int, tensors: Mapping[str, torch.Tensor], *, load_format: str | None = None
    ) -> SendStats:
        """Broadcast bucket ``index`` of ``plan`` alone: the ``broadcast(i)`` callback that
        :meth:`router.trainer.RouterClient.sync_weights` expects."""
        return self.send(plan.bucket(index), tensors, load_format=load_format)

    # -- helpers -------------------------------------------------------------------------------

    def _require_group(self) -> WeightUpdateGroup:
        if self.group is None:
            raise GroupError("not joined; call join() first")
        self.group.require_usable()
        return self.group

    def _ensure_buffers(self, nbytes: int, count: int) -> None:
        # Kept across steps: the plan is fixed, so the same two buffers serve every sync.
        if len(self._buffers) < count or any(b.numel() < nbytes for b in self._buffers):
            self._buffers = [allocate_bytes(nbytes, self.device) for _ in range(count)]


def sent_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The per-rank checksum of ``named`` in the weights-checker scheme: what every
    worker reports once it holds exactly these tensors."""
    return digest_named_tensors(named)[1]
