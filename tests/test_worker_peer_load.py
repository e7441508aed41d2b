"""A worker loads the fleet's weights from a live peer: ``GET /weights_snapshot`` and ``POST /update_weights_from_peer``.

Real worker processes on tiny checkpoints, one shared admin key. The sink catches up to
a source updated to checkpoint B (tokens as ``transformers`` computes them on B, the
source's version and checksum); the snapshot is plain safetensors; a wrong checksum, a
source killed mid-transfer or an update that cuts the source's stream all fail with the
sink's weights intact; caller mistakes are 4xx and change nothing.
"""

from __future__ import annotations

import json
import struct
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from router.contract.peer import UpdateWeightsFromPeerResult
from tests._polling import wait_for
from tests._router_fixtures import ADMIN_KEY, auth
from tests._weight_sync_fixtures import transformers_greedy
from tests._worker_helpers import Worker, result
from worker.model import digest_named_tensors, load_model

PROMPT = [1, 2, 3, 4, 5]
NEW_TOKENS = 8
#: A throttled source sends one tensor per 150 ms (about 3 s for the tiny model): long enough to act mid-transfer.
SLOW_SOURCE = ("--snapshot-send-delay-ms", "150", "--snapshot-lease-wait-s", "0.5")


def _start(worker_factory, ckpt, *extra: str) -> Worker:
    return worker_factory(ckpt, "--admin-api-key", ADMIN_KEY, *extra, headers=auth())


@pytest.fixture(scope="module")
def source(worker_factory, checkpoints):
    return _start(worker_factory, checkpoints["llama"])


@pytest.fixture(scope="module")
def sink(worker_factory, checkpoints):
    return _start(worker_factory, checkpoints["llama"])


@pytest.fixture(scope="module")
def slow_source(worker_factory, checkpoints):
    return _start(worker_factory, checkpoints["llama"], *SLOW_SOURCE)


@pytest.fixture(scope="module")
def checksums(checkpoints):
    return {
        key: digest_named_tensors(load_model(checkpoints[key]).iter_checkpoint_tensors())[1]
        for key in ("llama", "llama_b")
    }


@pytest.fixture(autouse=True)
def _sink_back_to_a(sink, checkpoints):
    yield
    sink.ok("POST", "/update_weights_from_disk", {"model_path": str(checkpoints["llama"]), "weight_version": "default"})


def _snapshot_bytes(worker: Worker) -> bytes:
    req = urllib.request.Request(worker.url + "/weights_snapshot", headers=auth())
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["Content-Type"] == "application/octet-stream"
        return resp.read()


def _sending(worker: Worker, count: int) -> None:
    """Until ``worker`` has started its ``count``-th snapshot stream (it logs each)."""
    wait_for(
        lambda: worker.proc.log_text(100_000).count("weights_snapshot: sending") >= count,
        30,
        worker.proc,
        "a snapshot stream",
    )


def test_sink_catches_up_to_the_peer(source, sink, checkpoints, checksums):
    source.ok(
        "POST", "/update_weights_from_disk", {"model_path": str(checkpoints["llama_b"]), "weight_version": "step-7"}
    )
    assert source.checksum() == checksums["llama_b"] and sink.checksum() == checksums["llama"]

    body = sink.ok("POST", "/update_weights_from_peer", {"source_url": source.url, "weight_version": "step-7"})
    answer = UpdateWeightsFromPeerResult.model_validate(body)
    assert answer.success and answer.weights == "updated" and answer.weight_version == "step-7"
    assert answer.checksum == source.checksum() == sink.checksum() == checksums["llama_b"]
    assert answer.source_instance_id == source.info()["instance_id"]
    assert answer.bytes_received > 0
    assert sink.info()["weight_version"] == "step-7" and sink.info()["weight_state"] == "serving"
    tokens = sink.generate(PROMPT, NEW_TOKENS)["output_ids"]
    assert tokens == transformers_greedy(checkpoints["llama_b"], PROMPT, NEW_TOKENS)

    # The source's digests are reused between snapshots of one version, never across an update.
    source.ok(
        "POST", "/update_weights_from_disk", {"model_path": str(checkpoints["llama"]), "weight_version": "default"}
    )
    again = sink.ok("POST", "/update_weights_from_peer", {"source_url": source.url})
    assert again["checksum"] == sink.checksum() == checksums["llama"] and again["weight_version"] == "default"


def test_snapshot_is_plain_safetensors(source, checksums):
    from safetensors.torch import load

    data = _snapshot_bytes(source)
    (length,) = struct.unpack("<Q", data[:8])
    metadata = json.loads(data[8 : 8 + length])["__metadata__"]
    info = source.info()
    assert metadata["weight_version"] == info["weight_version"] and metadata["instance_id"] == info["instance_id"]
    assert metadata["checksum"] == source.checksum()
    tensors = load(data)
    expected = (
        dict(load_model(source.model_dir).iter_checkpoint_tensors()) if info["weight_version"] == "default" else None
    )
    assert digest_named_tensors(tensors.items())[1] == metadata["checksum"]
    if expected is not None:
        assert tensors.keys() == expected.keys()
        assert all(torch.equal(tensors[name], expected[name]) for name in expected)


