"""verl 0.9.1's SGLang server adapter driving one weight sync through an omni-router (run by ``test_verl``).

Run as ``python -m tests.clients._verl_driver ROUTER_URL MODEL_PATH NEW_CHECKPOINT`` with
``tests/clients/placeholders`` on ``PYTHONPATH`` (see that package); prints one JSON line with
what each of verl's calls answered. It runs in its own process so that the torchvision
placeholder never reaches the rest of the tier.

The calls are the ones verl's ``ServerAdapter`` makes for a hybrid (colocated) replica, in its
order, through verl's own code: ``release`` (``/release_memory_occupation`` with
``["kv_cache", "weights"]``), ``resume(["weights"])``, then ``update_weights``: verl's
``get_named_tensor_buckets`` over the new checkpoint and, per bucket, SGLang's ``update_weights``
helper (each tensor through ``MultiprocessingSerializer``, gathered over the trainer's ``infer_tp``
device mesh, wrapped as ``LocalSerializedTensor(values=[one pickle per TP rank])``, posted by
verl's ``AsyncHttpServerAdapter.update_weights_from_tensor`` as ``/update_weights_from_tensor``),
then ``flush_cache``, ``resume(["kv_cache"])``, and generation through the adapter.

What differs from a GPU run, and why:
* The ``infer_tp`` device mesh is a real one-rank gloo mesh on CPU.
* SGLang's ``monkey_patch_torch_reductions`` rewrites the CUDA device index of each tensor pickle
  to a GPU UUID; on a CPU tensor it indexes a slot that does not exist. The driver leaves torch's
  own reducer in place, so the pickles carry shared-memory file names (the ``file_system`` sharing
  strategy) instead of CUDA IPC handles. The worker's mapping of SGLang's UUID rebuild is covered
  in the main suite. verl's ``_to_ipc_device`` (a move to the accelerator) is skipped for the same reason.
* verl 0.9.1 pins SGLang 0.5.12; the tier runs SGLang 0.5.23, whose ``EngineBase`` added two
  abstract methods (``begin_weight_update``/``end_weight_update``) that verl's adapter does not
  define, so it cannot be instantiated unchanged. The driver subclasses it with those two methods
  raising: verl never calls them, and if it did the run would fail.
"""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import timedelta
from typing import Any, NoReturn
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from sglang.srt.utils import patch_torch
from torch.distributed.device_mesh import init_device_mesh
from verl.workers.rollout.sglang_rollout import sglang_rollout
from verl.workers.rollout.sglang_rollout.http_server_engine import AsyncHttpServerAdapter
from verl.workers.rollout.sglang_rollout.utils import get_named_tensor_buckets

from tests.procs import free_port
from worker.model import read_checkpoint

PROMPT = [1, 2, 3, 4, 5, 6]
BUCKET_BYTES = 64 << 10  # small, so that the tiny checkpoint spans several requests


class Verl091Adapter(AsyncHttpServerAdapter):
    """verl's adapter, with the two methods SGLang 0.5.23 made abstract (verl never calls them)."""

    def begin_weight_update(self, *_: Any, **__: Any) -> NoReturn:
        raise AssertionError("verl 0.9.1 does not open a weight-update session")

    def end_weight_update(self, *_: Any, **__: Any) -> NoReturn:
        raise AssertionError("verl 0.9.1 does not open a weight-update session")


def _cpu_reducer(*_: Any, **__: Any) -> None:
    """Stands in for SGLang's CUDA-only reducer patch (see the module docstring)."""


async def sync(router: str, model_path: str, new_checkpoint: str) -> dict[str, Any]:
    where = urlsplit(router)
    engine = Verl091Adapter(model_path=model_path, host=where.hostname, port=where.port, launch_server=False)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("infer_tp",))
    answers: dict[str, Any] = {}
    answers["release"] = await engine.release_memory_occupation(tags=["kv_cache", "weights"])
    answers["resume_weights"] = await engine.resume_memory_occupation(tags=["weights"])
    weights = iter(sorted(read_checkpoint(new_checkpoint, torch.float32)))
    updates = []
    async for params_batch in get_named_tensor_buckets(weights, BUCKET_BYTES):
        batch = [(sglang_rollout._strip_lora_base_layer(name), tensor) for name, tensor in params_batch]
        updates.append(
            await sglang_rollout.sgl_update_weights(
                engine=engine, params_batch=batch, device_mesh_key="infer_tp", device_mesh=mesh
            )
        )
    answers["updates"] = updates
    answers["flush"] = await engine.flush_cache()
    answers["resume_kv_cache"] = await engine.resume_memory_occupation(tags=["kv_cache"])
    answers["generate"] = await engine.generate(
        input_ids=PROMPT, sampling_params={"max_new_tokens": 8, "temperature": 0.0}
    )
    answers["abort"] = await engine.abort_request(abort_all=True)
    return answers


def main() -> None:
    router, model_path, new_checkpoint = sys.argv[1:4]
    torch.multiprocessing.set_sharing_strategy("file_system")
    patch_torch.monkey_patch_torch_reductions = _cpu_reducer
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    try:
        answers = asyncio.run(sync(router, model_path, new_checkpoint))
    finally:
        dist.destroy_process_group()
    print(json.dumps(answers, default=str))


if __name__ == "__main__":
    main()
