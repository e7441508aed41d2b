"""Where the router's durable records live.

A store holds small named records, each written whole. Every call blocks on I/O,
so the router calls them on a worker thread, never on its event loop. A store
that cannot read or write raises :class:`OSError`; what the router does then is
:mod:`router.gateway.state.durable`'s business, not the store's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from router.gateway.state import files


class StateStore(Protocol):
    """Named records written whole: after a crash a reader sees a record's old content or its new one."""

    @property
    def location(self) -> str:
        """Where the records are, for logs and status views."""
        ...

    def problem(self) -> str | None:
        """Why no record can be written at all (checked at start and while records are unsaved), or ``None``."""
        ...

    def read(self, name: str) -> bytes | None:
        """The record's content, or ``None`` when none was ever written there."""
        ...

    def write(self, name: str, data: bytes) -> None: ...

    def remove(self, name: str) -> None:
        """Drop the record (nothing to do when it is absent)."""
        ...


class DirectoryStore:
    """One file per record under ``--state-dir`` (the default, for a router with one replica)."""

    def __init__(self, directory: Path):
        self.directory = directory

    @property
    def location(self) -> str:
        return str(self.directory)

    def problem(self) -> str | None:
        """Why no record can be written here at all (the state path is not a directory), or ``None``."""
        if self.directory.exists() and not self.directory.is_dir():
            return f"--state-dir {self.directory} is not a directory"
        return None

    def read(self, name: str) -> bytes | None:
        path = self.directory / name
        try:
            return path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            # No such file, or the state path (or a folder on it) is not a directory: nothing was ever
            # written there. A record that exists and cannot be read still raises.
            return None

    def write(self, name: str, data: bytes) -> None:
        files.write_atomic(self.directory / name, data)

    def remove(self, name: str) -> None:
        files.remove(self.directory / name)
