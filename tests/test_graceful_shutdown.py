"""Graceful shutdown on SIGTERM, as Kubernetes stops a pod (SIGTERM, then SIGKILL after the grace).

Real ``omni-router`` and ``omni-worker`` processes on loopback. Requests are kept in flight
deterministically by sending them to a paused worker rather than by timing: they finish only once
the test continues generation, or end because they were cut or aborted.

- Router: stops listening at once, lets the requests in flight (streaming too) finish within
  ``--shutdown-grace-s``, cancels what is left at the grace (and aborts it on its worker), exits 0.
- Worker: new ``/generate`` gets 503 and ``/health`` 503 ``draining`` at once, ``/liveness`` stays
  200; running requests finish within the grace or end aborted; it leaves its weight-update group
  and exits 0.

The only timed assertions are bounds: a process exits within its grace plus a generous margin.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from router.trainer.rendezvous import alongside
from router.trainer.sender import TrainerWeightSender
from tests._router_fixtures import start_router, wait_for
from tests._tiers import process_fixture
from tests._worker_helpers import Worker
from tests.procs import ManagedProcess, cli, free_port, http_json

#: Added to a grace for "the process exited in time": a bound against hangs, not a timing claim.
MARGIN_S = 20.0
SHUTTING_DOWN = {"error": {"message": "the worker is shutting down"}}
TOKENS = 12
#: Far more tokens than a request decodes within any grace used here.
LONG = 400


# -- helpers ---------------------------------------------------------------------------------------


def _body(max_new_tokens: int, *, stream: bool = False) -> dict[str, Any]:
    return {
        "text": "graceful",
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
        "stream": stream,
    }


def call(url: str, body: dict[str, Any], timeout: float = 90.0) -> tuple[int | None, Any, bool]:
    """POST ``/generate``: (status, the answer, whether it arrived whole). A streamed answer is the list
    of its ``data:`` payloads, whole when it ended with ``[DONE]``; a broken connection gives what came."""
    parsed = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout)
    status: int | None = None
    events: list[Any] = []
    try:
        conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        status = resp.status
        if not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            return status, json.loads(resp.read()), True
        done = False
        for raw in resp:  # to the end of the body: a client that hangs up at [DONE] races the last chunk
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
        return status, events, done
    except (http.client.HTTPException, OSError, ValueError):
        return status, events, False
    finally:
        conn.close()


def final(answer: Any) -> dict[str, Any]:
    """The last state of one prompt's answer, streamed or not."""
    return answer[-1] if isinstance(answer, list) else answer


def exited_within(proc: ManagedProcess, timeout: float) -> int:
    assert proc.proc is not None
    try:
        return proc.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{proc.name} did not exit within {timeout:g}s of SIGTERM:\n{proc.log_text()}")


def sigterm(proc: ManagedProcess) -> None:
    assert proc.proc is not None
    os.killpg(proc.proc.pid, signal.SIGTERM)


