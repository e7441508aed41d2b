"""omni-worker: this project's worker. Its ``/health`` is JSON and says what it holds; it serves every
admin route of the worker contract (SGLang's dialect, vLLM's, the two-phase sync, the peer load)."""

from __future__ import annotations

from router.contract import endpoints as ep
from router.contract.admin import HealthStatus
from router.contract.fleet import FleetVersionEntry
from router.contract.lora_endpoints import LORA_ADMIN
from router.contract.vllm_tokens import DETOKENIZE_PATH, TOKENIZE_PATH
from router.contract.vllm_tokens import GENERATE_PATH as TOKENS_GENERATE_PATH
from router.gateway.engines.base import (
    CHECKSUM_OF_WEIGHTS,
    HEALTH_PATH,
    SGLANG_RL_CAPABILITIES,
    Engine,
    EngineCall,
    load_from_disk,
)
from router.gateway.fleet.registry import Worker
from router.gateway.upstream import WorkerClient
from router.gateway.upstream.answer import decode_answer

#: Generation routes: SGLang's native one, OpenAI's, vLLM's token routes.
OMNI_GENERATION = frozenset(
    {"/generate", "/v1/completions", "/v1/chat/completions", TOKENS_GENERATE_PATH, TOKENIZE_PATH, DETOKENIZE_PATH}
)


class OmniEngine(Engine):
    name = "omni"
    admin_paths = frozenset(e.path for e in (*ep.WORKER_ADMIN, *LORA_ADMIN))
    generation_paths = OMNI_GENERATION
    reports_update_state = True
    reports_adapter_digest = True
    decode = staticmethod(decode_answer)
    digest_request = CHECKSUM_OF_WEIGHTS
    peer_source = True
    rl_dialect = "sglang"
    rl_capabilities = SGLANG_RL_CAPABILITIES

    def reload_plan(self, worker: Worker, entry: FleetVersionEntry) -> list[EngineCall] | None:
        return load_from_disk(entry) if ep.UPDATE_WEIGHTS_FROM_DISK.path in self.admin_paths_of(worker) else None

    async def health(
        self, client: WorkerClient, worker: Worker, timeout_s: float, headers: dict[str, str]
    ) -> HealthStatus | None:
        answer = await client.fetch(worker.url, HEALTH_PATH, HealthStatus, headers={}, timeout_s=timeout_s)
        return answer.value

    async def describe(self, client: WorkerClient, worker: Worker, headers: dict[str, str], timeout_s: float) -> bool:
        """``/model_info`` (falling back to ``/server_info`` for ``tp_size`` on a worker that lacks it)."""
        answer = await client.call(worker.url, ep.MODEL_INFO, headers=headers, cap_s=timeout_s)
        info = answer.value
        if info is not None:
            worker.weight_version = info.weight_version
            worker.weight_state = info.weight_state
            worker.instance_id = info.instance_id
            worker.reported_paused = info.is_paused
            if "tp_size" in info.model_fields_set and info.tp_size >= 1:
                worker.tp_size = info.tp_size
                return True
        elif answer.status is None:
            return False  # unreachable: /server_info is not tried either
        server = (await client.call(worker.url, ep.SERVER_INFO, headers=headers, cap_s=timeout_s)).value
        if server is not None:
            if "tp_size" in server.model_fields_set and server.tp_size >= 1:
                worker.tp_size = server.tp_size
            return True
        return False
