"""Start a real vLLM OpenAI server for the engine tests, on 127.0.0.1 and a free port, and stop it.

    with vllm_server(checkpoint, extra_args=[...], env={...}) as server:
        http_json("GET", server.url + "/health")

The server runs in the interpreter running the tests (the engine tier's virtualenv has vLLM and
this project installed), in its own process group, so stopping it also stops vLLM's engine-core
and worker processes. Readiness is ``GET /health`` polled with a bound; a server that exits or does
not become ready in time is killed and its log is attached to the error. The defaults fit a small
CPU-only machine (float32, a short context, 1 GiB of KV cache).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.procs import ManagedProcess, free_port

#: vLLM on 2 cores takes about 35 s to start when the machine is idle; several times that under load.
READY_TIMEOUT_S = 300.0
#: Enough for the tiny checkpoints of :mod:`tests.engines._checkpoints` on a machine with little memory.
SMALL_SERVER_ARGS = ("--dtype", "float32", "--max-model-len", "256", "--gpu-memory-utilization", "0.1")
SMALL_SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1"}


@dataclass(frozen=True)
class VllmServer:
    url: str
    model: str
    """The served model's name (vLLM names it by the path it was given)."""
    proc: ManagedProcess

    def log_text(self, tail: int = 6000) -> str:
        return self.proc.log_text(tail)


@contextmanager
def vllm_server(
    checkpoint: Path | str,
    *,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> Iterator[VllmServer]:
    """A vLLM server for ``checkpoint`` (the plugin's environment on), ready once ``/health`` answers 200;
    stopped on exit."""
    server = start_vllm(checkpoint, extra_args=extra_args, env=env)
    try:
        wait_ready([server], ready_timeout_s)
        yield server
    finally:
        server.proc.stop(timeout=30.0)


#: What a server needs for the project's plugin: vLLM's RL routes, the endpoint plugin, the worker extension.
PLUGIN_ENV = {"VLLM_PLUGINS": "omni_router", "VLLM_SERVER_DEV_MODE": "1"}
PLUGIN_ARGS = ("--worker-extension-cls", "worker.vllm_plugin.extension.OmniWeightSyncExtension")
#: Runtime LoRA: adapters up to rank 8, two in a batch, loaded and unloaded through vLLM's
#: ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (served only with the environment's flag).
LORA_ARGS = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2")
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def start_vllm(
    checkpoint: Path | str,
    *,
    port: int | None = None,
    extra_args: Sequence[str] = PLUGIN_ARGS,
    env: Mapping[str, str] | None = None,
) -> VllmServer:
    """Start one server (the plugin on by default) without waiting: :func:`wait_ready` it, :meth:`stop` it."""
    port = port or free_port()
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(checkpoint),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *SMALL_SERVER_ARGS,
        *extra_args,
    ]
    environment = {**SMALL_SERVER_ENV, "VLLM_NO_USAGE_STATS": "1", **PLUGIN_ENV, **(env or {})}
    environment["NO_PROXY"] = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1", "localhost"]))
    proc = ManagedProcess(f"vllm-{port}", argv, env=environment).start()
    return VllmServer(url=f"http://127.0.0.1:{port}", model=str(checkpoint), proc=proc)


def wait_ready(servers: Sequence[VllmServer], timeout_s: float = READY_TIMEOUT_S) -> None:
    """Every server answers ``/health`` (they start concurrently; the bound is shared)."""
    for server in servers:
        server.proc.wait_http_ready(server.url + "/health", timeout=timeout_s)
