"""What one hostile connection can make a real router hold: its resident memory, read from /proc.

A router as deployed (``--api-key`` and ``--admin-api-key``, two data planes on one port) in front of
one real worker, behind each of its two servers for the generation routes (the lean server, the
default, and aiohttp's). One connection parks a request on the paused fleet and pipelines 30 requests
with 20 MB bodies behind it without reading an answer; another, without a key, declares a 50 MB body.
The router's memory (control process and data planes together) may grow by two bodies at most, and the
caller without a key is refused at once, before its body. Every send is bounded in bytes and time.
Real processes because what is measured is a router process's resident memory (with its data planes),
and the kernel's socket buffers between it and the caller; in-process, the test's own memory would blur it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests._router_fixtures import ADMIN_KEY, auth, start_router
from tests.procs import ManagedProcess, http_json

API_KEY = "front-door-key"
BODY_BYTES = 20_000_000
PIPELINED = 30
#: How long the flood is offered: far longer than the router needs to read what it would buffer.
FLOOD_S = 3.0


@dataclass
class Router:
    proc: ManagedProcess
    url: str
    host: str
    port: int


@pytest.fixture(scope="module")
def worker_urls(worker_fleet) -> list[str]:
    return list(worker_fleet(1, extra_args=["--admin-api-key", ADMIN_KEY]).urls)


@pytest.fixture(scope="module", params=["lean", "aiohttp"])
def router(request: pytest.FixtureRequest, worker_urls: list[str]) -> Iterator[Router]:
    flags = ["--api-key", API_KEY, "--data-plane-processes", "2", "--generation-server", request.param]
    proc, url = start_router(worker_urls, admin_key=ADMIN_KEY, extra_args=flags)
    host, port = url.removeprefix("http://").split(":")
    try:
        yield Router(proc, url, host, int(port))
    finally:
        proc.stop()


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rpartition(")")[2].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo.extend(children.get(current, []))
        try:
            status = Path(f"/proc/{current}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def settled_tree_rss(pid: int, *, within: int = 2 << 20, timeout_s: float = 30.0) -> int:
    """``tree_rss_bytes`` once two readings half a second apart agree within ``within`` bytes.

    A data plane that is still importing when the first one answers grows by tens of megabytes; that
    growth is start-up, not what the caller made the router hold, so the baseline waits for it.
    """
    deadline = time.monotonic() + timeout_s
    last = tree_rss_bytes(pid)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = tree_rss_bytes(pid)
        if abs(now - last) <= within:
            return now
        last = now
    raise AssertionError(f"the router's memory did not settle within {timeout_s} s (last {last} bytes)")


def head(length: int, *, key: str | None = API_KEY) -> bytes:
    auth_line = f"Authorization: Bearer {key}\r\n" if key else ""
    return (
        f"POST /generate HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n{auth_line}"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def generate_body(size: int) -> bytes:
    """A /generate body of exactly ``size`` bytes (its text padded)."""
    shell = b'{"text": "", "sampling_params": {"max_new_tokens": 1}}'
    return shell.replace(b'"text": ""', b'"text": "' + b"a" * (size - len(shell)) + b'"')


def offer(sock: socket.socket, data: bytes, until: float) -> int:
    """Send what the connection takes before ``until``; the bytes it took."""
    sent = 0
    view = memoryview(data)
    while sent < len(data) and time.monotonic() < until:
        try:
            sent += sock.send(view[sent : sent + (1 << 20)])
        except (TimeoutError, BlockingIOError):
            continue
        except OSError:  # the router closed the connection
            break
    return sent


def test_a_connection_pipelining_large_bodies_behind_a_parked_request_grows_the_router_by_two_bodies_at_most(
    router: Router,
) -> None:
    status, body = http_json("POST", router.url + "/pause_generation", {"mode": "in_place"}, headers=auth())
    assert status == 200, body
    sock = socket.create_connection((router.host, router.port), timeout=0.2)
    try:
        parked = generate_body(200)
        sock.sendall(head(len(parked)) + parked)
        # The router reads it and sends it to the paused worker, which parks it; the baseline is taken
        # once that (and every data plane's start-up) has settled.
        before = settled_tree_rss(router.proc.proc.pid)  # type: ignore[union-attr]
        big = generate_body(BODY_BYTES)
        deadline = time.monotonic() + FLOOD_S
        offered = 0
        for _ in range(PIPELINED):
            offered += offer(sock, head(len(big)) + big, deadline)
            if time.monotonic() >= deadline:
                break
        grown = tree_rss_bytes(router.proc.proc.pid) - before  # type: ignore[union-attr]
        # The router read one request's worth (its head and 64 KiB of body) and then left the rest in the
        # socket: the kernel's buffers, not the router's memory, hold what the caller got in.
        assert offered < 3 * BODY_BYTES, f"the router kept reading: {offered} bytes taken"
        assert grown <= 2 * BODY_BYTES, f"the router grew by {grown} bytes ({offered} bytes taken)"
    finally:
        sock.close()
        status, body = http_json("POST", router.url + "/continue_generation", {}, headers=auth())
        assert status == 200, body


def test_a_caller_without_a_key_is_refused_at_its_head_before_its_body(router: Router) -> None:
    before = settled_tree_rss(router.proc.proc.pid)  # type: ignore[union-attr]
    for key in (None, "wrong"):
        with socket.create_connection((router.host, router.port), timeout=5) as sock:
            sock.sendall(head(50_000_000, key=key) + b"{")
            started = time.monotonic()
            answer = b""
            while b"\r\n\r\n" not in answer:
                chunk = sock.recv(65536)
                assert chunk, f"closed without an answer: {answer!r}"
                answer += chunk
            assert time.monotonic() - started < 3, "the answer waited for the body"
            status_line, _, rest = answer.partition(b"\r\n")
            assert b" 401 " in status_line, answer
            assert b"connection: close" in rest.lower()
            # The body it announced is never read: the router closes the connection after its answer.
            sock.settimeout(5)
            while chunk := sock.recv(65536):
                answer += chunk
            assert b"Bearer" in answer and json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["message"]
    assert tree_rss_bytes(router.proc.proc.pid) - before < BODY_BYTES  # type: ignore[union-attr]
