"""Crash-safe record of an admin update whose outcome is not known to be good.

Before an update disables its targets, the router writes their ids (and each
one's previous ``disabled`` flag) to ``<state_dir>/update_journal.json``:
tmp file, fsync, ``os.replace``, fsync of the directory. The entry is removed
only when the update ends known-good. If the router dies mid-update, the next
start finds the entry and keeps those workers disabled: once a broadcast has
started, every target's weights are uncertain.

An operator clears it by re-enabling each worker (``PUT /workers/{id}
{"disabled": false}`` drops that worker from the entry) or at once with
``POST /weight_update_journal/resolve {"acknowledge": true}``. While an entry
is pending, further updates are refused with 409.

Without a state dir the journal lives in memory only: failures still fail
closed, but a router crash forgets them (the CLI warns about this).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

from pydantic import ValidationError

from router.contract.errors import Unavailable
from router.contract.fleet import JournalState, JournalTarget

log = logging.getLogger(__name__)

JOURNAL_FILE = "update_journal.json"


class UpdateJournal:
    """The pending entry (at most one) and its durable copy."""

    def __init__(self, state_dir: Path | None):
        self.state_dir = state_dir
        self.pending: JournalState | None = None

    @property
    def path(self) -> Path | None:
        return None if self.state_dir is None else self.state_dir / JOURNAL_FILE

    def load(self) -> JournalState | None:
        """Read the entry left by a previous run.

        An entry still ``in_flight`` means the router died mid-update; it becomes
        ``failed``. A file that exists but cannot be read yields ``None`` and
        raises nothing: the caller treats that as "every worker uncertain"
        (see :meth:`load_or_unreadable`).
        """
        self.pending = None
        path = self.path
        if path is None or not path.exists():
            return None
        raw = path.read_text()
        state = JournalState.model_validate_json(raw)
        if state.state == "in_flight":
            state.state = "failed"
            state.reason = f"router stopped during {state.path}; targets' weights are uncertain"
            state.failed = [t.id for t in state.targets]
            self._write(state)
        self.pending = state
        return state

    def load_or_unreadable(self, all_workers: Iterable[tuple[str, str]]) -> JournalState | None:
        """Like :meth:`load`, but an unreadable file fences every given worker."""
        try:
            return self.load()
        except (OSError, ValueError, ValidationError) as exc:
            log.error("update journal %s is unreadable (%s); keeping every worker disabled", self.path, exc)
            state = JournalState(
                state="failed",
                path="(unknown)",
                started_at=time.time(),
                targets=[JournalTarget(id=wid, url=url, previous_disabled=False) for wid, url in all_workers],
                reason=f"update journal unreadable: {exc}",
            )
            state.failed = [t.id for t in state.targets]
            self.pending = state
            self._write(state)
            return state

    def begin(self, path: str, targets: Iterable[tuple[str, str, bool]]) -> None:
        """Record an update about to start; raise 503 (and change nothing) if it cannot be made durable."""
        state = JournalState(
            state="in_flight",
            path=path,
            started_at=time.time(),
            targets=[JournalTarget(id=i, url=u, previous_disabled=d) for i, u, d in targets],
        )
        try:
            self._write(state)
        except OSError as exc:
            raise Unavailable(f"update refused: cannot write the update journal ({exc})") from None
        self.pending = state

    def fail(self, failed_ids: Iterable[str], reason: str) -> None:
        """Keep the entry: the update ended with its targets' weights uncertain."""
        if self.pending is None:
            return
        self.pending.state = "failed"
        self.pending.failed = sorted(set(failed_ids))
        self.pending.reason = reason
        try:
            self._write(self.pending)
        except OSError as exc:  # the in-memory entry still fences the workers
            log.error("could not persist failed update journal: %s", exc)

    def clear(self) -> None:
        self.pending = None
        path = self.path
        if path is None:
            return
        try:
            path.unlink(missing_ok=True)
            self._fsync_dir()
        except OSError as exc:
            log.error("could not remove update journal %s: %s", path, exc)

    def discard_target(self, worker_id: str) -> bool:
        """Drop one worker from a failed entry (the operator re-enabled it); True if it was there."""
        state = self.pending
        if state is None or state.state != "failed":
            return False
        remaining = [t for t in state.targets if t.id != worker_id]
        if len(remaining) == len(state.targets):
            return False
        if not remaining:
            self.clear()
            return True
        state.targets = remaining
        state.failed = [f for f in state.failed if f != worker_id]
        try:
            self._write(state)
        except OSError as exc:
            log.error("could not persist update journal: %s", exc)
        return True

    def names(self, worker_id: str) -> bool:
        return self.pending is not None and any(t.id == worker_id for t in self.pending.targets)

    def _write(self, state: JournalState) -> None:
        path = self.path
        if path is None:
            return
        assert self.state_dir is not None
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(tmp, flags, 0o600)
        try:
            os.write(fd, state.model_dump_json(indent=1).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self._fsync_dir()

    def _fsync_dir(self) -> None:
        if self.state_dir is None:
            return
        fd = os.open(self.state_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
