"""Helpers for router tests: start a real ``omni-router`` process, poll its state.

Workers are real ``omni-worker`` processes (``tests.procs.start_worker``) on a
tiny generated checkpoint; every wait is bounded.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests._polling import wait_for
from tests.procs import ManagedProcess, cli, free_port, http_json, start_worker

ADMIN_KEY = "router-test-admin-key"


def auth(key: str | None = ADMIN_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def make_tiny_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    """``omni-worker make-tiny``: the checkpoint a worker started with ``--model-path out_dir`` serves."""
    proc = ManagedProcess("make-tiny", [cli("omni-worker"), "make-tiny", str(out_dir), "--seed", str(seed)]).start()
    assert proc.wait_exit(120) == 0, proc.log_text()
    return out_dir


@dataclass
class Fleet:
    """``omni-worker`` processes started by the ``worker_fleet`` fixture (tests/conftest.py), in start order."""

    urls: list[str]
    procs: list[ManagedProcess]
    model: Path
    """The checkpoint every worker serves."""
    others: list[Path]
    """Checkpoints made beside it (``seeds[1:]``), for updates to load."""


def start_workers(
    model_dir: Path, n: int, *, extra_args: Sequence[str] = (), hosts: Sequence[str] = ()
) -> list[tuple[ManagedProcess, str]]:
    """Start ``n`` workers (concurrently: torch import dominates start-up), on ``hosts[i]``
    (loopback addresses such as 127.0.0.2, standing in for pod IPs) or 127.0.0.1."""
    ports = [free_port() for _ in range(n)]
    addresses = [hosts[i] if i < len(hosts) else "127.0.0.1" for i in range(n)]
    procs = []
    for port, host in zip(ports, addresses, strict=True):
        argv = [
            cli("omni-worker"),
            "--model-path",
            str(model_dir),
            "--host",
            host,
            "--port",
            str(port),
            *extra_args,
        ]
        procs.append(ManagedProcess(f"worker-{port}", argv).start())
    out = []
    try:
        for proc, port, host in zip(procs, ports, addresses, strict=True):
            url = f"http://{host}:{port}"
            proc.wait_http_ready(url + "/health", timeout=120)
            out.append((proc, url))
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    return out


@contextmanager
def router_over(
    procs: Sequence[tuple[ManagedProcess, str]], *, extra_args: Sequence[str] = ()
) -> Iterator[tuple[str, list[str], list[ManagedProcess]]]:
    """A router with ``extra_args`` in front of the started workers ``procs`` (waited for until all are healthy):
    (its URL, the workers' URLs, their processes). The router stops first, then the workers."""
    try:
        router, url = start_router([u for _, u in procs], extra_args=extra_args, wait_healthy=len(procs))
        try:
            yield url, [u for _, u in procs], [p for p, _ in procs]
        finally:
            router.stop()
    finally:
        for proc, _ in procs:
            proc.stop()


def start_router(
    worker_urls: Sequence[str],
    *,
    admin_key: str | None = None,
    state_dir: Path | None = None,
    extra_args: Sequence[str] = (),
    port: int | None = None,
    wait_healthy: int | None = None,
    env: dict[str, str] | None = None,
) -> tuple[ManagedProcess, str]:
    """Start ``omni-router`` and wait for ``/liveness`` (and ``wait_healthy`` healthy workers)."""
    port = port or free_port()
    argv = [
        cli("omni-router"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--health-check-interval-s",
        "0.5",
        "--log-level",
        "debug",
    ]
    if worker_urls:
        argv += ["--worker-urls", *worker_urls]
    if admin_key:
        argv += ["--admin-api-key", admin_key]
    if state_dir is not None:
        argv += ["--state-dir", str(state_dir)]
    if "--data-plane-processes" not in extra_args:
        # One process unless a test asks for data planes (tests/test_router_processes.py): the policy
        # tests read exact per-process state, and every extra process costs start-up on 2 cores.
        argv += ["--data-plane-processes", "1"]
    argv += list(extra_args)
    proc = ManagedProcess(f"router-{port}", argv, env=env).start()
    url = f"http://127.0.0.1:{port}"
    proc.wait_http_ready(url + "/liveness", timeout=60)
    n = len(worker_urls) if wait_healthy is None else wait_healthy
    if n:
        wait_for(
            lambda: sum(w["health"] == "healthy" for w in workers(url, admin_key)) >= n, 30, proc, "workers healthy"
        )
    return proc, url


@contextmanager
def running_fleet(
    model_dir: Path,
    n: int,
    *,
    worker_args: Sequence[str] = (),
    admin_key: str | None = None,
    router_args: Sequence[str] = (),
) -> Iterator[tuple[list[str], str]]:
    """``n`` workers behind one router: ``(worker urls, router url)``; all stopped on exit."""
    procs = start_workers(model_dir, n, extra_args=worker_args)
    try:
        router, router_url = start_router([url for _, url in procs], admin_key=admin_key, extra_args=router_args)
        try:
            yield [url for _, url in procs], router_url
        finally:
            router.stop()
    finally:
        for proc, _ in procs:
            proc.stop()


def workers(router_url: str, admin_key: str | None = None) -> list[dict[str, Any]]:
    status, body = http_json("GET", router_url + "/workers", headers=auth(admin_key), timeout=10)
    assert status == 200, body
    return body["workers"]


def by_url(router_url: str, admin_key: str | None = None) -> dict[str, dict[str, Any]]:
    return {w["url"]: w for w in workers(router_url, admin_key)}


def escaped(url: str) -> str:
    return urllib.parse.quote(url, safe="")


def generate_via(
    router_url: str, text: str = "hello", max_new_tokens: int = 4, timeout: float = 60
) -> tuple[int, Any, str | None]:
    """POST /generate through the router; returns (status, body, id of the worker that served it)."""
    body = json.dumps(
        {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
    ).encode()
    req = urllib.request.Request(
        router_url + "/generate", data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read()), resp.headers.get("X-Omni-Worker")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null"), err.headers.get("X-Omni-Worker")


def generate(url: str, text: str = "hello", max_new_tokens: int = 4, **extra: Any) -> tuple[int, Any]:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}, **extra}
    return http_json("POST", url + "/generate", body, timeout=60)


__all__ = [
    "ADMIN_KEY",
    "Fleet",
    "auth",
    "by_url",
    "escaped",
    "generate",
    "generate_via",
    "make_tiny_checkpoint",
    "start_router",
    "start_worker",
    "start_workers",
    "wait_for",
    "workers",
]
