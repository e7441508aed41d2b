"""vLLM 0.31's own trainer-side weight-transfer engine syncing through one omni-router URL.

vLLM's code runs unchanged: ``NCCLTrainerWeightTransferEngine.trainer_init`` sends the worker's
init info (``packed``, ``packed_buffer_size_bytes``, ``packed_num_buffers`` in ``init_info``, as
since vLLM 0.28) through ``HTTPVLLMWeightSyncClient``, and ``send_weights`` runs
``/start_weight_update`` and ``/finish_weight_update`` without a body, ``/update_weights`` with
only names, dtypes and shapes, and packs the weights of a ``ModuleSource`` over a Hugging Face
model with its own ``pack_tensors``. Its collective is CUDA-only (``PyNcclCommunicator`` joined by
``trainer_init``, and a producer on CUDA streams): those two calls, and only those, are replaced by
a gloo group joined as rank 0 and a loop over the same ``pack_tensors`` broadcasting each buffer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from router.trainer.sender import TrainerWeightSender
from tests.clients.conftest import GREEDY_TOKENS, PROMPT, hf_greedy
from tests.procs import free_port, http_json

nccl_engine = pytest.importorskip("vllm.distributed.weight_transfer.nccl_engine")
from vllm.distributed.weight_transfer import packed_tensor  # noqa: E402
from vllm.distributed.weight_transfer.base import ModuleSource  # noqa: E402
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient  # noqa: E402

GROUP_TIMEOUT_S = 60.0
BUFFER = 256 * 1024


class GlooEndpoint:
    """The trainer's end of the group: rank 0 of a gloo group, broadcasting as the communicator does."""

    def __init__(self, init_info: Any, rank: int = 0):
        self.sender = TrainerWeightSender(
            master_port=int(init_info.master_port),
            world_size=int(init_info.world_size),
            group_name="weight_transfer",
            timeout_s=GROUP_TIMEOUT_S,
        )
        self.sender.join()

    def broadcast(self, tensor: torch.Tensor, src: int = 0, **_: Any) -> None:
        assert src == 0 and self.sender.group is not None
        self.sender.group.broadcast(tensor, GROUP_TIMEOUT_S)


def gloo_packed_producer(
    iterator: Iterator[Any], group: GlooEndpoint, src: int, post_iter_func: Any, **kw: Any
) -> None:
    """vLLM's packed producer without CUDA streams: its own ``pack_tensors``, one broadcast per buffer."""
    while (chunk := packed_tensor.pack_tensors(iterator, post_iter_func, kw["buffer_size_bytes"])) is not None:
        group.broadcast(chunk.packed_tensor, src=src)


def test_vllm_trainer_engine_through_the_router(
    fleet: tuple[list[str], str], sync_ckpts: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    workers, router = fleet
    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", GlooEndpoint)
    monkeypatch.setattr(nccl_engine, "packed_nccl_broadcast_producer", gloo_packed_producer)
    model = AutoModelForCausalLM.from_pretrained(sync_ckpts["c"], dtype=torch.float32)
    world = http_json("GET", router + "/get_world_size")[1]["world_size"]
    info = nccl_engine.NCCLTrainerInitInfo(
        master_address="127.0.0.1",
        master_port=free_port(),
        world_size=world + 1,
        packed_buffer_size_bytes=BUFFER,
        rank=0,
    )
    engine = nccl_engine.NCCLTrainerWeightTransferEngine.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(router, timeout=120), source=ModuleSource(model)
    )
    try:
        engine.send_weights()
    finally:
        engine.model_update_group.sender.close()
    expected = hf_greedy(sync_ckpts["c"])
    for url in workers:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": GREEDY_TOKENS, "temperature": 0}}
        status, answer = http_json("POST", url + "/generate", body)
        assert status == 200 and answer["output_ids"] == expected, (url, answer)