def refuses_connections(url: str) -> bool:
    parsed = urllib.parse.urlparse(url)
    try:
        socket.create_connection((parsed.hostname, parsed.port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def in_flight(futures: list[Future[Any]]) -> bool:
    return not any(f.done() for f in futures)


def _spawn(model: Path, *args: str) -> Worker:
    port = free_port()
    argv = [cli("omni-worker"), "--model-path", str(model), "--host", "127.0.0.1", "--port", str(port)]
    proc = ManagedProcess(f"worker-{port}", [*argv, "--num-threads", "1", *args]).start()
    return Worker(proc, f"http://127.0.0.1:{port}", model)


@process_fixture(scope="module")
def fleet(checkpoints: dict[str, Path]) -> Iterator[dict[str, Worker]]:
    """Every worker this module needs, started together (torch's import dominates start-up)."""
    model = checkpoints["llama"]
    workers = {
        "behind_router": _spawn(model),
        "drains": _spawn(model),
        "cut": _spawn(model, "--step-delay-ms", "20", "--shutdown-grace-s", "1"),
        "in_group": _spawn(model),
    }
    try:
        for w in workers.values():
            w.proc.wait_http_ready(w.url + "/health", timeout=120)
        yield workers
    finally:
        for w in workers.values():
            w.proc.kill()


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=8) as executor:
        yield executor


def _held(worker: Worker, pool: ThreadPoolExecutor, url: str, bodies: list[dict[str, Any]]) -> list[Future[Any]]:
    """Send ``bodies`` to ``url`` while ``worker`` is paused: they are admitted (a stream has its
    headers) and queued, and cannot end before the test continues generation, or by a cut or abort.
    The pause goes through ``url``: a router continues a worker paused behind its back."""
    status, body = http_json("POST", url + "/pause_generation", {"mode": "in_place"}, timeout=30)
    assert status == 200, body
    futures = [pool.submit(call, url, body) for body in bodies]
    count = len(bodies)
    worker.wait_state(lambda s: s["num_waiting_reqs"] == count, what=f"{count} requests held")
    return futures


# -- the router ---------------------------------------------------------------------------------


def resume_and_expect_whole_answers(worker: Worker, bodies: list[dict[str, Any]], futures: list[Future[Any]]) -> None:
    """Resume the paused worker: every held request must then finish whole (nothing lost to the drain)."""
    worker.ok("POST", "/continue_generation", {})
    for body, fut in zip(bodies, futures, strict=True):
        status, answer, whole = fut.result(timeout=60)
        assert status == 200 and whole, (body, answer)
        out = final(answer)
        assert len(out["output_ids"]) == TOKENS and out["meta_info"]["finish_reason"]["type"] == "length", out


def test_router_drains_requests_in_flight_and_refuses_new_connections(fleet, pool, tmp_path):
    worker = fleet["behind_router"]
    router, url = start_router([worker.url], state_dir=tmp_path)
    try:
        bodies = [_body(TOKENS, stream=i % 2 == 0) for i in range(4)]
        futures = _held(worker, pool, url, bodies)

        sigterm(router)
        wait_for(lambda: "stopped accepting connections" in router.log_text(), 10, router, "the router stops listening")
        assert refuses_connections(url)  # the listening socket is closed before that line is logged
        assert in_flight(futures)  # held on the paused worker: the router is waiting for them
        assert router.alive

        resume_and_expect_whole_answers(worker, bodies, futures)
        assert exited_within(router, 30 + MARGIN_S) == 0, router.log_text()
        assert "4 request(s) finished during the drain, 0 cancelled" in router.log_text(), router.log_text()
    finally:
        router.kill()
        worker.post("/continue_generation", {})


def test_router_cancels_what_outlasts_its_grace_and_aborts_it_on_the_worker(fleet, pool, tmp_path):
    worker = fleet["behind_router"]
    grace = 2.0
    router, url = start_router([worker.url], state_dir=tmp_path, extra_args=["--shutdown-grace-s", str(grace)])
    try:
        aborted_before = worker.state()["aborted_requests"]
        (fut,) = _held(worker, pool, url, [_body(LONG, stream=True)])  # it can end only by being cut

        sigterm(router)
        assert exited_within(router, grace + MARGIN_S) == 0, router.log_text()
        status, events, whole = fut.result(timeout=30)
        assert status == 200 and not whole, events  # the stream was cut, not finished
        log = router.log_text()
        assert "0 request(s) finished during the drain, 1 cancelled" in log and "aborted rid" in log, log
        # The proxy aborted the cancelled request on its worker before the router exited.
        state = worker.wait_state(lambda s: s["num_running_reqs"] == 0 and s["num_waiting_reqs"] == 0, 10)
        assert state["aborted_requests"] == aborted_before + 1, state
    finally:
        router.kill()
        worker.post("/continue_generation", {})


# -- the worker ---------------------------------------------------------------------------------


def test_worker_drains_refuses_new_requests_and_stays_live(fleet, pool):
    worker = fleet["drains"]
    bodies = [_body(TOKENS), _body(TOKENS), _body(TOKENS, stream=True)]
    futures = _held(worker, pool, worker.url, bodies)

    sigterm(worker.proc)
    # Readiness drops at once; liveness stays: Kubernetes takes the pod out of service, never kills it.
    wait_for(lambda: worker.get("/health", timeout=5)[0] == 503, 10, worker.proc, "/health 503")
    status, health = worker.get("/health", timeout=5)
    assert status == 503 and health["status"] == "draining", health
    status, live = worker.get("/liveness", timeout=5)
    assert status == 200 and live["status"] == "draining", live
    status, refused = worker.post("/generate", _body(TOKENS), timeout=10)
    assert status == 503 and refused == SHUTTING_DOWN, refused
    status, events, _ = call(worker.url, _body(TOKENS, stream=True), timeout=10)
    assert status == 503 and events == SHUTTING_DOWN, events
    assert in_flight(futures) and worker.proc.alive

    resume_and_expect_whole_answers(worker, bodies, futures)
    assert exited_within(worker.proc, 30 + MARGIN_S) == 0, worker.proc.log_text()
    assert "3 generation(s) finished, 0 aborted" in worker.proc.log_text(), worker.proc.log_text()


def test_worker_aborts_what_outlasts_its_grace(fleet, pool):
    worker = fleet["cut"]  # --shutdown-grace-s 1
    bodies = [_body(LONG), _body(LONG, stream=True)]
    futures = [pool.submit(call, worker.url, body) for body in bodies]
    worker.wait_running(2, min_steps=1)

    sigterm(worker.proc)
    for body, fut in zip(bodies, futures, strict=True):
        status, answer, whole = fut.result(timeout=1 + MARGIN_S)
        assert status == 200 and whole, (body, answer)  # an answer, not a hang or a broken connection
        out = final(answer)
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "shutting down" in reason["message"], out
        assert 0 < len(out["output_ids"]) < LONG, out
    assert exited_within(worker.proc, 1 + MARGIN_S) == 0, worker.proc.log_text()
    assert "0 generation(s) finished, 2 aborted" in worker.proc.log_text(), worker.proc.log_text()


def test_worker_in_a_weight_update_group_leaves_it_and_exits(fleet):
    worker = fleet["in_group"]
    sender = TrainerWeightSender(master_port=free_port(), world_size=2, group_name="shutdown_group", timeout_s=60)
    init = sender.init_request(1)

    def join() -> tuple[int, Any]:
        return worker.post("/init_weights_update_group", init, timeout=90)

    status, body = alongside(join, sender.join, timeout_s=90, what="init")
    assert status == 200 and body["success"], body
    try:
        sigterm(worker.proc)
        assert exited_within(worker.proc, MARGIN_S) == 0, worker.proc.log_text()
        log = worker.proc.log_text()
        assert "left weight-update group 'shutdown_group'" in log, log
    finally:
        sender.close()
