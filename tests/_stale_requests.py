"""Requests kept in flight through a router, then a pause: what the stale-request tests send and read.

Each request goes on its own connection, answered in a thread, so the kernel spreads them over a
router's data-plane processes; every wait is bounded.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from router.contract.vllm_tokens import GENERATE_PATH as TOKENS_PATH
from tests._router_fixtures import ADMIN_KEY, auth, wait_for, workers
from tests.procs import ManagedProcess, http_json

#: With the workers' slow decode step, long enough that every request is still decoding at the pause.
TOKENS = 150


@dataclass
class Sent:
    """One request sent on its own connection, answered in a thread."""

    rid: str
    policy: str | None
    stream: bool = False
    prompt: dict[str, Any] = field(default_factory=lambda: {"text": "stale or not"})
    tokens_route: bool = False
    """vLLM's ``/inference/v1/generate`` (named by ``request_id``) instead of SGLang's ``/generate`` (by ``rid``)."""
    status: int | None = None
    body: bytes = b""
    error: str | None = None


def send(url: str, sent: Sent) -> None:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    headers = {"Content-Type": "application/json"}
    if sent.policy is not None:
        headers["X-Version-Policy"] = sent.policy
    if sent.tokens_route:
        path = TOKENS_PATH
        sampling = {"max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True}
        body = {"token_ids": [1, 2, 3], "request_id": sent.rid, "stream": sent.stream, "sampling_params": sampling}
    else:
        path = "/generate"
        sampling = {"max_new_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True}
        body = {**sent.prompt, "rid": sent.rid, "stream": sent.stream, "sampling_params": sampling}
    try:
        conn.request("POST", path, json.dumps(body), headers)
        resp = conn.getresponse()
        sent.status, sent.body = resp.status, resp.read()
    except OSError as exc:
        sent.error = repr(exc)
    finally:
        conn.close()


def answered(sent: Sent) -> bool:
    return sent.status is not None or sent.error is not None


def inflight(url: str) -> int:
    return sum(w["inflight"] for w in workers(url, ADMIN_KEY))


def aborted_total(url: str) -> float:
    status, text = http_json("GET", url + "/metrics", timeout=30)
    assert status == 200
    found = re.search(r"^omni_router_stale_requests_aborted_total (\S+)$", text, re.MULTILINE)
    assert found is not None, "the counter is exported"
    return float(found.group(1))


def send_then_pause(
    router: ManagedProcess, url: str, requests: list[Sent], mode: str | None, pause: str = "/pause_generation"
) -> list[threading.Thread]:
    """Send ``requests``, wait until all are in flight through the router, pause in ``mode`` (with ``pause``; ``None``:
    a pause route that takes no mode); the callers' threads."""
    threads = [threading.Thread(target=send, args=(url, r), daemon=True) for r in requests]
    for t in threads:
        t.start()
    wait_for(lambda: inflight(url) == len(requests), 60, router, f"{len(requests)} requests in flight")
    body = {} if mode is None else {"mode": mode}
    status, answer = http_json("POST", url + pause, body, headers=auth(), timeout=60)
    assert status == 200, answer
    return threads


def continue_and_join(url: str, threads: list[threading.Thread], resume: str = "/continue_generation") -> None:
    status, answer = http_json("POST", url + resume, {}, headers=auth(), timeout=60)
    assert status == 200, answer
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "every caller has its answer"


def stale_error(sent: Sent) -> dict[str, Any]:
    """The 409 body a dropped caller got, or the error event that ended its stream."""
    if not sent.stream:
        assert sent.status == 409, (sent.rid, sent.status, sent.body[:300])
        return dict(json.loads(sent.body))
    assert sent.status == 200, (sent.rid, sent.status)
    events = [line.removeprefix(b"data: ") for line in sent.body.split(b"\n\n") if line.startswith(b"data: ")]
    assert events and b"[DONE]" not in events, "the stream ends with the error, not as if finished"
    return dict(json.loads(events[-1]))
