"""``GET /server_info``: SGLang's shape, or vLLM's when asked the vLLM way (``config_format``).

SGLang's answer is the server's settings (keys blanked here), the per-rank scheduler counters and
the version. vLLM's is ``{"vllm_config", "vllm_env", "system_env"}``; trainers read a few fields of
``vllm_config`` (:mod:`router.contract.vllm_server`). Both are answered from state the worker
holds, without a scheduler round trip, so the route answers during a long update too.
"""

from __future__ import annotations

import platform

from aiohttp import web

from router import __version__
from router.contract.admin import ServerInfo
from router.contract.vllm_server import (
    ServerInfoRequest,
    VllmConfigView,
    VllmModelConfig,
    VllmParallelConfig,
    VllmWeightTransferConfig,
)
from router.contract.web.parsing import parse_body
from worker.adapters import AdapterService
from worker.coordinator import Coordinator
from worker.http.keys import ADAPTERS, CONFIG, COORDINATOR


def vllm_config(coord: Coordinator, backend: str, adapters: AdapterService) -> VllmConfigView:
    """This worker as vLLM's config dump describes a server: one data-parallel replica of
    ``tp_size`` ranks, with the weight-transfer backend ``/init_weight_transfer_engine`` builds, and
    ``lora_config`` when it serves adapters (TRL reads it to sync adapters rather than merged weights)."""
    worker = coord.worker
    return VllmConfigView(
        model=VllmModelConfig(
            model=worker.model_path,
            tokenizer=worker.tokenizer_path,
            served_model_name=worker.served_model_name,
            dtype=f"torch.{worker.dtype_name}",
            max_model_len=worker.context_len,
            architectures=[worker.config.hf_architecture],
        ),
        parallel_config=VllmParallelConfig(
            tensor_parallel_size=coord.stage.tp_size, world_size=coord.stage.tp_size, data_parallel_size=1
        ),
        weight_transfer_config=VllmWeightTransferConfig(backend=backend),
        lora_config=(
            {"max_loras": adapters.max_loras, "max_lora_rank": adapters.max_lora_rank} if adapters.enabled else None
        ),
    )


async def server_info(request: web.Request) -> web.Response:
    req = await parse_body(request, ServerInfoRequest)
    coord = request.app[COORDINATOR]
    config = request.app[CONFIG]
    info = ServerInfo.model_validate(
        {
            **config.public_dict(),
            "tp_size": coord.stage.tp_size,
            "internal_states": [coord.stage.leader.internal_state().to_wire()],
            "version": __version__,
            "weight_version": coord.worker.weight_version,
        }
    )
    if req.config_format is not None:
        view = vllm_config(coord, config.weight_transfer_backend, request.app[ADAPTERS])
        info.vllm_config = view if req.config_format == "json" else view.summary()
        info.vllm_env = {}
        info.system_env = {"python_version": platform.python_version(), "os": platform.platform()}
    # Only the keys that were set (whole): SGLang's callers see no vLLM keys, vLLM's see both.
    return web.json_response(info.model_dump(mode="json", include=set(info.model_fields_set)))
