"""Read leases: a snapshot being sent holds one, so what it sends is one version of the weights.

Place in the worker's lock order (:mod:`worker.coordinator`): a lease sits below the
writer lock and takes no lock itself. It is granted only while no update holds the
writer lock; an update, once it holds the writer lock, waits for the leases in flight
to end (at most :attr:`ReadLeases.wait_s`, or its own ``timeout_s`` when shorter), then
*cuts* the ones left and goes on. A cut lease's stream stops before its next chunk and
closes the connection, so its sink sees a short read and fails; a chunk copied while the
update writes is never sent, because the cut is set before the write begins and every
chunk is checked after its copy. Nothing waits on a lease holder, so leases cannot deadlock.

Every update bumps :attr:`ReadLeases.epoch` before it may write (weights change only through
the update pipeline; a release and resume with a host copy restores them bit for bit), so the
digests a snapshot computed stay valid for later snapshots of the same epoch: a source serving
several joiners digests its weights once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable

#: How long an update waits for snapshots in flight before it cuts them (``--snapshot-lease-wait-s``).
DEFAULT_LEASE_WAIT_S = 10.0


class LeaseRefused(Exception):
    """No lease now (an update holds the weights); the message is for the caller."""


class ReadLease:
    """One snapshot's hold on the weights; :attr:`cut` is set when an update takes them back."""

    def __init__(self, release: Callable[[ReadLease], None]):
        self.cut = threading.Event()
        self._release = release

    def release(self) -> None:
        self._release(self)


class ReadLeases:
    """The read leases of one worker's weights (event loop only, except :attr:`ReadLease.cut`)."""

    def __init__(self, writer_busy: Callable[[], str | None], wait_s: float = DEFAULT_LEASE_WAIT_S):
        self._writer_busy = writer_busy
        self._held: set[ReadLease] = set()
        self._none_held = asyncio.Event()
        self._none_held.set()
        self.wait_s = wait_s
        self.cuts = 0
        """Leases cut by an update since start (for logs and tests)."""
        self.epoch = 0
        """Bumped by every update before it may write: digests taken in one epoch hold for all of it."""
        self._digests: tuple[int, dict[str, str]] | None = None

    @property
    def count(self) -> int:
        return len(self._held)

    def acquire(self) -> ReadLease:
        """A lease, or :class:`LeaseRefused` while an update holds the writer lock."""
        busy = self._writer_busy()
        if busy is not None:
            raise LeaseRefused(f"the weights are being updated by {busy}; try again once it ended")
        lease = ReadLease(self._drop)
        self._held.add(lease)
        self._none_held.clear()
        return lease

    def _drop(self, lease: ReadLease) -> None:
        self._held.discard(lease)
        if not self._held:
            self._none_held.set()

    async def end_for_writer(self, timeout_s: float) -> int:
        """Called by an update holding the writer lock: wait for the leases to end (bounded by
        ``min(timeout_s, wait_s)``), then cut those left. Returns how many were cut."""
        self.epoch += 1
        self._digests = None
        if self._held:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._none_held.wait(), min(timeout_s, self.wait_s))
        left = list(self._held)
        for lease in left:
            lease.cut.set()
            self._drop(lease)
        self.cuts += len(left)
        return len(left)

    def cached_digests(self, epoch: int) -> dict[str, str] | None:
        """The per-tensor digests a snapshot of ``epoch`` computed, if no update began since."""
        if self._digests is not None and self._digests[0] == epoch == self.epoch:
            return self._digests[1]
        return None

    def keep_digests(self, epoch: int, digests: dict[str, str]) -> None:
        """Remember a snapshot's digests for the next one of the same epoch (a joiner after a joiner)."""
        if epoch == self.epoch:
            self._digests = (epoch, digests)
