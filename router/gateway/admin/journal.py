"""Crash-safe record of an admin update whose outcome is not known to be good.

Before an update disables its targets, the router writes their ids (and each
one's previous ``disabled`` flag) to the ``update_journal.json`` record of its
state store (``--state-dir`` by default; :mod:`router.gateway.state`). When the
update ends the entry is removed, or narrowed to the workers whose weights may
differ from the fleet's, which stay disabled. If the router dies mid-update, the next
start finds the entry and keeps those workers disabled: once a broadcast has
started, every target's weights are uncertain.

An operator clears it by re-enabling each worker (``PUT /workers/{id}
{"disabled": false}`` drops that worker from the entry) or at once with
``POST /weight_update_journal/resolve {"acknowledge": true}``. While an entry
is pending, further updates are refused with 409.

A store that refuses a write never stops the router: the entry in memory fences
its workers all the same, ``/health`` and the journal view report the storage
fault, and the record is written again until the store takes it. Only the entry
written before an update starts must reach the store: if it cannot, the update
is refused (503) and nothing changes. Without a state store the journal lives in
memory only: failures still fail closed, but a router crash forgets them (the
CLI warns about this).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from router.contract.errors import Unavailable
from router.contract.fleet import JournalState, JournalTarget
from router.gateway.state.durable import DurableRecord, as_record

if TYPE_CHECKING:
    from router.gateway.fleet.registry import WorkerRegistry

log = logging.getLogger(__name__)

JOURNAL_FILE = "update_journal.json"


class UpdateJournal:
    """The pending entry (at most one) and its durable copy."""

    def __init__(self, state: DurableRecord | Path | None):
        self.record = as_record(state, JOURNAL_FILE)
        self.pending: JournalState | None = None
        self._writes: set[asyncio.Future[bool]] = set()

    def load(self) -> JournalState | None:
        """Read the entry left by a previous run (at start-up, before the event loop serves).

        An entry still ``in_flight`` means the router died mid-update; it becomes
        ``failed`` (written back when the store takes it). A record that exists but
        cannot be read raises; the caller treats that as "every worker uncertain"
        (see :meth:`load_or_unreadable`).
        """
        self.pending = None
        data = self.record.load()
        if data is None:
            return None
        state = JournalState.model_validate_json(data)
        if state.state == "in_flight":
            state.state = "failed"
            state.reason = f"router stopped during {state.path}; targets' weights are uncertain"
            state.failed = [t.id for t in state.targets]
            self.record.save_now(_encode(state))
        self.pending = state
        return state

    def load_or_unreadable(self, all_workers: Iterable[tuple[str, str]]) -> JournalState | None:
        """Like :meth:`load`, but an unreadable record fences every given worker."""
        try:
            return self.load()
        except (OSError, ValueError, ValidationError) as exc:
            log.error("update journal in %s is unreadable (%s); keeping every worker disabled", self.location, exc)
            state = JournalState(
                state="failed",
                path="(unknown)",
                started_at=time.time(),
                targets=[JournalTarget(id=wid, url=url, previous_disabled=False) for wid, url in all_workers],
                reason=f"update journal unreadable: {exc}",
            )
            state.failed = [t.id for t in state.targets]
            self.pending = state
            self.record.save_now(_encode(state))
            return state

    def reload(self, all_workers: Iterable[tuple[str, str]]) -> JournalState | None:
        """:meth:`load_or_unreadable` again (blocking): a new leader reads what the previous one left,
        an update it had in flight included (``in_flight`` becomes ``failed``, as after a crash)."""
        return self.load_or_unreadable(all_workers)

    @property
    def location(self) -> str:
        return self.record.location

    async def begin(self, path: str, targets: Iterable[tuple[str, str, bool]]) -> None:
        """Record an update about to start; raise 503 (and change nothing) if it cannot be made durable."""
        state = JournalState(
            state="in_flight",
            path=path,
            started_at=time.time(),
            targets=[JournalTarget(id=i, url=u, previous_disabled=d) for i, u, d in targets],
        )
        try:
            await self.record.save_or_raise(_encode(state))
        except OSError as exc:
            raise Unavailable(f"update refused: cannot write the update journal ({exc})") from None
        self.pending = state

    async def fail(self, kept_ids: Iterable[str], reason: str) -> None:
        """The update ended with these targets' weights uncertain: the entry keeps exactly them."""
        if self._mark_failed(kept_ids, reason):
            await self.record.save(_encode(self.pending))

    def fail_now(self, kept_ids: Iterable[str], reason: str) -> None:
        """:meth:`fail` without leaving the calling thread (an interrupted operation, perhaps at shutdown)."""
        if self._mark_failed(kept_ids, reason):
            self.record.save_now(_encode(self.pending))

    async def clear(self) -> None:
        self.pending = None
        await self.record.save(None)

    def clear_soon(self) -> None:
        """:meth:`clear` with the write left running: an update that ended cleanly answers without waiting
        for it. Memory is cleared at once (the next update may begin), and the record keeps its writes in
        order (the latest wanted content is what lands). A crash before the write lands leaves the entry
        ``in_flight`` on disk: the next start fences its targets, the safe side, until an operator resolves it."""
        self.pending = None
        write = asyncio.ensure_future(self.record.save(None))
        self._writes.add(write)
        write.add_done_callback(self._writes.discard)

    async def discard_target(self, worker_id: str) -> bool:
        """Drop one worker from a failed entry (the operator re-enabled it); True if it was there."""
        state = self.pending
        if state is None or state.state != "failed":
            return False
        remaining = [t for t in state.targets if t.id != worker_id]
        if len(remaining) == len(state.targets):
            return False
        if not remaining:
            await self.clear()
            return True
        state.targets = remaining
        state.failed = [f for f in state.failed if f != worker_id]
        await self.record.save(_encode(state))
        return True

    def names(self, worker_id: str) -> bool:
        return self.pending is not None and any(t.id == worker_id for t in self.pending.targets)

    def _mark_failed(self, kept_ids: Iterable[str], reason: str) -> bool:
        state = self.pending
        if state is None:
            return False
        kept = set(kept_ids)
        state.state = "failed"
        state.targets = [t for t in state.targets if t.id in kept]
        state.failed = sorted(kept)
        state.reason = reason
        return True


def keep_fenced(registry: WorkerRegistry, pending: JournalState | None) -> None:
    """An unresolved update was found (at start-up, or by a new leader): keep its targets out of routing."""
    if pending is None:
        return
    for target in pending.targets:
        worker = registry.find(target.id)
        if worker is not None:
            worker.disabled = True
    log.warning(
        "unresolved update journal (%s: %s); keeping %d worker(s) disabled until an operator resolves it",
        pending.path,
        pending.reason,
        len(pending.targets),
    )


def _encode(state: JournalState | None) -> bytes | None:
    return None if state is None else state.model_dump_json(indent=1).encode()
