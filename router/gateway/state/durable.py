"""Durable records: memory holds the truth, the store a copy kept in step with it.

Every record the router persists (the update journal, the fleet's weights, the
weight-update groups) decides routing from memory. Writing the copy can fail (a
read-only or full volume, an API server that refuses): the router then keeps
going on what memory holds, which fails closed by construction (a journal entry
it could not write still fences its workers), marks the record *unsaved*, says so
on ``/health``, and writes it again every :data:`RETRY_S` until the store takes
it. A record is written whole and only its latest content matters, so a retry
never writes something older than what a concurrent save already wrote.

The one write that must not fail silently is the journal's entry before an
update starts (:meth:`DurableRecord.save_or_raise`): the update is refused and
nothing changes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path

from router.contract.fleet import StorageView
from router.gateway.state.store import DirectoryStore, StateStore

log = logging.getLogger(__name__)

#: How often an unsaved record is written again.
RETRY_S = 2.0


class DurableRecord:
    """One named record's copy in a store (or none: a router without a store keeps memory only)."""

    def __init__(self, store: StateStore | None, name: str):
        self.store = store
        self.name = name
        self.error: str | None = None
        self._io = threading.Lock()
        # (generation, content): content None means "no record". Replaced whole, so a
        # writer thread always reads a consistent pair.
        self._wanted: tuple[int, bytes | None] = (0, None)
        self._written = 0

    @property
    def unsaved(self) -> bool:
        """Memory holds something the store has not taken yet (a write may be on its way)."""
        return self._wanted[0] != self._written

    @property
    def failing(self) -> bool:
        """Unsaved because the last write failed: what storage health reports. A write still on its
        way (one a clean end of an update does not wait for) is not a storage fault."""
        return self.unsaved and self.error is not None

    def load(self) -> bytes | None:
        """The stored content (blocking; at start-up). Raises :class:`OSError` when it cannot be read."""
        if self.store is None:
            return None
        data = self.store.read(self.name)
        self._wanted = (0, data)
        self._written = 0
        return data

    def want(self, data: bytes | None) -> None:
        """Make ``data`` the content to store (``None``: remove the record); :meth:`flush` writes it."""
        self._wanted = (self._wanted[0] + 1, data)

    def flush(self) -> None:
        """Write the latest wanted content (blocking). Raises :class:`OSError`; the record stays unsaved."""
        if self.store is None:
            self._written = self._wanted[0]
            return
        with self._io:
            generation, data = self._wanted
            if generation == self._written:
                return
            try:
                if data is None:
                    self.store.remove(self.name)
                else:
                    self.store.write(self.name, data)
            except OSError as exc:
                self.error = f"{type(exc).__name__}: {exc}"
                raise
            self._written = generation
            if self.error is not None:
                log.info("state record %s written to %s again", self.name, self.store.location)
            self.error = None

    def flush_or_log(self) -> bool:
        """:meth:`flush`, logging a failure instead of raising (memory still decides); True if written."""
        first = self.error is None
        try:
            self.flush()
        except OSError as exc:
            if first:
                log.error(
                    "could not write state record %s to %s (%s); memory keeps it and the router retries",
                    self.name,
                    self.location,
                    exc,
                )
            return False
        return True

    async def save(self, data: bytes | None) -> bool:
        """Store ``data`` on a worker thread; a failure is logged and retried later. True if written now."""
        self.want(data)
        return await asyncio.to_thread(self.flush_or_log)

    def save_now(self, data: bytes | None) -> bool:
        """:meth:`save` without leaving the calling thread (start-up, an interrupted operation)."""
        self.want(data)
        return self.flush_or_log()

    async def save_or_raise(self, data: bytes | None) -> None:
        """Store ``data`` or raise :class:`OSError` with the wanted content back as it was."""
        previous = self._wanted[1]
        self.want(data)
        try:
            await asyncio.to_thread(self.flush)
        except OSError:
            # Whatever the failed write left behind is rewritten with the content memory keeps.
            self.want(previous)
            raise

    @property
    def location(self) -> str:
        return "memory" if self.store is None else self.store.location


class DurableState:
    """The router's records in one store, with their storage health and the retry of unsaved ones."""

    def __init__(self, store: StateStore | None):
        self.store = store
        self._records: dict[str, DurableRecord] = {}
        self.problem = None if store is None else store.problem()
        """Why the store can take no record at all (a state path that is not a directory): every write fails,
        so updates are refused (503) while generation goes on; reported on ``/health``, logged once here."""
        if self.problem is not None:
            log.error("%s: the router serves, and refuses updates until it is one", self.problem)

    @classmethod
    def in_directory(cls, directory: Path | None) -> DurableState:
        return cls(None if directory is None else DirectoryStore(directory))

    def record(self, name: str) -> DurableRecord:
        if name not in self._records:
            self._records[name] = DurableRecord(self.store, name)
        return self._records[name]

    def view(self) -> StorageView | None:
        """What ``/health`` and the journal view report (``None`` without a store)."""
        if self.store is None:
            return None
        unsaved = sorted(r.name for r in self._records.values() if r.failing)
        errors = [f"{r.name}: {r.error}" for r in self._records.values() if r.failing]
        if self.problem is not None:
            errors.insert(0, self.problem)
        healthy = not unsaved and self.problem is None
        return StorageView(healthy=healthy, location=self.store.location, unsaved=unsaved, error="; ".join(errors))

    async def retry_unsaved(self) -> None:
        for record in list(self._records.values()):
            if record.unsaved:
                await asyncio.to_thread(record.flush_or_log)

    async def keep_retrying(self, interval_s: float = RETRY_S) -> None:
        while True:
            await asyncio.sleep(interval_s)
            if self.problem is not None and self.store is not None:
                self.problem = await asyncio.to_thread(self.store.problem)  # an operator may have fixed it
            await self.retry_unsaved()

    async def retry_ctx(self, _app: object) -> AsyncIterator[None]:
        """An aiohttp cleanup context: retry unsaved records for as long as the app runs."""
        task = asyncio.create_task(self.keep_retrying(), name="state-retry")
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        # A last try on the way out, so a store that came back in the meantime gets the latest state.
        await self.retry_unsaved()


def as_record(state: DurableRecord | Path | None, name: str) -> DurableRecord:
    """A record for ``state``: itself, the file ``name`` under a directory, or memory only."""
    if isinstance(state, DurableRecord):
        return state
    return DurableState.in_directory(state).record(name)
