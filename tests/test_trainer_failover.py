"""The trainer client sends a call again through a router failover only when nothing ran.

Against small loopback servers that answer as a router replica would: a standby's 503 (with
``X-Omni-Router-Role: standby``), a refused connection, a connection closed after the request was
read, a plain 503. Both clients, blocking and asyncio. The real failover (two ``omni-router``
processes, the leader killed) is in ``tests/test_router_standby.py``.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import socketserver
import threading
import urllib.error
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from router.trainer import AsyncRouterClient, RouterCallError, RouterClient
from router.trainer.failover import TransportFailed, may_send_again, never_connected
from tests.procs import free_port

RECORD = {"id": "w-1", "url": "http://127.0.0.1:1", "health": "healthy", "disabled": False, "inflight": 0}


@contextmanager
def serving(server: socketserver.BaseServer) -> Iterator[None]:
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


class Replica(ThreadingHTTPServer):
    """Answers ``standby_first`` calls with a standby's 503, then as the leader; counts the calls."""

    daemon_threads = True

    def __init__(self, standby_first: int, *, header: bool = True):
        self.standby_first, self.header, self.calls = standby_first, header, 0
        super().__init__(("127.0.0.1", 0), _ReplicaHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _ReplicaHandler(BaseHTTPRequestHandler):
    server: Replica

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.calls += 1
        if self.server.calls <= self.server.standby_first:
            status, body = 503, {"error": {"message": "this omni-router replica is a standby; the leader is a"}}
        elif self.command == "GET":
            status, body = 200, {"workers": []}
        else:
            status, body = 201, RECORD
        data = json.dumps(body).encode()
        self.send_response(status)
        if status == 503 and self.server.header:
            self.send_header("X-Omni-Router-Role", "standby")
            self.send_header("Retry-After", "1")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


class HangsUp(socketserver.ThreadingTCPServer):
    """Reads a request whole, then closes the connection without answering (the leader died mid-call)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        self.calls = 0
        super().__init__(("127.0.0.1", 0), _HangUpHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _HangUpHandler(socketserver.StreamRequestHandler):
    server: HangsUp

    def handle(self) -> None:
        self.connection.settimeout(5)
        length = 0
        for line in iter(self.rfile.readline, b"\r\n"):
            if not line:
                return
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        self.rfile.read(length)
        self.server.calls += 1


def retries(caplog: pytest.LogCaptureFixture) -> int:
    return sum("through the failover" in r.getMessage() for r in caplog.records)


def test_what_proves_that_nothing_was_sent() -> None:
    assert never_connected(ConnectionRefusedError())
    assert never_connected(urllib.error.URLError(ConnectionRefusedError(111, "Connection refused")))
    assert never_connected(socket.gaierror(-2, "Name or service not known"))
    assert not never_connected(http.client.RemoteDisconnected("closed"))
    assert not never_connected(ConnectionResetError())
    assert not never_connected(TimeoutError())
    sent = TransportFailed(ConnectionResetError(), maybe_sent=True)
    assert may_send_again("GET", sent) and not may_send_again("POST", sent)
    assert may_send_again("POST", TransportFailed(ConnectionRefusedError(), maybe_sent=False))
    assert not may_send_again("POST", RuntimeError())


def test_a_standbys_refusal_is_sent_again_until_the_leader_answers(caplog) -> None:
    caplog.set_level(logging.INFO, logger="router.trainer.failover")
    with Replica(standby_first=2) as replica, serving(replica):
        client = RouterClient(replica.url, failover_budget_s=10)
        assert client.add_worker("http://127.0.0.1:1").id == "w-1"  # a POST: nothing ran on the standby
        assert replica.calls == 3 and retries(caplog) == 2


def test_past_the_budget_the_standbys_refusal_is_the_answer() -> None:
    with Replica(standby_first=10**6) as replica, serving(replica):
        with pytest.raises(RouterCallError) as refused:
            RouterClient(replica.url, failover_budget_s=0.5).list_workers()
        assert refused.value.status == 503 and "standby" in refused.value.message
        assert replica.calls >= 2


def test_a_plain_503_is_not_a_failover() -> None:
    with Replica(standby_first=1, header=False) as replica, serving(replica):
        with pytest.raises(RouterCallError) as refused:
            RouterClient(replica.url, failover_budget_s=10).add_worker("http://127.0.0.1:1")
        assert refused.value.status == 503 and replica.calls == 1


def test_a_refused_connection_is_sent_again_within_the_budget(caplog) -> None:
    caplog.set_level(logging.INFO, logger="router.trainer.failover")
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens
    with pytest.raises(RouterCallError) as failed:
        RouterClient(url, failover_budget_s=1.0).add_worker("http://127.0.0.1:1")
    assert failed.value.status is None and "Connection refused" in failed.value.message
    assert retries(caplog) >= 2


def test_a_call_that_may_have_reached_the_leader_is_sent_again_only_if_it_reads(caplog) -> None:
    caplog.set_level(logging.INFO, logger="router.trainer.failover")
    with HangsUp() as server, serving(server):
        client = RouterClient(server.url, failover_budget_s=1.0)
        with pytest.raises(RouterCallError) as failed:
            client.add_worker("http://127.0.0.1:1")
        assert failed.value.status is None and server.calls == 1 and retries(caplog) == 0
        with pytest.raises(RouterCallError):
            client.list_workers()
        assert server.calls >= 3 and retries(caplog) >= 1


async def test_the_asyncio_client_rides_through_a_failover_too() -> None:
    with Replica(standby_first=2) as replica, serving(replica):
        async with AsyncRouterClient(replica.url, failover_budget_s=10) as client:
            assert (await client.add_worker("http://127.0.0.1:1")).id == "w-1"
        assert replica.calls == 3
    async with AsyncRouterClient(f"http://127.0.0.1:{free_port()}", failover_budget_s=0.5) as client:
        with pytest.raises(RouterCallError) as failed:
            await client.add_worker("http://127.0.0.1:1")
    assert failed.value.status is None
    with HangsUp() as server, serving(server):
        async with AsyncRouterClient(server.url, failover_budget_s=1.0) as client:
            with pytest.raises(RouterCallError):
                await client.add_worker("http://127.0.0.1:1")
        assert server.calls == 1
