"""The receive loop: one background thread per weight update, as a state machine.

::

    STARTING ──► RECEIVING ──► DRAINING ──► DONE        (streaming: every bucket applied)
                     │             │
                     │             └──────► FAILED      (an apply failed or timed out, or a bucket's
                     │                                   bytes did not match what was announced)
                     ├────────────────────► STAGED      (atomic: every bucket held, none applied)
                     └────────────────────► FAILED      (a broadcast failed or timed out, or cancel();
                                                         atomic: a bucket's bytes did not match)

Wire contract (must match the sender broadcast for broadcast, in lockstep):
buckets are received in order; within a bucket, the bucket format
(:mod:`router.dataplane.formats`) issues the same broadcasts as the sender's.

Streaming mode is double-buffered: bucket ``i`` is received into buffer
``i % 2`` while bucket ``i - 1`` is applied elsewhere (the worker runs the
apply on its scheduler thread); buffer ``i % 2`` is reused only once the apply
of bucket ``i - 2`` has finished, so an apply must not keep references to the
tensors it was given. Atomic mode keeps one buffer per bucket and applies
nothing; the caller applies :meth:`BucketReceiver.staged` at complete time.

Every wait is bounded by one deadline (``timeout_s`` from :meth:`start`). A
broadcast that fails or runs past it marks the group broken (sender and
receiver are out of lockstep). An apply that fails does not stop the loop: it
keeps receiving into a scratch buffer, so the trainer's broadcasts finish and
the group stays usable, and reports the apply error at the end. A bucket that
arrives with another byte count than announced (the format raises
:class:`~router.dataplane.canary.ByteMismatch`; over gloo only) is handled the
same way: both sides completed the same broadcasts, so the group is still in
lockstep; the bucket and every later one are neither applied nor staged.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

from router.contract.bucket_layout import BucketLayout
from router.dataplane.buckets import NamedTensors, allocate, allocate_bytes, unpack
from router.dataplane.canary import ByteMismatch, receive_slack
from router.dataplane.formats import BucketFormat
from router.dataplane.group import GroupError, WeightUpdateGroup
from worker.transfer.validation import ChecksumMismatch

log = logging.getLogger(__name__)
#: Submit the apply of bucket ``index`` elsewhere; the future resolves when it has run.
ApplyFn = Callable[[int, NamedTensors], "Future[object]"]


class ReceiveState(enum.StrEnum):
    """The receive loop's states (diagram in the module docstring)."""

    STARTING = "starting"
    RECEIVING = "receiving"
    DRAINING = "draining"
    STAGED = "staged"
    DONE = "done"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (ReceiveState.STAGED, ReceiveState.DONE, ReceiveState.FAILED)


@dataclass(frozen=True, slots=True)
class ReceiveOutcome:
    """What a receive achieved; ``ok`` means every bucket arrived (and, streaming, was applied)."""

    state: ReceiveState
    buckets_expected: int
    buckets_received: int
    buckets_applied: int
    bytes_received: int
    elapsed_s: float
    error: str | None

    @property
    def ok(self) -> bool:
        return self.state in (ReceiveState.DONE, ReceiveState.STAGED)


