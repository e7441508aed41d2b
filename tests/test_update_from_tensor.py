"""``/update_weights_from_tensor``: the JSON handle format, SGLang's pickled payloads
behind ``--allow-pickled-tensors`` (restricted unpickler), and refusals that change nothing.

The worker is a separate process, so the shared memory written here really crosses processes.
"""

from __future__ import annotations

import base64
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from router.trainer.sender import sent_checksum
from router.trainer.tensor_handles import build_cpu_handles
from tests._worker_helpers import forking_pickle
from worker.model.checkpoint import read_checkpoint

PATH = "/update_weights_from_tensor"


@dataclass
class FlattenedTensorMetadata:
    """The fields of SGLang's ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata``."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def _tensors(ckpt: Path) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.clone()) for n, t in read_checkpoint(ckpt, torch.float32)]


@pytest.fixture(scope="module")
def workers(worker_factory, checkpoints):
    return {
        "plain": worker_factory(checkpoints["llama"]),
        "pickles": worker_factory(checkpoints["llama"], "--allow-pickled-tensors"),
        "b": worker_factory(checkpoints["llama_b"]),
    }


def _reset(worker, checkpoints) -> None:
    worker.ok("POST", "/update_weights_from_disk", {"model_path": str(checkpoints["llama"])})


def test_handle_format_crosses_processes(workers, checkpoints) -> None:
    w = workers["plain"]
    named = _tensors(checkpoints["llama_b"])
    body, segment = build_cpu_handles(named, weight_version="v-handles")
    try:
        answer = w.ok("POST", PATH, body)
    finally:
        segment.close()
        segment.unlink()
    assert answer["success"] is True
    assert w.checksum() == sent_checksum(named)
    assert w.info()["weight_version"] == "v-handles"
    prompt = [1, 5, 9, 3]
    assert w.generate(prompt)["output_ids"] == workers["b"].generate(prompt)["output_ids"]
    _reset(w, checkpoints)


def test_pickled_list_and_flattened_bucket(workers, checkpoints) -> None:
    w = workers["pickles"]
    named = _tensors(checkpoints["llama_b"])
    expected = sent_checksum(named)
    w.ok("POST", PATH, {"serialized_named_tensors": [forking_pickle(named)], "load_format": None})
    assert w.checksum() == expected
    _reset(w, checkpoints)
    assert w.checksum() != expected

    parts, metadata, start = [], [], 0
    for name, t in named:
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        metadata.append(FlattenedTensorMetadata(name, t.shape, t.dtype, start, start + raw.numel(), t.numel()))
        parts.append(raw)
        start += raw.numel()
    payload = {"flattened_tensor": torch.cat(parts), "metadata": metadata}
    body = {"serialized_named_tensors": [forking_pickle(payload)], "load_format": "flattened_bucket"}
    w.ok("POST", PATH, body)
    assert w.checksum() == expected
    _reset(w, checkpoints)


def test_malicious_pickles_are_refused(workers, checkpoints, tmp_path) -> None:
    w = workers["pickles"]
    marker = tmp_path / "pwned"
    evil = base64.b64encode(pickle.dumps(_Evil(marker), protocol=2)).decode()
    w.refused(PATH, {"serialized_named_tensors": [evil]}, "allowlist")
    for proto in (2, 4):
        inner = base64.b64encode(pickle.dumps([("model.norm.weight", _Evil(marker))], protocol=proto)).decode()
        w.refused(PATH, {"serialized_named_tensors": [inner]}, "posix.system")
    assert not marker.exists()
    # Without the flag a pickle is refused before it is even decoded.
    workers["plain"].refused(PATH, {"serialized_named_tensors": [evil]}, "--allow-pickled-tensors")
    named = _tensors(checkpoints["llama_b"])
    workers["plain"].refused(PATH, {"serialized_named_tensors": [forking_pickle(named)]}, "--allow-pickled-tensors")


def test_bad_handle_messages_are_refused(workers, checkpoints) -> None:
    w = workers["plain"]
    named = _tensors(checkpoints["llama_b"])
    body, segment = build_cpu_handles(named)
    try:
        bucket = body["tensor_handles"]["buckets"][0]
        gone = {**bucket, "memory": {**bucket["memory"], "name": "psm_omni_no_such_segment"}}
        w.refused(PATH, {"tensor_handles": {**body["tensor_handles"], "buckets": [gone]}}, "psm_omni_no_such_segment")
        outside = [{**bucket["tensors"][0], "offset": bucket["memory"]["size"]}, *bucket["tensors"][1:]]
        w.refused(
            PATH, {"tensor_handles": {**body["tensor_handles"], "buckets": [{**bucket, "tensors": outside}]}}, "outside"
        )
        first = bucket["tensors"][0]
        wrong = [{**first, "shape": [1]}, *bucket["tensors"][1:]]
        w.refused(
            PATH, {"tensor_handles": {**body["tensor_handles"], "buckets": [{**bucket, "tensors": wrong}]}}, "shape"
        )
        bigger = {**bucket, "memory": {**bucket["memory"], "size": bucket["memory"]["size"] + 4096}}
        w.refused(PATH, {"tensor_handles": {**body["tensor_handles"], "buckets": [bigger]}}, "bytes")
    finally:
        segment.close()
        segment.unlink()
