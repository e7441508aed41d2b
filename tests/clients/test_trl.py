"""TRL's ``VLLMClient`` (trl 1.16, on vLLM 0.31's trainer modules) through one omni-router URL.

TRL's own code runs unchanged: the client's construction (``/v1/models``), ``generate``
(``/v1/completions`` with token ids), ``get_server_info`` (``/server_info?config_format=json``),
``get_world_size``, ``init_communicator`` (``/init_weight_transfer_engine`` with vLLM 0.28+'s
``packed`` in ``init_info``), ``weight_update`` (``/start_weight_update`` … ``/finish_weight_update``),
``update_named_params`` (``/update_weights`` without wire params) and ``reset_prefix_cache``.

TRL's data plane is CUDA-only: it joins vLLM's ``PyNcclCommunicator`` (``trainer_init``) and
broadcasts with vLLM's CUDA-stream producer. Those two calls, and only those, are replaced here by
a gloo group joined as rank 0 and a loop over vLLM's own ``pack_tensors`` (the producer's packing,
without its streams) broadcasting each buffer; the workers run their default ``torch`` backend.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from router.trainer.sender import TrainerWeightSender
from tests.clients.conftest import GREEDY_TOKENS, PROMPT, hf_greedy
from tests.procs import http_json
from worker.model import read_checkpoint

vllm_client = pytest.importorskip("trl.generation.vllm_client")
packed_tensor = pytest.importorskip("vllm.distributed.weight_transfer.packed_tensor")

GROUP_TIMEOUT_S = 60.0


class GlooCommunicator:
    """What TRL keeps as ``self.communicator``: a broadcast source and the ``group`` it clears on close."""

    def __init__(self, init_info: dict[str, Any]):
        self.sender = TrainerWeightSender(
            master_port=int(init_info["master_port"]),
            world_size=int(init_info["world_size"]),
            group_name="weight_transfer",
            timeout_s=GROUP_TIMEOUT_S,
        )
        self.sender.join()
        self.group = self.sender.group

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        assert src == 0 and self.sender.group is not None
        self.sender.group.broadcast(tensor, GROUP_TIMEOUT_S)


def gloo_packed_producer(
    iterator: Iterator[Any], group: GlooCommunicator, src: int, post_iter_func: Any, **kw: Any
) -> None:
    """vLLM's packed producer without CUDA streams: its own ``pack_tensors``, one broadcast per buffer."""
    size = kw.get("buffer_size_bytes", packed_tensor.DEFAULT_PACKED_BUFFER_SIZE_BYTES)
    while (chunk := packed_tensor.pack_tensors(iterator, post_iter_func, size)) is not None:
        group.broadcast(chunk.packed_tensor, src=src)


@pytest.fixture(scope="module")
def client(fleet: tuple[list[str], str], monkeypatch_module: pytest.MonkeyPatch) -> Iterator[Any]:
    _, router = fleet
    monkeypatch_module.setattr(vllm_client, "open_trainer_endpoint", GlooCommunicator)
    monkeypatch_module.setattr(vllm_client, "packed_nccl_broadcast_producer", gloo_packed_producer)
    from tests.procs import free_port

    c = vllm_client.VLLMClient(base_url=router, group_port=free_port(), connection_timeout=30)
    yield c
    communicator = c.communicator
    c.close_communicator()  # TRL's own close drops its references; the gloo group is ours to end
    if communicator is not None:
        communicator.sender.close()


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_generation_and_the_server_surface(
    client: Any, fleet: tuple[list[str], str], sync_ckpts: dict[str, str]
) -> None:
    out = client.generate([PROMPT], temperature=0.0, max_tokens=GREEDY_TOKENS)
    assert out["prompt_ids"] == [PROMPT]
    assert out["completion_ids"] == [hf_greedy(sync_ckpts["a"])]
    assert len(out["logprobs"][0]) == GREEDY_TOKENS
    info = client.get_server_info()
    assert info["weight_transfer_config"] is not None
    assert info["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert info["parallel_config"]["data_parallel_size"] == 2 and info["lora_config"] is None
    assert client.get_world_size() == 2


def test_weight_sync_installs_the_trainers_weights_on_every_worker(
    client: Any, fleet: tuple[list[str], str], sync_ckpts: dict[str, str]
) -> None:
    workers, _ = fleet
    client.init_communicator(device="cuda")  # TRL refuses any other device type; no CUDA call follows
    named = sorted(read_checkpoint(sync_ckpts["b"], torch.float32))
    with client.weight_update():
        half = len(named) // 2
        for part in (named[:half], named[half:]):
            metadata = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in part]
            client.update_named_params(metadata, iter(part))
    client.reset_prefix_cache()
    expected = hf_greedy(sync_ckpts["b"])
    for url in workers:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": GREEDY_TOKENS, "temperature": 0}}
        status, answer = http_json("POST", url + "/generate", body)
        assert status == 200 and answer["output_ids"] == expected, (url, answer)
    assert client.generate([PROMPT], temperature=0.0, max_tokens=GREEDY_TOKENS)["completion_ids"] == [expected]
