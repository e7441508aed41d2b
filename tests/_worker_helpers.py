"""Helpers for tests that talk to real ``omni-worker`` processes."""

from __future__ import annotations

import json
import socket
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.procs import ManagedProcess, http_json


def forking_pickle(obj: Any) -> str:
    """``obj`` pickled as SGLang's serializer sends tensors (torch's shared-memory reductions), base64:
    the tensors it holds must stay alive until the worker has read them."""
    import base64
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as mp

    mp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf, 2).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


@dataclass
class Worker:
    """A running worker and small helpers to talk to it."""

    proc: ManagedProcess
    url: str
    model_dir: Path
    headers: dict[str, str] | None = None

    def call(self, method: str, path: str, body: Any = None, *, timeout: float = 60.0, **kw: Any) -> tuple[int, Any]:
        headers = kw.pop("headers", self.headers)
        return http_json(method, self.url + path, body, headers=headers, timeout=timeout, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        return self.call("POST", path, body, **kw)

    def get(self, path: str, **kw: Any) -> tuple[int, Any]:
        return self.call("GET", path, **kw)

    def ok(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        status, data = self.call(method, path, body, **kw)
        assert status == 200, f"{method} {path} -> {status} {data}\n--- worker log ---\n{self.proc.log_text(3000)}"
        return data

    def refused(self, path: str, body: Any, *words: str) -> None:
        """``body`` on ``path`` is a 400 naming every one of ``words``, and the weights are unchanged."""
        before = self.checksum()
        status, answer = self.post(path, body)
        assert status == 400, (status, answer)
        message = answer["error"]["message"]
        for word in words:
            assert word in message, message
        assert self.checksum() == before

    def generate(self, prompt: Any = "hello", max_new_tokens: int = 16, **fields: Any) -> dict:
        timeout = fields.pop("timeout", 120)
        headers = fields.pop("headers", self.headers)
        sampling = {
            "max_new_tokens": max_new_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            **fields.pop("sampling", {}),
        }
        key = "input_ids" if isinstance(prompt, list) else "text"
        return self.ok(
            "POST", "/generate", {key: prompt, "sampling_params": sampling, **fields}, timeout=timeout, headers=headers
        )

    def state(self) -> dict:
        """Rank 0's scheduler counters from ``/server_info``."""
        return self.ok("GET", "/server_info")["internal_states"][0]

    def info(self) -> dict:
        return self.ok("GET", "/model_info")

    def checksum(self) -> str:
        return self.ok("POST", "/weights_checker", {"action": "checksum"})["per_gpu_checksum"]

    def wait_state(self, predicate: Callable[[dict], bool], timeout: float = 30.0, what: str = "condition") -> dict:
        """Poll ``/server_info`` until ``predicate`` holds (bounded)."""
        deadline = time.monotonic() + timeout
        state = self.state()
        while not predicate(state):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; last state {state}\n{self.proc.log_text(3000)}")
            time.sleep(0.02)
            state = self.state()
        return state

    def wait_running(self, count: int, min_steps: int = 3) -> dict:
        """Wait until ``count`` requests run and have made ``min_steps`` more steps."""
        state = self.wait_state(lambda s: s["num_running_reqs"] == count, what=f"{count} running requests")
        base = state["steps"]
        return self.wait_state(lambda s: s["steps"] >= base + min_steps, what="decode progress")


def result(fut: Future, timeout: float = 60.0) -> Any:
    """A future's ``(status, body)``; bounded."""
    return fut.result(timeout=timeout)


def sse_events(url: str, body: dict, headers: dict[str, str] | None = None, timeout: float = 60.0) -> list[Any]:
    """POST a streaming /generate and return the parsed ``data:`` payloads (``"[DONE]"`` kept as a string)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    events: list[Any] = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def open_raw_request(url: str, path: str, body: dict) -> socket.socket:
    """Send a POST on a raw socket and return it unread; closing it is a client going away."""
    parsed = urllib.parse.urlparse(url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((parsed.hostname, parsed.port), timeout=10)
    head = f"POST {path} HTTP/1.1\r\nHost: {parsed.hostname}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    return sock
