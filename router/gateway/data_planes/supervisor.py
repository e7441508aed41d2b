"""The control process starts the data-plane processes, restarts them, and stops them last but one.

Each data plane is ``omni-router`` itself, started with the control process's own arguments plus
``--data-plane-of <socket> --data-plane-index <i>`` (so every setting it needs is parsed once, by
the same parser). A data plane that exits while the router runs is started again after a short
back-off (doubling to :data:`MAX_BACKOFF_S` while it keeps failing at once); one that the hub finds
unresponsive is killed, and so restarted. At shutdown every data plane gets SIGTERM (it stops
accepting and drains its requests within the grace) and is killed past the grace plus a margin.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

#: Back-off before restarting a data plane; doubles while restarts keep failing within :data:`HEALTHY_AFTER_S`.
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0
HEALTHY_AFTER_S = 30.0
#: Beyond the shutdown grace: how long a stopping data plane may take before it is killed.
STOP_MARGIN_S = 5.0


class DataPlaneSupervisor:
    """N data-plane processes, kept running until :meth:`stop`."""

    def __init__(self, argv: Sequence[str], count: int, socket_path: str, *, grace_s: float):
        self._argv = list(argv)
        self.count = count
        self.socket_path = socket_path
        self.grace_s = grace_s
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._watchers: list[asyncio.Task[None]] = []
        self._stopping = False
        self.restarts = 0
        """Data planes started again after theirs exited; exported as ``omni_router_data_plane_restarts_total``
        once the control process hands the supervisor to its metrics (``RouterMetrics.control.data_planes``)."""
        self.on_exit: Callable[[int], None] | None = None
        """Told each time a data plane's process has exited (the hub stops waiting for it)."""

    def command(self, index: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "router.gateway.cli",
            *self._argv,
            "--data-plane-of",
            self.socket_path,
            "--data-plane-index",
            str(index),
        ]

    def start(self) -> None:
        self._watchers = [asyncio.create_task(self._keep_running(i), name=f"data-plane-{i}") for i in range(self.count)]

    async def _keep_running(self, index: int) -> None:
        backoff = FIRST_BACKOFF_S
        while not self._stopping:
            started = time.monotonic()
            proc = await asyncio.create_subprocess_exec(*self.command(index))
            self._procs[index] = proc
            log.info("data-plane process %d started (pid %d)", index, proc.pid)
            code = await proc.wait()
            if self.on_exit is not None:
                self.on_exit(index)
            if self._stopping:
                return
            self.restarts += 1
            if time.monotonic() - started > HEALTHY_AFTER_S:
                backoff = FIRST_BACKOFF_S
            log.error("data-plane process %d exited with %s; restarting in %.1fs", index, code, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    def restart(self, index: int, why: str) -> None:
        """Kill data plane ``index`` (its watcher starts it again); its requests in flight fail."""
        proc = self._procs.get(index)
        if proc is not None and proc.returncode is None:
            log.error("data-plane process %d %s; killing it", index, why)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    def pids(self) -> dict[int, int]:
        return {i: p.pid for i, p in self._procs.items() if p.returncode is None}

    async def stop(self) -> None:
        """SIGTERM every data plane, wait up to the grace plus a margin, kill what is left."""
        self._stopping = True
        running = [p for p in self._procs.values() if p.returncode is None]
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        if running:
            _, pending = await asyncio.wait(
                [asyncio.create_task(p.wait()) for p in running], timeout=self.grace_s + STOP_MARGIN_S
            )
            for proc in running:
                if proc.returncode is None:
                    log.error("data-plane process (pid %d) did not stop in time; killing it", proc.pid)
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            for task in pending:
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(task, STOP_MARGIN_S)
        for watcher in self._watchers:
            watcher.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
