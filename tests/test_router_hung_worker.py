"""A worker that stops answering (SIGSTOP: what a hung kernel or a frozen process looks like).

The prober marks it dead within a few probe intervals; its requests in flight must not wait for
``--request-timeout-s`` (here 300 s, far beyond every wait below): those without an answer are
retried on the other worker, a stream already relaying ends with an error event.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from router.gateway.fleet.registry import normalize_url, worker_id_for
from tests._router_fixtures import start_router, start_workers, wait_for, workers
from tests.procs import ManagedProcess

pytestmark = pytest.mark.process

ROUTER_ARGS = [
    "--policy", "round_robin",
    "--health-check-timeout-s", "1",
    "--health-failure-threshold", "1",
    "--health-dead-threshold", "2",
    "--request-timeout-s", "300",
]  # fmt: skip
#: Far below --request-timeout-s: a request still waiting on the frozen worker would miss it.
CLIENT_TIMEOUT_S = 60
#: Milliseconds each worker sleeps after a forward step, so requests stay in flight long enough to
#: freeze a worker under them: 40 tokens on the first (the one the first test freezes) last 4 s. The
#: second is where requests move to; 200 streamed tokens still last 4 s there, and a request that
#: moved finishes sooner.
STEP_DELAY_MS = ("100", "20")


@pytest.fixture
def fleet(checkpoints) -> Iterator[tuple[list[tuple[ManagedProcess, str]], str]]:
    procs: list[tuple[ManagedProcess, str]] = []
    try:
        for delay in STEP_DELAY_MS:
            procs += start_workers(checkpoints["llama"], 1, extra_args=["--step-delay-ms", delay])
        router, url = start_router([u for _, u in procs], extra_args=ROUTER_ARGS)
        try:
            yield procs, url
        finally:
            for proc, _ in procs:
                if proc.proc is not None and proc.alive:
                    os.kill(proc.proc.pid, signal.SIGCONT)
            router.stop()
    finally:
        for proc, _ in procs:
            proc.stop()


def post_generate(url: str, *, stream: bool, tokens: int) -> http.client.HTTPResponse:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=CLIENT_TIMEOUT_S)
    body = {"text": "hello", "stream": stream, "sampling_params": {"max_new_tokens": tokens, "temperature": 0.0}}
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    return conn.getresponse()


def inflight(url: str) -> dict[str, int]:
    return {w["id"]: w["inflight"] for w in workers(url)}


def freeze(proc: ManagedProcess) -> None:
    assert proc.proc is not None
    os.kill(proc.proc.pid, signal.SIGSTOP)


def test_requests_without_an_answer_move_to_another_worker(fleet):
    procs, url = fleet
    frozen_proc, frozen_url = procs[0]
    frozen_id = worker_id_for(normalize_url(frozen_url))
    other_id = worker_id_for(normalize_url(procs[1][1]))
    answers: list[Any] = []

    def call() -> None:
        resp = post_generate(url, stream=False, tokens=40)
        answers.append((resp.status, resp.getheader("X-Omni-Worker"), json.loads(resp.read())))

    threads = [threading.Thread(target=call, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    # Round robin puts one on each worker; freeze the first while its request runs.
    wait_for(lambda: inflight(url)[frozen_id] >= 1, 20, what="a request in flight on the first worker")
    freeze(frozen_proc)
    for t in threads:
        t.join(CLIENT_TIMEOUT_S + 5)
    assert len(answers) == 2, "a request waited on the frozen worker"
    for status, worker, body in answers:
        assert status == 200, body
        assert worker == other_id
        assert len(body["output_ids"]) == 40
    assert {w["id"]: w["health"] for w in workers(url)}[frozen_id] == "dead"


def test_a_stream_already_relaying_ends_with_an_error_event(fleet):
    procs, url = fleet
    resp = post_generate(url, stream=True, tokens=200)
    assert resp.status == 200
    serving = resp.getheader("X-Omni-Worker")
    first = resp.readline()
    assert first.startswith(b"data: ")
    frozen = next(p for p, u in procs if worker_id_for(normalize_url(u)) == serving)
    freeze(frozen)
    events = [line for line in resp.read().split(b"\n") if line.startswith(b"data: ")]
    assert events, "the stream ended without a word"
    last = json.loads(events[-1].removeprefix(b"data: "))
    assert "stream broke" in last["error"]["message"]
