"""Crash-safe small files in ``--state-dir``: write a temporary file, fsync, rename, fsync the directory.

After a crash a reader finds either the previous content or the new one, never
a mix. Every byte is written (a short ``os.write`` is continued, not ignored).
These calls block on disk I/O: the router runs them on a worker thread, never
on its event loop.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` durably (mode 0600; the directory is created 0700)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(tmp, flags, 0o600)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            if written <= 0:
                raise OSError(f"writing {tmp} made no progress")
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def remove(path: Path) -> None:
    """Remove ``path`` durably (nothing to do when it is absent)."""
    path.unlink(missing_ok=True)
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
