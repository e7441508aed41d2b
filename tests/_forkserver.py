"""Start test processes by forking a server that has already imported torch and the worker.

Importing torch is most of an ``omni-worker``'s start-up, and the suite starts about a hundred
workers and trainers. One server per pytest process imports it once; each process the tests start
is a fork of that server running the same entry point the console script would (``omni-worker``'s
``main``, or a module run as ``python -m``). It is still a real, separate process: its own session
and process group, its own log file, its own environment; signals, ``/proc`` and process-group kills
work as for any child. Only its parent differs, so the server reaps it and reports its exit status
(:class:`ForkedProcess` answers ``poll``/``wait`` like ``subprocess.Popen``).

The server stays single-threaded and never computes with torch, so a fork copies no held lock and
no started thread pool. A process whose environment differs from the suite's in a variable read at
import time would not see it here; :func:`forkable` sends those to a plain ``Popen``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: What the server imports before it forks: what a worker or a trainer spends its start-up on.
PRELOAD = ("torch", "torch.distributed", "safetensors.torch", "worker.cli", "worker.http.app", "router.gateway.cli")
#: The console scripts run in a fork: their installed entry points (``module:function``).
SCRIPTS = ("omni-worker", "omni-router")
#: Environment variables a forked process may have its own value of (read after start-up, not at
#: import). pytest names the running test in one: a process restarted in a later test differs there.
RUNTIME_ENV = frozenset({"PYTHONUNBUFFERED", "PYTEST_CURRENT_TEST"})
#: The bound on one request to the server (it answers at once; a fork takes milliseconds).
REQUEST_TIMEOUT_S = 30.0
#: Bound on the server's own start (it imports torch).
SERVER_START_S = 120.0


def _exit_code(status: int) -> int:
    """``waitpid``'s status as ``Popen.returncode`` writes it: the exit code, or minus the signal."""
    return os.waitstatus_to_exitcode(status)


def _child(request: dict[str, Any]) -> None:
    """In the forked process: become a process of its own, then run the entry point. Never returns."""
    code = 1
    try:
        os.setsid()
        # As a fresh interpreter has them (SIGPIPE stays ignored, as Python sets it at start-up).
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        target = request["target"]
        if target.startswith("-m "):
            module = target[3:]
            sys.argv = [module, *request["argv"][3:]]  # as ``python -m`` leaves it
            import runpy

            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        else:
            import importlib

            module, function = target.split(":")
            sys.argv = list(request["argv"])
            result = getattr(importlib.import_module(module), function)()
            code = result if isinstance(result, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(path: str) -> None:
    """The server: import, listen on ``path``, fork on request, reap children, answer their status."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    import torch

    # A model is built on the meta device first; the first meta tensor imports another 800 modules
    # (torch's Python reference kernels and sympy). A meta tensor computes nothing, on no thread.
    with torch.device("meta"):
        torch.nn.Embedding(2, 2)
    statuses: dict[int, int] = {}
    children: set[int] = set()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    parent = os.getppid()
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    listener.setblocking(False)

    def reap() -> None:
        for pid in list(children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                children.discard(pid)
                continue
            if done:
                children.discard(pid)
                statuses[pid] = _exit_code(status)

    while os.getppid() == parent:  # the pytest process that started it is gone: so is the server
        sel.select(timeout=0.05)
        reap()
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            continue
        with conn:
            conn.setblocking(True)
            conn.settimeout(REQUEST_TIMEOUT_S)
            request = json.loads(conn.makefile("rb").readline())
            if request["op"] == "spawn":
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    listener.close()
                    _child(request)
                children.add(pid)
                answer: dict[str, Any] = {"pid": pid}
            else:
                reap()
                answer = {"returncode": statuses.get(request["pid"])}
            conn.sendall(json.dumps(answer).encode() + b"\n")
    for pid in children:  # whatever is left belongs to a test process that died: do not leak it
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass


class ForkServer:
    """The client side, one per pytest process: the server is started on first use."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix="omni-forkserver-")
        self.path = os.path.join(self._dir, "sock")

    def _ensure(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        log = open(os.path.join(self._dir, "server.log"), "wb")  # noqa: SIM115 - the child keeps its copy
        self._proc = subprocess.Popen(
            [sys.executable, "-c", f"from tests._forkserver import serve; serve({self.path!r})"],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=str(Path(__file__).resolve().parent.parent),
        )
        log.close()
        deadline = time.monotonic() + SERVER_START_S
        while not os.path.exists(self.path):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fork server did not start: {self._dir}/server.log")
            time.sleep(0.02)

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        self._ensure()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(REQUEST_TIMEOUT_S)
            conn.connect(self.path)
            conn.sendall(json.dumps(message).encode() + b"\n")
            answer: dict[str, Any] = json.loads(conn.makefile("rb").readline())
        return answer

    def spawn(self, argv: Sequence[str], *, env: dict[str, str], log: Path, target: str) -> ForkedProcess:
        message = {"op": "spawn", "argv": list(argv), "env": env, "log": str(log), "cwd": os.getcwd()}
        message["target"] = target
        return ForkedProcess(self, int(self.request(message)["pid"]), list(argv))


class ForkedProcess:
    """A forked process, answering what the suite asks of a ``subprocess.Popen``."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]):
        self._server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.request({"op": "poll", "pid": self.pid})["returncode"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@functools.cache
def _entry_points() -> dict[str, str]:
    found = importlib.metadata.entry_points(group="console_scripts")
    return {ep.name: ep.value for ep in found if ep.name in SCRIPTS}


def forkable(argv: Sequence[str], env: dict[str, str]) -> str | None:
    """What the server runs for ``argv``: a console script's entry point (``module:function``) or
    ``-m module``; None when the process must start from scratch (another program, or an
    environment variable that differs from the suite's and may be read at import)."""
    if any(os.environ.get(key) != value for key, value in env.items() if key not in RUNTIME_ENV):
        return None
    entry = _entry_points().get(Path(argv[0]).name)
    if entry is not None and Path(argv[0]).parent == Path(sys.executable).parent:
        return entry
    if argv[0] == sys.executable and len(argv) >= 3 and argv[1] == "-m":
        return f"-m {argv[2]}"
    return None
