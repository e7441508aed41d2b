"""verl 0.9.1's SGLang rollout syncing a LoRA adapter through an omni-router (run by ``test_verl_lora``).

Run as ``python -m tests.clients._verl_lora_driver ROUTER_URL MODEL_PATH ADAPTER_DIR...`` with
``tests/clients/placeholders`` on ``PYTHONPATH`` (see ``_verl_driver``); prints one JSON line with
what each of verl's calls answered. One adapter directory is one training step's adapter.

Each step runs what verl's ``ActorRolloutRefWorker.update_weights`` (``verl/workers/engine_workers.py``)
runs for an unmerged adapter once the server holds the base model (``base_sync_done``): the trainer
side is verl's ``collect_lora_params`` and ``convert_weight_keys`` over a PEFT model (the FSDP
engine's ``get_per_tensor_param`` for LoRA, without FSDP: the same helpers, one process), with the
PEFT config's ``to_dict()``; the rollout side is verl's own ``ServerAdapter`` (``sglang_rollout.py``)
built from verl's ``RolloutConfig`` and ``HFModelConfig`` with ``lora_rank`` set, so that it serves
the adapter unmerged (``sleep_level`` 1): ``release()`` (the KV cache only), ``update_weights(...,
peft_config=..., base_sync_done=True)`` (``GET /v1/models``; ``/unload_lora_adapter`` of
``verl_actor_lora_name`` when it is listed; ``wrap_lora_params``, SGLang's serializer, one copy per
``infer_tp`` rank; ``/load_lora_adapter_from_tensors`` by ``AsyncHttpServerAdapter``; ``/flush_cache``),
``resume(["kv_cache"])``, then generation through verl's adapter with ``lora_path`` naming the adapter.

What differs from a GPU run, and why (the rest as in ``_verl_driver``):
* ``ServerAdapter._init_server_adapter`` looks up the SGLang server's Ray actor for its address and
  builds an ``AsyncHttpServerAdapter`` on it; here the adapter is built on the router's address and
  given to the ``ServerAdapter`` before its first call (``_engine``), and is the ``_verl_driver``
  subclass that SGLang 0.5.23 needs. It records what verl's load and unload calls answered, unchanged.
* ``_to_ipc_device`` moves each tensor to the accelerator; on CPU it is the identity.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from sglang.srt.utils import patch_torch
from torch.distributed.device_mesh import init_device_mesh
from verl.utils.fsdp_utils import collect_lora_params
from verl.utils.model import convert_weight_keys
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.sglang_rollout import sglang_rollout
from verl.workers.rollout.sglang_rollout.utils import SGLANG_LORA_NAME

from tests.clients._verl_driver import Verl091Adapter, _cpu_reducer
from tests.procs import free_port

PROMPT = [1, 2, 3, 4, 5, 6]
STEPS = 6
RANK = 4


class RecordingAdapter(Verl091Adapter):
    """Records the answers verl's LoRA calls get (verl itself discards them)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.answers: list[tuple[str, Any]] = []

    async def load_lora_adapter_from_tensor(self, req: Any) -> Any:
        answer = await super().load_lora_adapter_from_tensor(req)
        self.answers.append(("load_lora_adapter_from_tensors", answer))
        return answer

    async def unload_lora_adapter(self, lora_name: str) -> Any:
        answer = await super().unload_lora_adapter(lora_name)
        self.answers.append(("unload_lora_adapter", answer))
        return answer


def _trainer_adapter(model_path: str, adapter_dir: str) -> tuple[Any, dict[str, Any]]:
    """What verl's FSDP engine hands the rollout for an unmerged adapter: its tensors and PEFT config."""
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapter_dir)
    params = collect_lora_params(module=model, layered_summon=False, base_sync_done=True)
    params = convert_weight_keys(params, model)
    return params.items(), model.peft_config["default"].to_dict()


async def sync(router: str, model_path: str, adapter_dirs: list[str]) -> dict[str, Any]:
    where = urlsplit(router)
    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp", "infer_tp", "infer_pp"))
    rollout = sglang_rollout.ServerAdapter(
        config=RolloutConfig(name="sglang", tensor_model_parallel_size=1),
        model_config=HFModelConfig(
            path=model_path, lora_rank=RANK, lora_alpha=2 * RANK, target_modules="all-linear", load_tokenizer=False
        ),
        device_mesh=mesh,
    )
    engine = RecordingAdapter(model_path=model_path, host=where.hostname, port=where.port, launch_server=False)
    rollout._engine = engine
    steps = []
    for adapter_dir in adapter_dirs:
        weights, peft_config = _trainer_adapter(model_path, adapter_dir)
        await rollout.release()
        await rollout.update_weights(weights, peft_config=peft_config, base_sync_done=True)
        await rollout.resume(tags=["kv_cache"])
        models = await engine.available_models()
        generated = await engine.generate(
            input_ids=PROMPT,
            sampling_params={"max_new_tokens": STEPS, "temperature": 0.0, "ignore_eos": True},
            lora_path=SGLANG_LORA_NAME,
        )
        steps.append({"calls": engine.answers, "models": models, "generate": generated})
        engine.answers = []
    return {"sleep_level": rollout.sleep_level, "steps": steps}


def main() -> None:
    router, model_path, *adapter_dirs = sys.argv[1:]
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("RAY_LOCAL_WORLD_SIZE", "1")
    torch.multiprocessing.set_sharing_strategy("file_system")
    patch_torch.monkey_patch_torch_reductions = _cpu_reducer
    sglang_rollout._to_ipc_device = lambda tensor: tensor
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    try:
        answers = asyncio.run(sync(router, model_path, adapter_dirs))
    finally:
        dist.destroy_process_group()
    print(json.dumps(answers, default=str))


if __name__ == "__main__":
    main()
