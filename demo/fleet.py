"""The demo's processes: ``omni-worker`` x N and one ``omni-router`` in front of them.

Every child is registered the moment it is spawned, so :meth:`Fleet.stop`
reaches all of them whatever went wrong (a failed start, a failed sync,
Ctrl-C). Children run in their own sessions and never see the terminal's
SIGINT; stopping them is this module's job.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from demo.launch import ManagedProcess, cli, free_port, http_json

ADMIN_KEY_ENV = "SGLANG_OMNI_ADMIN_KEY"


class Fleet:
    """Start workers, then a router over them; stop everything, newest first.

    The admin key reaches every process through the environment (not argv, so
    it does not show in a process listing).
    ``worker_args`` go on every worker's command line (``--lora``: ``--enable-lora`` and the rest).
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        workers: int,
        admin_key: str,
        state_dir: Path,
        ready_timeout_s: float = 120.0,
        worker_args: Sequence[str] = (),
    ):
        self.model_dir = model_dir
        self.num_workers = workers
        self.worker_args = list(worker_args)
        self.admin_key = admin_key
        self.state_dir = state_dir
        self.ready_timeout_s = ready_timeout_s
        self.procs: list[ManagedProcess] = []
        self.worker_urls: list[str] = []
        self.router_url = ""

    def _spawn(self, name: str, argv: list[str]) -> ManagedProcess:
        proc = ManagedProcess(name, argv, env={ADMIN_KEY_ENV: self.admin_key})
        self.procs.append(proc)
        return proc.start()

    def start_workers(self) -> None:
        """Spawn every worker at once (start-up is mostly the torch import); return without waiting."""
        for i in range(self.num_workers):
            port = free_port()
            argv = [cli("omni-worker"), "--model-path", str(self.model_dir), "--host", "127.0.0.1", "--port", str(port)]
            self._spawn(f"worker{i}", [*argv, *self.worker_args])
            self.worker_urls.append(f"http://127.0.0.1:{port}")

    def start_router(self) -> None:
        """Wait for the workers, start the router over them, wait until it routes to all of them."""
        for proc, url in zip(self.procs, self.worker_urls, strict=True):
            proc.wait_http_ready(url + "/health", timeout=self.ready_timeout_s)
        port = free_port()
        argv = [
            cli("omni-router"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *self.worker_urls,
            "--policy",
            "round_robin",
            "--state-dir",
            str(self.state_dir),
            "--health-check-interval-s",
            "0.5",
        ]
        router = self._spawn("router", argv)
        self.router_url = f"http://127.0.0.1:{port}"
        router.wait_http_ready(self.router_url + "/liveness", timeout=self.ready_timeout_s)
        deadline = time.monotonic() + self.ready_timeout_s
        while self.healthy_workers() < self.num_workers:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the router saw {self.healthy_workers()}/{self.num_workers} healthy workers:\n{router.log_text()}"
                )
            time.sleep(0.1)

    def healthy_workers(self) -> int:
        status, body = http_json(
            "GET", self.router_url + "/workers", headers={"Authorization": f"Bearer {self.admin_key}"}, timeout=5
        )
        if status != 200:
            return 0
        return sum(w["health"] == "healthy" and not w["disabled"] for w in body["workers"])

    def stop(self) -> None:
        """Stop every child (router first, so nothing is routed to a worker on its way out)."""
        for proc in reversed(self.procs):
            try:
                proc.stop(timeout=10)
            except Exception as exc:
                print(f"could not stop {proc.name} (pid {proc.proc.pid if proc.proc else '?'}): {exc}")

    def log_paths(self) -> list[Path]:
        return [p.log_path for p in self.procs]

    def remove_logs(self) -> None:
        for path in self.log_paths():
            path.unlink(missing_ok=True)
