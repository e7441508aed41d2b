"""SGLang (0.5.23): the admin dialect omni-worker also speaks, read the way a real SGLang server answers.

- **health**: ``GET /health`` is an empty 200. While generation is paused it parks every new
  generate, the probe's one-token health generation included, for ``SGLANG_HEALTH_CHECK_TIMEOUT``
  (20 s) and then answers 503 and marks the server unhealthy; so a worker the router paused is probed
  on ``GET /model_info`` instead, which answers without the scheduler.
- **metadata**: ``GET /model_info`` (``weight_version``; SGLang has no ``/get_weight_version``),
  ``GET /server_info`` (``tp_size`` × ``pp_size``; ``startup_time`` as the process identity) and
  ``GET /ready`` (503 while paused: SGLang has no ``/is_paused``). SGLang
  does not report released memory: the router's own record of its release broadcast stands for it.
- **answers**: ``/flush_cache`` is text, ``/abort_request`` an empty 200, the memory routes JSON
  ``null``; admin failures are 400 ``{"success": false, "message"}``. SGLang's rollback after a failed
  ``/update_weights_from_disk`` reloads from the path that failed (the model path is replaced before the
  load), so such a failure is never taken as weights left intact: the worker stays fenced.
- **LoRA**: ``/load_lora_adapter``, ``/load_lora_adapter_from_tensors`` and ``/unload_lora_adapter`` (answering
  ``LoRAUpdateOutput``: ``success``, ``error_message``, ``loaded_adapters``; 400 on a refusal, and on a server
  started without ``--enable-lora``). SGLang refuses a name it already holds and reports no digest of what it
  loaded, so the router neither updates an adapter in place on it nor checks a trainer's digest there.
"""

from __future__ import annotations

import asyncio

from router.contract import endpoints as ep
from router.contract.admin import MemoryOccupationRequest
from router.contract.fleet import FleetVersionEntry
from router.contract.lora_endpoints import LOAD_LORA_ADAPTER, LOAD_LORA_ADAPTER_FROM_TENSORS, UNLOAD_LORA_ADAPTER
from router.contract.sglang_server import SglangServerIdentity
from router.gateway.engines.base import (
    CHECKSUM_OF_WEIGHTS,
    HEALTH_PATH,
    SGLANG_ABORTING_PAUSE,
    SGLANG_CONTINUE,
    SGLANG_RL_CAPABILITIES,
    Engine,
    EngineCall,
    load_from_disk,
)
from router.gateway.fleet.registry import Worker
from router.gateway.upstream import WorkerClient

SGLANG_ADMIN = frozenset(
    e.path
    for e in (
        ep.MODEL_INFO,
        ep.SERVER_INFO,
        ep.UPDATE_WEIGHT_VERSION,
        ep.PAUSE_GENERATION,
        ep.CONTINUE_GENERATION,
        ep.ABORT_REQUEST,
        ep.FLUSH_CACHE,
        ep.UPDATE_WEIGHTS_FROM_DISK,
        ep.UPDATE_WEIGHTS_FROM_TENSOR,
        ep.WEIGHTS_CHECKER,
        ep.RELEASE_MEMORY_OCCUPATION,
        ep.RESUME_MEMORY_OCCUPATION,
        ep.INIT_WEIGHTS_UPDATE_GROUP,
        ep.DESTROY_WEIGHTS_UPDATE_GROUP,
        ep.UPDATE_WEIGHTS_FROM_DISTRIBUTED,
        ep.BEGIN_WEIGHT_UPDATE,
        ep.END_WEIGHT_UPDATE,
        LOAD_LORA_ADAPTER,
        LOAD_LORA_ADAPTER_FROM_TENSORS,
        UNLOAD_LORA_ADAPTER,
    )
)
SGLANG_GENERATION = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
#: 200 only while generation runs and SGLang counts itself healthy (``TokenizerManager.is_ready``); no key needed.
READY_PATH = "/ready"


class SglangEngine(Engine):
    name = "sglang"
    admin_paths = SGLANG_ADMIN
    generation_paths = SGLANG_GENERATION
    digest_request = CHECKSUM_OF_WEIGHTS
    rl_dialect = "sglang"
    rl_capabilities = SGLANG_RL_CAPABILITIES

    def reload_plan(self, worker: Worker, entry: FleetVersionEntry) -> list[EngineCall] | None:
        return load_from_disk(entry) if ep.UPDATE_WEIGHTS_FROM_DISK.path in self.admin_paths_of(worker) else None

    def health_path(self, worker: Worker) -> str:
        return ep.MODEL_INFO.path if worker.paused else HEALTH_PATH

    def generation_control(self, worker: Worker, *, pause: bool) -> EngineCall:
        """SGLang serves no vLLM ``/pause``: its ``/pause_generation`` in ``abort`` mode is the same pause."""
        return SGLANG_ABORTING_PAUSE if pause else SGLANG_CONTINUE

    def discards_weights(self, path: str, request: object) -> bool:
        """SGLang's ``/release_memory_occupation`` of the weights keeps a host copy only when the server runs with
        ``--enable-weights-cpu-backup``, which the router cannot see: it assumes the weights are gone."""
        if path != ep.RELEASE_MEMORY_OCCUPATION.path or not isinstance(request, MemoryOccupationRequest):
            return False
        return not request.tags or "weights" in request.tags

    async def describe(self, client: WorkerClient, worker: Worker, headers: dict[str, str], timeout_s: float) -> bool:
        info, server, ready = await asyncio.gather(
            client.call(worker.url, ep.MODEL_INFO, headers=headers, cap_s=timeout_s, decode=self.decode),
            client.fetch(worker.url, ep.SERVER_INFO.path, SglangServerIdentity, headers=headers, timeout_s=timeout_s),
            client.status(worker.url, READY_PATH, headers={}, timeout_s=timeout_s),
        )
        if info.value is None or server.value is None:
            return False
        worker.weight_version = info.value.weight_version
        worker.weight_state = "released" if worker.asleep else "serving"
        worker.tp_size = max(1, server.value.tp_size) * max(1, server.value.pp_size)
        worker.instance_id = server.value.instance_id()
        # /ready is 503 while paused (or while SGLang counts itself unhealthy, which a continue does not harm).
        worker.reported_paused = {200: False, 503: True}.get(ready) if ready is not None else None
        return True
