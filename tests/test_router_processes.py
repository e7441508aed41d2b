"""A router with data-plane processes: one control process, two data planes on one port (SO_REUSEPORT).

Real workers, a real router; the kernel spreads connections over the data planes, so every check
that must hold "in every process" is made over many connections. Load is bounded in count and
time and stops by itself.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from router.gateway.fleet.registry import normalize_url, worker_id_for
from tests._router_fixtures import (
    ADMIN_KEY,
    auth,
    make_tiny_checkpoint,
    start_router,
    start_workers,
    wait_for,
    workers,
)
from tests.procs import ManagedProcess, http_json

ACK_TIMEOUT_S = 2.0
#: While a data plane is stopped, the live one answers an admin call once the fence's acknowledgement
#: has timed out (ACK_TIMEOUT_S); a call still unanswered this long after landed on the stopped one.
STOPPED_PLANE_CALL_S = 2 * ACK_TIMEOUT_S + 1
DATA_PLANES = ["--data-plane-processes", "2", "--data-plane-ack-timeout-s", str(ACK_TIMEOUT_S)]


@dataclass
class Fleet:
    worker_urls: list[str]
    router: ManagedProcess
    url: str
    ids: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def fleet(worker_fleet) -> Iterator[Fleet]:
    urls = worker_fleet(2, extra_args=["--admin-api-key", ADMIN_KEY, "--step-delay-ms", "20"]).urls
    router, url = start_router(urls, admin_key=ADMIN_KEY, extra_args=DATA_PLANES)
    try:
        yield Fleet(urls, router, url, [worker_id_for(normalize_url(u)) for u in urls])
    finally:
        router.stop()


def data_plane_pids(router: ManagedProcess) -> dict[int, int]:
    """The latest pid of each data plane, from the control process's log."""
    pids: dict[int, int] = {}
    for index, pid in re.findall(r"data-plane process (\d+) started \(pid (\d+)\)", router.log_text(200_000)):
        pids[int(index)] = int(pid)
    return pids


