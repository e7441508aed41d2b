"""vLLM (0.32 and later, ``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1`` for its RL and dev routes).

- **health**: ``GET /health`` is an empty 200 while the engine serves (503 once it died); a paused
  engine still answers 200.
- **metadata**: ``GET /weight_info`` (the version label, ``"default"`` until one is set),
  ``GET /server_info?config_format=json`` (``vllm_config.instance_id``, new at every start: the process
  identity; tensor × pipeline parallel size: the ranks it takes in a weight-update group) and
  ``GET /is_paused`` (whether its scheduler is paused). Whether its
  weights are released is the router's own record of its ``/sleep`` and ``/wake_up`` broadcasts: vLLM's
  ``/is_sleeping`` is also true while generation is merely paused. Without dev mode none of these exist: the
  worker is routed
  on its boot weights until the fleet's first weight change and is pending after it, since the router
  cannot tell which weights it holds.
- **routes**: vLLM's RL and dev routes; with this project's plugin (``worker/vllm_plugin``, found by
  ``GET /prepare_weights_update`` answering 405 rather than 404) also the two-phase sync's; with runtime LoRA
  updating (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, found by ``GET /v1/load_lora_adapter`` answering 405)
  also its ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``; an AReaL vLLM server (AReaL's
  ``areal_vllm_server``, found by ``GET /areal_pause_generation`` answering 405) also serves AReaL's pause and
  continue, which the router passes through to it as they came (:meth:`VllmEngine.generation_control`). A full
  weight change (``reload_weights``, the plugin's sync, ``/finish_weight_update``) empties the worker's LoRA cache
  (``reset_lora_state``) but keeps the API server's adapters: the next request naming one reads it again
  from its path, so a holder still holds it.
- **answers**: empty and plain-text 200s are successes (``/sleep``, ``/collective_rpc``); a failure is
  vLLM's ``{"error": {"message"}}``, 500 for a worker-side error such as an update out of order.
"""

from __future__ import annotations

import asyncio

from router.contract import endpoints as ep
from router.contract.areal import ArealControlRequest
from router.contract.areal_endpoints import AREAL_ADMIN, AREAL_CONTINUE_GENERATION, AREAL_PAUSE_GENERATION
from router.contract.fleet import FleetVersionEntry
from router.contract.lora_endpoints import V1_LOAD_LORA_ADAPTER, V1_UNLOAD_LORA_ADAPTER
from router.contract.rl import RlCapabilities
from router.contract.vllm_dev import SleepQuery
from router.contract.vllm_rl import CollectiveRpcRequest, VllmServerIdentity, VllmWeightCheckerRequest
from router.contract.vllm_tokens import DETOKENIZE_PATH, TOKENIZE_PATH
from router.contract.vllm_tokens import GENERATE_PATH as TOKENS_GENERATE_PATH
from router.gateway.engines.base import Engine, EngineCall, relabel
from router.gateway.fleet.registry import Worker
from router.gateway.upstream import WorkerClient

VLLM_ADMIN = frozenset(
    e.path
    for e in (
        ep.PAUSE,
        ep.RESUME,
        ep.IS_PAUSED,
        ep.ABORT_REQUESTS,
        ep.INIT_WEIGHT_TRANSFER_ENGINE,
        ep.SHUTDOWN_WEIGHT_TRANSFER_ENGINE,
        ep.START_WEIGHT_UPDATE,
        ep.UPDATE_WEIGHTS,
        ep.FINISH_WEIGHT_UPDATE,
        ep.UPDATE_WEIGHT_VERSION,
        ep.WEIGHT_INFO,
        ep.WEIGHT_CHECKER,
        ep.GET_WORLD_SIZE,
        ep.COLLECTIVE_RPC,
        ep.SLEEP,
        ep.WAKE_UP,
        ep.IS_SLEEPING,
        ep.RESET_PREFIX_CACHE,
        ep.SERVER_INFO,
    )
)
#: What the project's vLLM plugin adds: the two-phase sync and SGLang's pause and continue (which its trainers
#: send), served with this project's contract.
PLUGIN_ADMIN = frozenset(
    e.path
    for e in (
        ep.PAUSE_GENERATION,
        ep.CONTINUE_GENERATION,
        ep.INIT_WEIGHTS_UPDATE_GROUP,
        ep.DESTROY_WEIGHTS_UPDATE_GROUP,
        ep.PREPARE_WEIGHTS_UPDATE,
        ep.COMPLETE_WEIGHTS_UPDATE,
        ep.ABORT_WEIGHTS_UPDATE,
    )
)
#: vLLM's runtime LoRA routes, served only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``.
RUNTIME_LORA_ADMIN = frozenset(e.path for e in (V1_LOAD_LORA_ADAPTER, V1_UNLOAD_LORA_ADAPTER))
#: AReaL's pause and continue, served by AReaL's own vLLM server.
AREAL_SERVER_ADMIN = frozenset(e.path for e in AREAL_ADMIN)
VLLM_GENERATION = frozenset(
    {"/v1/completions", "/v1/chat/completions", TOKENS_GENERATE_PATH, TOKENIZE_PATH, DETOKENIZE_PATH}
)
#: A POST-only route answers a GET with 405 where it exists and 404 where it does not: a probe that changes nothing.
PLUGIN_PROBE_PATH = ep.PREPARE_WEIGHTS_UPDATE.path
LORA_PROBE_PATH = V1_LOAD_LORA_ADAPTER.path
AREAL_PROBE_PATH = AREAL_PAUSE_GENERATION.path
#: On an AReaL vLLM server AReaL's own pause and continue pass through as they came.
AREAL_PAUSE = EngineCall(AREAL_PAUSE_GENERATION, ArealControlRequest())
AREAL_CONTINUE = EngineCall(AREAL_CONTINUE_GENERATION, ArealControlRequest())
IDENTITY_QUERY = "config_format=json"


