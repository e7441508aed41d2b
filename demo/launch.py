"""Start real omni processes on this machine: free ports, readiness polling, clean teardown.

Used by the demo, the benchmarks and the tests. Every wait here is bounded; a
process that does not become ready in time is killed and its log is attached to
the error. Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from router.contract.base import WireRequest

BIN_DIR = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(
    method: str,
    url: str,
    body: Any = None,
    *,
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
    raw: bytes | None = None,
) -> tuple[int, Any]:
    """A blocking HTTP call returning (status, parsed JSON or text). Never raises on HTTP errors.

    ``body`` is JSON-encoded, or sent as :meth:`~router.contract.base.WireRequest.to_json` when it is a request model.
    """
    if raw is not None:
        data: bytes | None = raw
    elif isinstance(body, WireRequest):
        data = body.to_json()
    else:
        data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    for key, value in (headers or {}).items():
        req.add_header(key, value)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, payload = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, payload = err.code, err.read()
    text = payload.decode("utf-8", errors="replace")
    try:
        return status, json.loads(text) if text else None
    except json.JSONDecodeError:
        return status, text


class ManagedProcess:
    """A child process with a log file, a readiness probe and guaranteed teardown."""

    def __init__(self, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None):
        self.name = name
        self.argv = list(argv)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log_path = Path(tempfile.mkstemp(prefix=f"omni-{name}-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ManagedProcess:
        with open(self.log_path, "wb") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        return self

    def log_text(self, tail: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def wait_http_ready(self, url: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before ready:\n{self.log_text()}")
            try:
                status, _ = http_json("GET", url, timeout=2.0)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.kill()
        raise TimeoutError(f"{self.name} not ready at {url} within {timeout}s:\n{self.log_text()}")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group (a crash, as far as peers can tell)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=timeout)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            self.kill()


def cli(name: str) -> str:
    """Path of a console script installed in this venv (omni-worker, omni-router)."""
    path = BIN_DIR / name
    return str(path) if path.exists() else name


def start_worker(
    model_dir: str | Path,
    *,
    port: int | None = None,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    ready_timeout: float = 90.0,
    process: type[ManagedProcess] = ManagedProcess,
) -> tuple[ManagedProcess, str]:
    """Start `omni-worker` on a free port; returns (process, base_url) once /health answers.

    ``process`` is the class that starts it (the test suite's forks an interpreter that has torch loaded)."""
    port = port or free_port()
    argv = [cli("omni-worker"), "--model-path", str(model_dir), "--host", "127.0.0.1", "--port", str(port), *extra_args]
    proc = process(f"worker-{port}", argv, env=env).start()
    url = f"http://127.0.0.1:{port}"
    proc.wait_http_ready(url + "/health", timeout=ready_timeout)
    return proc, url