class BucketReceiver:
    """Receives one planned update from rank 0 of ``group`` on a background thread.

    Args:
        group: the joined weight-update group.
        buckets: the validated layouts, in broadcast order.
        fmt: how each bucket crosses the group.
        apply: streaming mode's apply hook; ``None`` selects atomic mode.
        device: where received tensors live.
        buffers: streaming mode's double buffers, reused across updates when given.
    """

    def __init__(
        self,
        group: WeightUpdateGroup,
        buckets: Sequence[BucketLayout],
        *,
        fmt: BucketFormat,
        apply: ApplyFn | None,
        device: torch.device | str = "cpu",
        buffers: ReceiveBuffers | None = None,
    ):
        self.group = group
        self.buckets = list(buckets)
        self.fmt = fmt
        # Where each tensor lands in the receive buffer (a per-tensor receive pads for alignment;
        # over gloo every broadcast has its slack after it).
        self._landing = [fmt.receive_layout(layout, receive_slack(group)) for layout in self.buckets]
        self.atomic = apply is None
        self._apply = apply
        self.device = torch.device(device)
        self._pool = buffers
        self.state = ReceiveState.STARTING
        self.buckets_received = 0
        self.buckets_applied = 0
        self.bytes_received = 0
        self.error: str | None = None
        self._lock = threading.Lock()
        self._running = threading.Event()
        self._finished = threading.Event()
        self._cancelled: str | None = None
        self._apply_overran = False
        self._staged: list[torch.Tensor] = []
        self._thread: threading.Thread | None = None
        self._started_at = 0.0
        self._ended_at: float | None = None
        self._deadline = 0.0

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout_s: float) -> None:
        """Start the loop; return once it is about to post its first receive.

        Raises :class:`GroupError` if the group is unusable (nothing starts).
        """
        if self._thread is not None:
            raise RuntimeError("a BucketReceiver runs once; create a new one per update")
        self.group.require_usable()
        self._started_at = time.monotonic()
        self._deadline = self._started_at + timeout_s
        self._thread = threading.Thread(target=self._run, name=f"weight-recv-{self.group.name}", daemon=True)
        self._thread.start()
        if not self._running.wait(timeout=min(timeout_s, 30.0)):
            self.cancel("the receive thread did not start")
            raise GroupError("the receive thread did not start")

    def wait(self, timeout_s: float) -> ReceiveOutcome:
        """Wait up to ``timeout_s`` for the loop to finish; if it has not, cancel it and fail."""
        if not self._finished.wait(timeout=max(timeout_s, 0.0)):
            self.cancel(
                f"receive still at bucket {self.buckets_received + 1}/{len(self.buckets)} after waiting {timeout_s:.1f}s"
            )
        return self.outcome()

    def cancel(self, reason: str, *, broken_reason: str | None = None) -> bool:
        """Fail the receive now; ``False`` if it had already finished.

        A broadcast already posted cannot be withdrawn, so the group is marked
        broken (with ``broken_reason`` when given); the thread exits at its next
        step or its deadline, and a bucket that still lands is dropped.
        """
        with self._lock:
            if self.state.finished:
                return False
            self._cancelled = reason
            self._fail_locked(reason)
            self._staged = []
        self.group.mark_broken(broken_reason or f"a weight update was cancelled: {reason}")
        return True

    def outcome(self) -> ReceiveOutcome:
        with self._lock:
            end = self._ended_at if self._ended_at is not None else time.monotonic()
            return ReceiveOutcome(
                state=self.state,
                buckets_expected=len(self.buckets),
                buckets_received=self.buckets_received,
                buckets_applied=self.buckets_applied,
                bytes_received=self.bytes_received,
                elapsed_s=end - self._started_at if self._started_at else 0.0,
                error=self.error,
            )

    def staged(self) -> list[tuple[int, NamedTensors]]:
        """Atomic mode: every received bucket as named views, once the state is STAGED."""
        if not self.atomic or self.state is not ReceiveState.STAGED:
            raise RuntimeError(f"nothing staged (atomic={self.atomic}, state={self.state.value})")
        return [
            (i, unpack(buf, layout)) for i, (buf, layout) in enumerate(zip(self._staged, self._landing, strict=True))
        ]

    def release(self) -> None:
        """Drop staged buffers (after they were applied or discarded)."""
        self._staged = []

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        sizes = [layout.total_bytes for layout in self._landing]
        biggest = max(sizes, default=0)
        count = 0 if self.atomic else min(2, len(sizes))
        pool = self._pool if self._pool is not None else ReceiveBuffers()
        buffers: list[torch.Tensor] = []
        pending: dict[int, Future[object]] = {}
        scratch: torch.Tensor | None = None
        failure: str | None = None  # the first failed apply or mismatched bucket: nothing is applied after it
        reusable = False  # set once no broadcast can still be writing into the buffers
        try:
            if self.device.type == "cuda":
                # A new thread starts on device 0: a rank on another GPU must issue its collectives there.
                torch.cuda.set_device(self.device)
            buffers = pool.lease(biggest, count, self.device)
            self._set_state(ReceiveState.RECEIVING)
            self._running.set()
            for index, layout in enumerate(self._landing):
                self._check_cancelled()
                if not self.atomic and failure is None:
                    previous = pending.pop(index - 2, None)
                    failure = self._settle(index - 2, previous) if previous is not None else None
                if failure is not None:
                    # Keep the trainer's broadcasts flowing; pending applies may still hold the double buffers.
                    if scratch is None:
                        scratch = allocate_bytes(biggest, self.device)
                    buffer = scratch
                else:
                    buffer = allocate(layout, self.device) if self.atomic else buffers[index % 2]
                try:
                    self._receive(buffer, index)
                except ByteMismatch as exc:  # every broadcast completed: the group is still in lockstep
                    failure = failure or exc.describe(f"bucket {index + 1}/{len(self.buckets)}")
                self._check_cancelled()  # a bucket that lands after cancel() is neither staged nor applied
                with self._lock:
                    self.buckets_received += 1
                    self.bytes_received += self.buckets[index].total_bytes
                if failure is not None:
                    continue
                if self.atomic:
                    self._staged.append(buffer)
                else:
                    pending[index] = self._apply(index, unpack(buffer, layout))  # type: ignore[misc]
            if self.atomic:
                reusable = True
                self._finish(ReceiveState.STAGED if failure is None else ReceiveState.FAILED, failure)
                return
            self._set_state(ReceiveState.DRAINING)
            for index in sorted(pending):
                err = self._settle(index, pending.pop(index))
                failure = failure or err
            reusable = not self._apply_overran
            self._finish(ReceiveState.DONE if failure is None else ReceiveState.FAILED, failure)
        except GroupError as exc:
            self._finish(
                ReceiveState.FAILED, f"receive failed at bucket {self.buckets_received + 1}/{len(self.buckets)}: {exc}"
            )
        except Exception as exc:  # keep the loop's contract: always end in a finished state
            log.exception("weight receive loop crashed")
            self.group.mark_broken(f"receive loop crashed: {exc}")
            self._finish(ReceiveState.FAILED, f"receive loop crashed: {type(exc).__name__}: {exc}")
        finally:
            # After a failed or abandoned broadcast torch may still complete it later (gloo
            # keeps it posted until its own timeout): such buffers are dropped, never reused.
            if reusable:
                pool.give_back(buffers)
            self._running.set()
            self._finished.set()

    def _receive(self, buffer: torch.Tensor, index: int) -> None:
        self.fmt.receive(self.group, self.buckets[index], buffer, lambda: self._remaining(index))
        if self.device.type == "cuda":
            # The apply runs on another thread (another stream): make the bytes visible first.
            torch.cuda.current_stream(self.device).synchronize()

    def _settle(self, index: int, future: Future[object]) -> str | None:
        """Wait for one apply; return its error text or ``None``."""
        try:
            future.result(timeout=max(self._deadline - time.monotonic(), 0.0))
        except FutureTimeout:
            self._apply_overran = True  # it may still read its buffer
            return f"applying bucket {index + 1} did not finish before the update's deadline"
        except ChecksumMismatch as exc:  # verified before the write: nothing of this bucket was applied
            return f"bucket {index + 1}/{len(self.buckets)} not applied: {exc}"
        except Exception as exc:
            return f"applying bucket {index + 1} failed: {exc}"
        with self._lock:
            self.buckets_applied += 1
        return None

    def _remaining(self, index: int) -> float:
        self._check_cancelled()
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise GroupError(f"the update's deadline passed before bucket {index + 1}/{len(self.buckets)} arrived")
        return remaining

    def _check_cancelled(self) -> None:
        if self._cancelled is not None:
            raise GroupError(f"cancelled: {self._cancelled}")

    # -- state ---------------------------------------------------------------------------------

    def _set_state(self, state: ReceiveState) -> None:
        with self._lock:
            if not self.state.finished:
                self.state = state

    def _finish(self, state: ReceiveState, error: str | None = None) -> None:
        with self._lock:
            if self.state.finished:  # cancel() got there first; keep its reason
                return
            if error is not None:
                self._fail_locked(error)
            else:
                self.state = state
                self._ended_at = time.monotonic()
        if state is ReceiveState.FAILED:
            self._staged = []

    def _fail_locked(self, error: str) -> None:
        self.state = ReceiveState.FAILED
        self.error = error
        self._ended_at = time.monotonic()


class ReceiveBuffers:
    """Streaming double buffers kept from one update to the next.

    The bucket plan is fixed per model, so every sync needs the same two
    buffers; allocating them afresh would make each update pay for new pages
    (large host allocations are fresh ``mmap`` s, zeroed by the kernel on first
    touch). A lease is exclusive: a receive thread still blocked in a cancelled
    broadcast keeps its buffers, and a later update gets new ones; buffers of a
    failed receive are never given back (a broadcast posted into them may still
    complete).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []

    def lease(self, nbytes: int, count: int, device: torch.device) -> list[torch.Tensor]:
        with self._lock:
            fits = [b for b in self._free if b.numel() >= nbytes and b.device == device]
            taken = fits[:count]
            self._free = [b for b in self._free if not any(b is t for t in taken)]
        return taken + [allocate_bytes(nbytes, device) for _ in range(count - len(taken))]

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            # Keep at most one double buffer: a model whose plan grew drops the old ones.
            self._free = sorted([*self._free, *buffers], key=lambda b: -b.numel())[:2]