class VllmEngine(Engine):
    name = "vllm"
    admin_paths = VLLM_ADMIN
    generation_paths = VLLM_GENERATION
    digest_request = (ep.WEIGHT_CHECKER, VllmWeightCheckerRequest(action="checksum"))
    rl_dialect = "vllm"
    #: As vLLM 0.32 serves it in dev mode.
    rl_capabilities = RlCapabilities(
        source="static",
        pause_modes=["abort", "wait", "keep"],
        update_from=["disk", "distributed"],
        abort=True,
        flush_cache=True,
        sleep_wake=True,
        reports_weight_version=True,
    )

    def reload_plan(self, worker: Worker, entry: FleetVersionEntry) -> list[EngineCall] | None:
        """``/collective_rpc`` of ``reload_weights`` from the checkpoint, then the fleet's label (vLLM takes a
        label only through its own relabel call)."""
        if ep.COLLECTIVE_RPC.path not in self.admin_paths_of(worker) or entry.source_path is None:
            return None
        load = CollectiveRpcRequest.model_validate(
            {"method": "reload_weights", "kwargs": {"weights_path": entry.source_path}}
        )
        labelled = [] if entry.weight_version is None else [relabel(entry.weight_version)]
        return [EngineCall(ep.COLLECTIVE_RPC, load), *labelled]

    async def describe(self, client: WorkerClient, worker: Worker, headers: dict[str, str], timeout_s: float) -> bool:
        version, identity, paused = await asyncio.gather(
            client.call(worker.url, ep.WEIGHT_INFO, headers=headers, cap_s=timeout_s, decode=self.decode),
            client.fetch(
                worker.url,
                f"{ep.SERVER_INFO.path}?{IDENTITY_QUERY}",
                VllmServerIdentity,
                headers=headers,
                timeout_s=timeout_s,
            ),
            client.call(worker.url, ep.IS_PAUSED, headers=headers, cap_s=timeout_s, decode=self.decode),
        )
        if version.status is None:
            return False
        if version.value is None:
            worker.engine_detail = (
                f"vLLM's RL routes are off (GET /weight_info: {version.error}); start it with "
                "VLLM_SERVER_DEV_MODE=1, or the router cannot tell which weights it holds"
            )
            worker.weight_version = worker.instance_id = None
            worker.admin_paths = frozenset()
            return True
        worker.weight_version = version.value.weight_version
        worker.weight_state = "released" if worker.asleep else "serving"
        worker.reported_paused = paused.value.is_paused if paused.value is not None else None
        info = identity.value
        if info is None:
            return False
        parallel = info.vllm_config.parallel_config
        worker.tp_size = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        instance = info.vllm_config.instance_id
        if instance != worker.instance_id or worker.admin_paths is None:
            # A new process may run with or without the plugin and runtime LoRA updating: look again.
            worker.admin_paths = await self._served(client, worker, headers, timeout_s)
        worker.instance_id = instance
        return True

    def generation_control(self, worker: Worker, *, pause: bool) -> EngineCall:
        """vLLM's ``/pause?mode=abort&clear_cache=true`` and ``/resume``; on AReaL's own vLLM server, AReaL's routes
        themselves: its pause also holds its ``/v1/completions`` until the continue and drops the multimodal
        cache, which vLLM's ``/pause`` does not, and only its continue releases what its pause held."""
        if AREAL_PROBE_PATH in self.admin_paths_of(worker):
            return AREAL_PAUSE if pause else AREAL_CONTINUE
        return super().generation_control(worker, pause=pause)

    def discards_weights(self, path: str, request: object) -> bool:
        """vLLM's ``/sleep`` at level 2 frees the weights with no host copy; a wake leaves them uninitialised."""
        return path == ep.SLEEP.path and isinstance(request, SleepQuery) and request.level >= 2

    async def _served(
        self, client: WorkerClient, worker: Worker, headers: dict[str, str], timeout_s: float
    ) -> frozenset[str]:
        plugin, lora, areal = await asyncio.gather(
            client.status(worker.url, PLUGIN_PROBE_PATH, headers={}, timeout_s=timeout_s),
            # vLLM's --api-key guards /v1: with the router's worker key the probe reaches the route.
            client.status(worker.url, LORA_PROBE_PATH, headers=headers, timeout_s=timeout_s),
            client.status(worker.url, AREAL_PROBE_PATH, headers={}, timeout_s=timeout_s),
        )
        worker.engine_detail = None if plugin == 405 else "no omni-router plugin: the two-phase sync is not served"
        served = VLLM_ADMIN
        if plugin == 405:
            served |= PLUGIN_ADMIN
        if lora == 405:
            served |= RUNTIME_LORA_ADMIN
        if areal == 405:
            served |= AREAL_SERVER_ADMIN
        return served
