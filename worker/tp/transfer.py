"""Weight sync on a follower tensor-parallel rank: its own rank in the update group, its own receive.

Every TP rank is a rank of the trainer's weight-update group (at ``rank_offset +
tp_rank``, as SGLang's engines join), receives every bucket itself (the full
tensors) and keeps its shard when the bucket is applied. Rank 0's controller
drives the followers with the operations below, sent like every admin operation
(so they are ordered with forward steps); the state they share lives in this
process's :class:`FollowerTransfer`:

- ``join`` / ``destroy``: the follower's side of a group;
- ``start_receive``: a :class:`~worker.transfer.group.receiver.BucketReceiver` on its
  own thread (the follower keeps running forward steps meanwhile);
- ``apply_bucket`` (streaming): rank 0 applied bucket *i*; the follower waits,
  bounded, until its receiver delivered bucket *i*, verifies its announced
  checksum, writes its shard and lets the receiver reuse the buffer;
- ``apply_all`` (atomic, and SGLang's single-phase call): after its receive
  finished, verify and write every staged bucket in one step, with rollback;
- ``receive_outcome``, ``cancel_receive``: end states for complete and abort.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from router.contract.bucket_layout import BucketLayout
from router.dataplane.buckets import NamedTensors
from router.dataplane.formats import for_load_format
from router.dataplane.group import WeightUpdateGroup, init_weight_update_group
from worker.engine.results import Applied, OpResult, Received
from worker.engine.scheduler import Scheduler
from worker.engine.weight_ops import apply_atomic
from worker.transfer.group.receiver import BucketReceiver, ReceiveBuffers
from worker.transfer.validation import ChecksumMismatch, verify_bucket, verify_staged

log = logging.getLogger(__name__)


@dataclass
class FollowerTransfer:
    """This follower's groups and its receive in flight (one per process)."""

    groups: dict[str, WeightUpdateGroup] = field(default_factory=dict)
    receiver: BucketReceiver | None = None
    checksums: tuple[str | None, ...] = ()
    buffers: ReceiveBuffers = field(default_factory=ReceiveBuffers)
    _delivered: dict[int, tuple[NamedTensors, Future[Any]]] = field(default_factory=dict)
    _arrived: threading.Condition = field(default_factory=threading.Condition)

    def deliver(self, index: int, named: NamedTensors) -> Future[Any]:
        """The receiver's streaming hook: bucket ``index`` is here; its buffer is free once the future is done."""
        done: Future[Any] = Future()
        with self._arrived:
            self._delivered[index] = (named, done)
            self._arrived.notify_all()
        return done

    def take(self, index: int, wait_s: float) -> tuple[NamedTensors, Future[Any]]:
        deadline = time.monotonic() + wait_s
        with self._arrived:
            while index not in self._delivered:
                receiver = self.receiver
                if receiver is None:
                    raise RuntimeError("no receive is running on this rank")
                if receiver.state.finished and index not in self._delivered:
                    raise RuntimeError(f"this rank's receive ended ({receiver.state.value}: {receiver.error})")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"bucket {index + 1} did not arrive on this rank within {wait_s:.0f}s")
                self._arrived.wait(min(left, 0.2))
            return self._delivered.pop(index)

    def reset(self) -> None:
        with self._arrived:
            for _named, done in self._delivered.values():
                if not done.done():
                    done.set_result(0)
            self._delivered.clear()


_AGENT = FollowerTransfer()


def join(
    s: Scheduler,
    *,
    name: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
) -> OpResult[None]:
    if name in _AGENT.groups:
        return OpResult(False, f"group {name!r} already exists on this rank")
    _AGENT.groups[name] = init_weight_update_group(
        master_address=master_address,
        master_port=master_port,
        rank=rank,
        world_size=world_size,
        group_name=name,
        backend=backend,
        timeout_s=timeout_s,
    )
    return OpResult(True, f"joined group {name!r} as rank {rank}")