def generate(url: str, timeout: float = 60, session: str | None = None) -> tuple[int, str | None]:
    """One /generate on a new connection (so the kernel picks a data plane for each)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    headers = {"Content-Type": "application/json"} | ({"X-Session-Id": session} if session else {})
    try:
        body = {"text": "hello", "sampling_params": {"max_new_tokens": 1 if session else 4, "temperature": 0.0}}
        conn.request("POST", "/generate", json.dumps(body), headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status, resp.getheader("X-Omni-Worker")
    finally:
        conn.close()


def admin_call(url: str, path: str, body: Any, *, attempts: int = 12, timeout: float = 3 * ACK_TIMEOUT_S + 4) -> Any:
    """An admin call on a new connection; one that lands on a stopped data plane times out and is
    sent again (that process never read it, so it never reached the control process). The kernel spreads
    new connections over the two processes at random: 12 attempts all land on the stopped one once in
    4,096 runs (6 did once in 64)."""
    for _ in range(attempts):
        try:
            return http_json("POST", url + path, body, headers=auth(), timeout=timeout)
        except TimeoutError:
            continue
    raise AssertionError(f"{path}: no data plane answered in {attempts} attempts")


class Load:
    """Client threads sending /generate, each on its own connections, until stopped (bounded)."""

    def __init__(self, url: str, threads: int, limit_s: float):
        self.url = url
        self.records: list[tuple[float, int, str | None]] = []
        self.errors: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._deadline = time.monotonic() + limit_s
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _run(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            sent = time.monotonic()
            try:
                status, worker = generate(self.url, timeout=30)
            except OSError as exc:
                self.errors.append((sent, repr(exc)))
                continue
            self.records.append((sent, status, worker))


def test_generation_admin_and_metrics_through_every_process(fleet):
    served = {generate(fleet.url)[1] for _ in range(12)}
    assert served == set(fleet.ids)
    assert len(data_plane_pids(fleet.router)) == 2
    # Admin routes reach the control process whichever process accepted the connection.
    for _ in range(6):
        status, body = http_json("GET", fleet.url + "/workers", headers=auth())
        assert status == 200 and len(body["workers"]) == 2
        status, body = http_json("GET", fleet.url + "/workers")
        assert status == 401, body
    status, body = http_json("POST", fleet.url + "/flush_cache", {}, headers=auth(), timeout=30)
    assert status == 200, body
    # The internal hub route is not reachable from outside.
    status, _ = http_json("GET", fleet.url + "/_omni/data-plane?index=0", headers=auth())
    assert status == 404
    # One exposition for the whole router: the /generate count is the sum over both data planes.
    before = _generate_count(fleet.url)
    for _ in range(10):
        assert generate(fleet.url)[0] == 200
    assert _generate_count(fleet.url) - before == 10
    text = urllib.request.urlopen(fleet.url + "/metrics", timeout=10).read().decode()
    assert "/{tail}" not in text  # relayed requests are counted once, by the control process
    assert "omni_router_worker_health" in text


def _handed_count(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(r"^omni_router_admin_connections_handed_total ([0-9.e+]+)", text, re.M))


def _exchange(conn: http.client.HTTPConnection, method: str, path: str, body: Any = None, **headers: str) -> Any:
    payload = None if body is None else json.dumps(body)
    conn.request(method, path, payload, {"Content-Type": "application/json", **auth(), **headers})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read() or b"null"), resp.getheader("X-Omni-Worker")


def test_a_data_plane_s_lean_server_streams_and_hands_other_routes_to_aiohttp_on_one_connection(fleet):
    """Generation through a data plane's lean server (no ``Server`` header: aiohttp names itself), a stream in
    chunks from a real worker, then a data plane's own route on the same connection, served by aiohttp."""
    host, port = fleet.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        body = {"text": "hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}}
        conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        answer = json.loads(resp.read())
        assert resp.status == 200 and resp.getheader("Server") is None and answer["meta_info"]["weight_version"]
        conn.request("POST", "/generate", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("Transfer-Encoding") == "chunked"
        events = [e for e in resp.read().decode().split("\n\n") if e.startswith("data: ")]
        assert len(events) >= 2 and events[-1] == "data: [DONE]", events
        conn.request("GET", "/liveness")
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read()) == {"status": "alive"}
        assert "aiohttp" in (resp.getheader("Server") or "")
        conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["text"] == answer["text"]  # greedy: the same text
    finally:
        conn.close()


@pytest.mark.parametrize("server", ["lean", "aiohttp"])
def test_the_one_process_serves_generation_from_the_server_its_flag_names(fleet, server):
    """A process of its own: the flag is read by the CLI, which picks the site the process listens on."""
    router, url = start_router(
        fleet.worker_urls, admin_key=ADMIN_KEY, extra_args=["--generation-server", server], wait_healthy=2
    )
    try:
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        body = {"text": "hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
        conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["meta_info"]["weight_version"]
        assert ("aiohttp" in (resp.getheader("Server") or "")) == (server == "aiohttp")
        conn.close()
    finally:
        router.stop()


def test_a_trainer_s_admin_connection_moves_to_the_control_process_and_keeps_serving(fleet):
    """The first admin POST on a keep-alive connection hands the connection to the control process (counted
    once); every later call on the same socket, admin, reads and generation alike, is answered there as
    before. Reads, and a call that asks to close, are relayed and leave their connection where it was."""
    host, port = fleet.url.removeprefix("http://").split(":")
    before = _handed_count(fleet.url)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        assert _exchange(conn, "GET", "/workers")[0] == 200  # a read: relayed, not handed over
        local = conn.sock.getsockname()
        for _ in range(3):
            status, body, _ = _exchange(conn, "POST", "/flush_cache", {})
            assert status == 200 and body["worker_count"] == 2, body
        status, body, _ = _exchange(conn, "POST", "/pause_generation", {"mode": "in_place"})
        assert status == 200, body
        assert _exchange(conn, "POST", "/continue_generation", {})[0] == 200
        status, body, worker = _exchange(
            conn, "POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
        )
        assert status == 200 and worker in fleet.ids and body["meta_info"]["completion_tokens"] == 2
        assert _exchange(conn, "GET", "/workers")[0] == 200
        assert conn.sock.getsockname() == local  # one socket throughout: nothing was dropped or reopened
        conn.request("POST", "/flush_cache", "{}", {"Content-Type": "application/json"})  # no key: refused there
        refused = conn.getresponse()
        assert refused.status == 401 and b"error" in refused.read()
        assert refused.getheader("Connection") == "close"  # refused at its head: its body is never read
    finally:
        conn.close()
    assert _handed_count(fleet.url) - before == 1
    closing = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        status, body, _ = _exchange(closing, "POST", "/flush_cache", {}, Connection="close")
        assert status == 200, body
    finally:
        closing.close()
    large = http.client.HTTPConnection(host, int(port), timeout=30)
    try:  # over the hand-over's 60 KiB: relayed, whatever the answer
        status, body, _ = _exchange(large, "POST", "/flush_cache", {"padding": "x" * 70_000})
        assert status in (200, 400, 502), body
        assert _exchange(large, "GET", "/workers")[0] == 200  # the relayed connection still serves
    finally:
        large.close()
    assert _handed_count(fleet.url) - before == 1


def _generate_count(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    pattern = r'omni_router_requests_total\{method="POST",route="/generate",status="200"\} ([0-9.e+]+)'
    return sum(float(v) for v in re.findall(pattern, text))


def test_every_data_plane_sends_a_session_where_the_one_table_pinned_it(fleet):
    """No session split across data planes, with the tightest load bound (ε = 0: a process with a table of
    its own diverts sessions at every other placement, differently from its sibling)."""
    extra = [*DATA_PLANES, "--session-affinity", "--session-affinity-load-factor", "0"]
    router, url = start_router(fleet.worker_urls, admin_key=ADMIN_KEY, extra_args=extra)
    try:
        sessions, turns = 24, 4
        served: dict[str, set[str | None]] = {f"s{i}": set() for i in range(sessions)}

        def run(names: list[str]) -> None:
            for _ in range(turns):
                for name in names:
                    status, worker = generate(url, timeout=30, session=name)
                    assert status == 200
                    served[name].add(worker)

        names = sorted(served)
        threads = [threading.Thread(target=run, args=(names[i::4],), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        assert {name: len(ws) for name, ws in served.items() if len(ws) != 1} == {}
        placed = [next(iter(ws)) for ws in served.values()]
        assert {placed.count(w) for w in fleet.ids} == {sessions // 2}  # ε = 0: exactly even
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        assert _sample(text, "omni_router_affinity_new_pins_total") == sessions
        assert _sample(text, "omni_router_affinity_hits_total") == sessions * (turns - 1)
        assert _sample(text, "omni_router_affinity_local_placements_total") == 0
    finally:
        router.stop()


def _sample(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name} ([0-9.e+]+)$", text, re.MULTILINE))


def test_a_worker_taken_out_gets_nothing_once_the_call_answered(fleet):
    """0 requests to a disabled worker from any process once ``PUT /workers/{id}`` answered."""
    target = fleet.ids[0]
    with Load(fleet.url, threads=4, limit_s=20) as load:
        wait_for(lambda: len(load.records) >= 8, 20, what="load running")
        status, body = http_json("PUT", f"{fleet.url}/workers/{target}", {"disabled": True}, headers=auth(), timeout=30)
        answered = time.monotonic()
        assert status == 200 and body["disabled"], body
        wait_for(lambda: sum(1 for r in load.records if r[0] > answered) >= 40, 20, what="load after the fence")
    try:
        after = [r for r in load.records if r[0] > answered]
        assert all(status == 200 for _, status, _ in after)
        assert [r for r in after if r[2] == target] == []
        assert not load.errors
    finally:
        status, body = http_json("PUT", f"{fleet.url}/workers/{target}", {"disabled": False}, headers=auth())
        assert status == 200, body


def test_an_unacknowledged_fence_fails_closed_and_the_process_is_restarted(fleet):
    pids = data_plane_pids(fleet.router)
    stopped = pids[0]
    os.kill(stopped, signal.SIGSTOP)
    try:
        status, body = admin_call(fleet.url, "/pause_generation", {"mode": "abort"}, timeout=STOPPED_PLANE_CALL_S)
        assert status == 503, body
        assert "did not acknowledge" in body["error"]["message"] and "nothing was sent" in body["error"]["message"]
        # Nothing reached the workers, nothing stays fenced or journaled.
        for worker_url in fleet.worker_urls:
            _, info = http_json("GET", worker_url + "/model_info", headers=auth())
            assert info["is_paused"] is False
        assert not any(w["disabled"] for w in workers(fleet.url, ADMIN_KEY))
        _, journal = http_json("GET", fleet.url + "/weight_update_journal", headers=auth())
        assert journal["pending"] is None
    finally:
        try:
            os.kill(stopped, signal.SIGCONT)
        except ProcessLookupError:
            pass  # killed by the supervisor, as it should be
    wait_for(lambda: data_plane_pids(fleet.router).get(0) not in (None, stopped), 30, fleet.router, "a restart")
    wait_for(lambda: _both_serve(fleet), 30, fleet.router, "the new data plane serving")
    status, body = admin_call(fleet.url, "/pause_generation", {"mode": "abort"})
    assert status == 200, body
    status, body = admin_call(fleet.url, "/continue_generation", {})
    assert status == 200, body


def _both_serve(fleet: Fleet) -> bool:
    return all(generate(fleet.url, timeout=5)[0] == 200 for _ in range(6))


def test_a_killed_data_plane_loses_only_its_own_requests(fleet):
    with Load(fleet.url, threads=4, limit_s=25) as load:
        wait_for(lambda: len(load.records) >= 8, 20, what="load running")
        victim = data_plane_pids(fleet.router)[1]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: _exited(victim), 10, fleet.router, "the killed data plane to exit")
        killed = time.monotonic()  # from here on its sockets are closed
        wait_for(lambda: data_plane_pids(fleet.router).get(1) != victim, 30, fleet.router, "a restart")
        wait_for(lambda: sum(1 for r in load.records if r[0] > killed + 2) >= 20, 25, what="load after the restart")
    # Only requests that met the dying process failed, and none sent after it was gone: per client thread, the
    # one in flight at the kill and at most one more sent while it was exiting (its listening socket still took
    # the connection, into a queue nobody would read).
    failed = load.errors + [(sent, str(status)) for sent, status, _ in load.records if status != 200]
    assert len(failed) <= 2 * 4, failed
    assert all(sent <= killed for sent, _ in failed), failed


def _exited(pid: int) -> bool:
    """``pid`` has exited, every thread of it (gone, or all zombies its parent has not reaped yet): its
    files, the listening socket among them, are closed. The leader thread turns zombie before the others
    have finished exiting, and the socket stays open until the last one has."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except (FileNotFoundError, ProcessLookupError):  # /proc answers ESRCH for a process going away
        return True
    for task in tasks:
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue  # that thread is gone (or going: its stat then reads ESRCH)
        if state not in ("Z", "X"):
            return False
    return True


@pytest.mark.process
def test_sigterm_drains_every_process_and_stops_them_all(tmp_path):
    model = make_tiny_checkpoint(tmp_path / "model")
    procs = start_workers(model, 1, extra_args=["--step-delay-ms", "20"])
    router, url = start_router([procs[0][1]], extra_args=[*DATA_PLANES, "--shutdown-grace-s", "20"])
    try:
        pids = data_plane_pids(router)
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        body = {"text": "hello", "stream": True, "sampling_params": {"max_new_tokens": 60, "temperature": 0.0}}
        conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        assert router.proc is not None
        router.proc.send_signal(signal.SIGTERM)
        # The stream in flight runs to its end on whichever data plane serves it.
        events = [line for line in resp.read().split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]"
        last = json.loads(events[-2].removeprefix(b"data: "))
        assert last["meta_info"]["finish_reason"]["type"] == "length"
        assert router.proc.wait(timeout=60) == 0
        for pid in pids.values():
            wait_for(lambda pid=pid: not _alive(pid), 10, what=f"data plane {pid} gone")
    finally:
        router.stop()
        for proc, _ in procs:
            proc.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