def test_wrong_expected_checksum_fails_with_weights_intact(source, sink, checksums):
    status, body = sink.post("/update_weights_from_peer", {"source_url": source.url, "checksum": "0" * 64})
    assert status == 400 and body["success"] is False and body["weights"] == "intact", body
    assert "checksum mismatch" in body["error"]["message"]
    assert sink.checksum() == checksums["llama"] and sink.info()["weight_version"] == "default"


def test_source_killed_mid_transfer_fails_cleanly(worker_factory, sink, checkpoints, checksums):
    victim = _start(worker_factory, checkpoints["llama_b"], *SLOW_SOURCE)
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(sink.post, "/update_weights_from_peer", {"source_url": victim.url, "timeout_s": 30})
        _sending(victim, 1)
        victim.proc.kill()
        status, body = result(fut, timeout=60)
    assert status == 400 and body["weights"] == "intact", body
    assert "snapshot" in body["error"]["message"] and "content length" in body["error"]["message"]
    assert sink.checksum() == checksums["llama"] and sink.info()["weight_state"] == "serving"


def test_update_on_the_source_cuts_its_stream_never_mixing(slow_source, sink, checkpoints, checksums):
    before = slow_source.proc.log_text(100_000).count("weights_snapshot: sending")
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(sink.post, "/update_weights_from_peer", {"source_url": slow_source.url, "timeout_s": 30})
        _sending(slow_source, before + 1)
        # Waits for the lease at most --snapshot-lease-wait-s, then cuts the stream and proceeds.
        slow_source.ok(
            "POST", "/update_weights_from_disk", {"model_path": str(checkpoints["llama_b"]), "weight_version": "b"}
        )
        status, body = result(fut, timeout=60)
    assert status == 400 and body["weights"] == "intact", body
    assert sink.checksum() == checksums["llama"] and sink.info()["weight_version"] == "default"
    assert slow_source.checksum() == checksums["llama_b"]
    log = slow_source.proc.log_text(100_000)
    assert "weights_snapshot cut" in log and "Traceback" not in log, log[-3000:]
    slow_source.ok(
        "POST", "/update_weights_from_disk", {"model_path": str(checkpoints["llama"]), "weight_version": "default"}
    )


def test_auth_and_caller_mistakes_change_nothing(source, sink, checksums):
    for method, path, body in (
        ("GET", "/weights_snapshot", None),
        ("POST", "/update_weights_from_peer", {"source_url": source.url}),
    ):
        status, answer = sink.call(method, path, body, headers={})
        assert status == 401 and answer["error"]["message"], (path, status, answer)
    for body, words in (
        ({}, ("source_url",)),
        ({"source_url": source.url, "timeout_s": -1}, ("timeout_s",)),
        ({"source_url": source.url, "checksum": "nope"}, ("checksum",)),
        ({"source_url": "ftp://127.0.0.1:1"}, ("scheme",)),
        ({"source_url": "http://169.254.169.254:80"}, ("metadata",)),
        ({"source_url": "http://metadata.google.internal"}, ("metadata",)),
        ({"source_url": "http://[fe80::1]:80"}, ("link-local",)),
        ({"source_url": source.url + "/weights_snapshot"}, ("scheme://host:port",)),
    ):
        sink.refused("/update_weights_from_peer", body, *words)
    assert sink.info()["weight_version"] == "default" and sink.checksum() == checksums["llama"]
    # A source that serves another version than the one expected: refused before any tensor byte is read.
    status, answer = sink.post("/update_weights_from_peer", {"source_url": source.url, "weight_version": "nope"})
    assert status == 400 and answer["weights"] == "intact" and "expected" in answer["error"]["message"], answer


def test_source_refuses_while_its_weights_are_not_whole(source):
    source.ok("POST", "/release_memory_occupation", {"tags": ["weights"]})
    try:
        status, answer = source.get("/weights_snapshot")
        assert status == 503 and "released" in answer["error"]["message"], answer
    finally:
        source.ok("POST", "/resume_memory_occupation", {"tags": ["weights"]})


def test_a_peer_of_another_model_is_refused_before_anything_is_written(worker_factory, source, checkpoints):
    other = _start(worker_factory, checkpoints["qwen2"])
    before = other.checksum()
    status, answer = other.post("/update_weights_from_peer", {"source_url": source.url})
    assert status == 400 and answer["weights"] == "intact", answer
    assert "do not fit this model" in answer["error"]["message"] and answer["bytes_received"] == 0
    assert other.checksum() == before
