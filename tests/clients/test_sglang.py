"""SGLang 0.5.23's own trainer-side helpers syncing weights through one omni-router URL.

Trainers built on SGLang (slime, miles and their forks) join the weight-update group with SGLang's
``init_custom_process_group``, pack buckets with its ``FlattenedTensorBucket`` and pickle tensors
with its ``MultiprocessingSerializer``; the JSON bodies around them are SGLang's documented
request fields, posted as those trainers post them. Everything that touches weights here is
SGLang's code, unchanged:

* the group: ``init_custom_process_group`` as rank 0 (gloo on CPU), against
  ``/init_weights_update_group`` on the router; one ``flattened_bucket`` broadcast per
  ``/update_weights_from_distributed`` request, the buffer and the names, dtypes and shapes
  taken from ``FlattenedTensorBucket``;
* the tensor path: ``MultiprocessingSerializer.serialize(..., output_str=True)`` over
  ``(name, tensor)`` pairs and over a ``FlattenedTensorBucket``'s ``{"flattened_tensor",
  "metadata"}``, on ``/update_weights_from_tensor`` to workers started with
  ``--allow-pickled-tensors``. On a GPU SGLang's pickles carry CUDA IPC handles; on CPU they
  carry shared-memory file names (torch's ``file_system`` sharing strategy, which SGLang's
  serializer uses unchanged), so the worker processes open the trainer's own tensors.

The effect is checked independently of the project: every worker's greedy tokens equal
``transformers``' on the checkpoint the trainer sent.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.clients.conftest import GREEDY_TOKENS, PROMPT, hf_greedy
from tests.procs import free_port, http_json
from worker.model import read_checkpoint

sglang_utils = pytest.importorskip("sglang.srt.utils")
tensor_bucket = pytest.importorskip("sglang.srt.weight_sync.tensor_bucket")

TIMEOUT_S = 120.0
GROUP = "sglang_helpers_group"
BUCKET_TENSORS = 8


def _buckets(path: str) -> list[list[tuple[str, torch.Tensor]]]:
    named = sorted(read_checkpoint(path, torch.float32))
    return [named[i : i + BUCKET_TENSORS] for i in range(0, len(named), BUCKET_TENSORS)]


def _post_in_thread(url: str, body: dict[str, Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(http_json("POST", url, body, timeout=TIMEOUT_S)), daemon=True)
    thread.start()
    return thread, out


def _answer(thread: threading.Thread, out: list[Any]) -> dict[str, Any]:
    thread.join(TIMEOUT_S)
    assert not thread.is_alive() and out, "the request never returned"
    status, body = out[0]
    assert status == 200 and body["success"] is True, body
    return body


def _assert_serves(workers: list[str], path: str) -> None:
    expected = hf_greedy(path)
    for url in workers:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": GREEDY_TOKENS, "temperature": 0}}
        status, answer = http_json("POST", url + "/generate", body)
        assert status == 200 and answer["output_ids"] == expected, (url, answer)


def test_flattened_buckets_over_sglangs_process_group(fleet: tuple[list[str], str], sync_ckpts: dict[str, str]) -> None:
    workers, router = fleet
    port = free_port()
    init = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": len(workers) + 1,
        "group_name": GROUP,
        "backend": "gloo",
    }
    thread, out = _post_in_thread(router + "/init_weights_update_group", init)
    group = sglang_utils.init_custom_process_group(
        backend="gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        timeout=timedelta(seconds=TIMEOUT_S),
        world_size=len(workers) + 1,
        rank=0,
        group_name=GROUP,
    )
    _answer(thread, out)
    try:
        for named in _buckets(sync_ckpts["b"]):
            bucket = tensor_bucket.FlattenedTensorBucket(named_tensors=named)
            meta = bucket.get_metadata()
            request = {
                "names": [m.name for m in meta],
                "dtypes": [str(m.dtype).removeprefix("torch.") for m in meta],
                "shapes": [list(m.shape) for m in meta],
                "group_name": GROUP,
                "load_format": "flattened_bucket",
                "flush_cache": True,
            }
            thread, out = _post_in_thread(router + "/update_weights_from_distributed", request)
            dist.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
            _answer(thread, out)
    finally:
        dist.destroy_process_group(group)
        http_json("POST", router + "/destroy_weights_update_group", {"group_name": GROUP})
    _assert_serves(workers, sync_ckpts["b"])


@pytest.mark.parametrize("form", ["named_tensors", "flattened_bucket"])
def test_multiprocessing_serializer_payloads(
    pickle_fleet: tuple[list[str], str], sync_ckpts: dict[str, str], form: str
) -> None:
    workers, router = pickle_fleet
    # SGLang's serializer is ForkingPickler: on CPU, tensors travel as shared-memory file names.
    torch.multiprocessing.set_sharing_strategy("file_system")
    target = sync_ckpts["b"] if form == "named_tensors" else sync_ckpts["a"]
    for named in _buckets(target):
        if form == "flattened_bucket":
            bucket = tensor_bucket.FlattenedTensorBucket(named_tensors=named)
            payload: Any = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
        else:
            payload = named
        body = {
            "serialized_named_tensors": [sglang_utils.MultiprocessingSerializer.serialize(payload, output_str=True)],
            "load_format": None if form == "named_tensors" else "flattened_bucket",
            "flush_cache": True,
        }
        status, answer = http_json("POST", router + "/update_weights_from_tensor", body, timeout=TIMEOUT_S)
        assert status == 200 and answer["success"] is True, answer
    _assert_serves(workers, target)