def destroy(s: Scheduler, *, name: str) -> OpResult[None]:
    group = _AGENT.groups.pop(name, None)
    if group is None:
        return OpResult(True, f"group {name!r} was not joined on this rank")
    receiver = _AGENT.receiver
    if receiver is not None and receiver.group is group:
        receiver.cancel("the weight-update group was destroyed")
    group.destroy()
    return OpResult(True, f"left group {name!r}")


def start_receive(
    s: Scheduler,
    *,
    group_name: str,
    layouts: Sequence[BucketLayout],
    load_format: str | None,
    atomic: bool,
    window_s: float,
    checksums: tuple[str | None, ...],
) -> OpResult[None]:
    group = _AGENT.groups.get(group_name)
    if group is None:
        return OpResult(False, f"group {group_name!r} is not joined on this rank")
    previous = _AGENT.receiver
    if previous is not None and not previous.state.finished:
        previous.cancel("a new weight update started")
    _AGENT.reset()
    receiver = BucketReceiver(
        group,
        layouts,
        fmt=for_load_format(load_format),
        apply=None if atomic else _AGENT.deliver,
        device=s.worker.device,
        buffers=_AGENT.buffers,
    )
    _AGENT.receiver, _AGENT.checksums = receiver, checksums
    receiver.start(window_s)
    return OpResult(True, "receiving")


def apply_bucket(s: Scheduler, *, index: int, wait_s: float) -> OpResult[Applied]:
    """Streaming: write this rank's shard of bucket ``index`` once this rank received it."""
    named, done = _AGENT.take(index, wait_s)
    try:
        verify_bucket(_AGENT.checksums[index] if index < len(_AGENT.checksums) else None, named)
        count = s.worker.apply_streamed(named)
    except Exception as exc:
        done.set_exception(exc)
        return OpResult(False, f"bucket {index + 1} not applied on this rank: {exc}", Applied("partial"))
    done.set_result(count)
    return OpResult(True, "", Applied("updated", count=count))


def apply_given(s: Scheduler, *, named: NamedTensors) -> OpResult[Applied]:
    """Streaming: write this rank's shard of full tensors rank 0 handed over (a shared-memory update)."""
    try:
        count = s.worker.apply_streamed(named)
    except Exception as exc:
        return OpResult(False, f"tensors not applied on this rank: {exc}", Applied("partial"))
    return OpResult(True, "", Applied("updated", count=count))


def apply_all(s: Scheduler, *, abort_all: bool, require_complete: bool, wait_s: float) -> OpResult[Applied]:
    """Atomic: once this rank's receive finished, verify and write every staged bucket in one step."""
    receiver = _AGENT.receiver
    if receiver is None:
        return OpResult(False, "no receive ran on this rank", Applied("intact"))
    outcome = receiver.wait(wait_s)
    if not outcome.ok:
        return OpResult(False, f"this rank's receive failed: {outcome.error}", Applied("intact"))
    try:
        staged = receiver.staged()
        verify_staged(staged, _AGENT.checksums)
        return apply_atomic(
            s, [t for _, named in staged for t in named], abort_all=abort_all, require_complete=require_complete
        )
    except ChecksumMismatch as exc:
        return OpResult(False, str(exc), Applied("intact"))
    finally:
        receiver.release()


def receive_outcome(s: Scheduler, *, wait_s: float) -> OpResult[Received]:
    receiver = _AGENT.receiver
    if receiver is None:
        return OpResult(False, "no receive ran on this rank")
    outcome = receiver.wait(wait_s)
    return OpResult(outcome.ok, outcome.error or "", Received(outcome.buckets_received))


def cancel_receive(s: Scheduler, *, reason: str, broken_reason: str | None = None) -> OpResult[None]:
    receiver = _AGENT.receiver
    if receiver is not None:
        receiver.cancel(reason, broken_reason=broken_reason)
        receiver.release()
    _AGENT.reset()
    return OpResult(True, "")
