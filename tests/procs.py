"""Process helpers for tests (see :mod:`demo.launch`).

:class:`ManagedProcess` here starts ``omni-worker``, ``omni-router`` and ``python -m`` processes as forks of a server
that has torch imported already (:mod:`tests._forkserver`); everything else as ``demo.launch`` does.
"""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from demo import launch
from demo.launch import cli, free_port, http_json
from tests._forkserver import ForkServer, forkable


def forking() -> bool:
    """``OMNI_TEST_FORK=0`` starts every process from scratch (the engine tier does: its servers are
    other projects' programs; and anyone may, to rule the fork server out)."""
    return os.environ.get("OMNI_TEST_FORK", "1") != "0"


@functools.cache
def _server() -> ForkServer:
    return ForkServer()


class ManagedProcess(launch.ManagedProcess):
    def start(self) -> ManagedProcess:
        target = forkable(self.argv, self.env) if forking() else None
        if target is None:
            super().start()
        else:
            self.proc = _server().spawn(self.argv, env=self.env, log=self.log_path, target=target)  # type: ignore[assignment]
        return self

    def wait_exit(self, timeout: float) -> int:
        """Its exit code once it has exited; past ``timeout`` it is killed and the test fails with its log."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{self.name} did not exit within {timeout:g}s:\n{self.log_text()}")


def start_worker(model_dir: str | Path, *, extra_args: Sequence[str] = (), **kwargs: Any) -> tuple[ManagedProcess, str]:
    proc, url = launch.start_worker(model_dir, extra_args=extra_args, process=ManagedProcess, **kwargs)
    assert isinstance(proc, ManagedProcess)
    return proc, url


__all__ = ["ManagedProcess", "cli", "free_port", "http_json", "start_worker"]
