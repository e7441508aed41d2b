"""Start the SGLang stand-in (:mod:`tests.engines.sglang_standin`) for a test, on 127.0.0.1 and a free port, and stop it.

    with sglang_standin(checkpoint, extra_args=["--admin-api-key", "k"], env={...}) as server:
        http_json("GET", server.url + "/model_info")

The stand-in runs in the interpreter running the tests (the engine tier's virtualenv has SGLang installed
without its dependencies, see ``tests/engines/sglang_standin.py``), from the repository root, in its own
process group, so stopping it also stops SGLang's detokenizer and the stand-in scheduler processes.
Readiness is ``GET /ready`` polled with a bound: SGLang answers it 200 only once its startup warmup has
run through the stand-in scheduler. A server that exits or is not ready in time is killed and its log is
attached to the error.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.procs import ManagedProcess, free_port

#: The stand-in starts three Python processes that each import SGLang: about 20 s on an idle 2-core machine.
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class SglangStandin:
    url: str
    model_path: str
    proc: ManagedProcess
    module: str | None = None
    """The server module when it is not the stand-in (``sglang.launch_server``)."""

    def log_text(self, tail: int = 6000) -> str:
        return self.proc.log_text(tail)


@contextmanager
def sglang_standin(
    checkpoint: Path | str,
    *,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> Iterator[SglangStandin]:
    """A stand-in SGLang server for ``checkpoint``, ready once ``/ready`` answers 200; stopped on exit."""
    server = start_standin(checkpoint, extra_args=extra_args, env=env)
    try:
        server.proc.wait_http_ready(server.url + "/ready", timeout=ready_timeout_s)
        yield server
    finally:
        server.proc.stop(timeout=STOP_TIMEOUT_S)


@contextmanager
def ready_standins(servers: list[SglangStandin]) -> Iterator[list[SglangStandin]]:
    """``servers`` (started at once by :func:`start_standin`) once each answers ``/ready``; every server in the
    list on leaving is stopped (a test may replace one in it)."""
    try:
        for server in servers:
            server.proc.wait_http_ready(server.url + "/ready", timeout=READY_TIMEOUT_S)
        yield servers
    finally:
        for server in servers:
            server.proc.stop(timeout=STOP_TIMEOUT_S)


def start_standin(
    checkpoint: Path | str,
    *,
    port: int | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    module: str | None = None,
) -> SglangStandin:
    """Start a stand-in without waiting (several start at once): wait with ``proc.wait_http_ready(url + "/ready")``.
    ``module``: another server module with the same flags (``sglang.launch_server``: a real SGLang on a GPU)."""
    port = port or free_port()
    argv = [sys.executable, "-m", module or "tests.engines.sglang_standin", "--model-path", str(checkpoint)]
    argv += ["--host", "127.0.0.1", "--port", str(port), *extra_args]
    environment = dict(env or {})
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    environment["NO_PROXY"] = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1", "localhost"]))
    proc = ManagedProcess(f"sglang-standin-{port}", argv, env=environment).start()
    return SglangStandin(url=f"http://127.0.0.1:{port}", model_path=str(checkpoint), proc=proc, module=module)
