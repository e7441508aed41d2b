"""/update_weights_from_disk and /update_weight_version on a real worker.

Successful updates change outputs, ``weight_version`` and the weights checksum
(which then equals the checkpoint's own); failed ones change nothing, bit for
bit. Updates are refused while requests hold KV unless they are aborted.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from router.contract.admin import UpdateWeightsFromDiskResult
from tests._worker_helpers import result
from worker.model import digest_named_tensors, load_model


@pytest.fixture(scope="module")
def uw(worker_factory, checkpoints):
    return worker_factory(checkpoints["llama"], "--step-delay-ms", "10")


@pytest.fixture(scope="module")
def expected_checksums(checkpoints):
    return {
        key: digest_named_tensors(load_model(path).iter_checkpoint_tensors())[1] for key, path in checkpoints.items()
    }


@pytest.fixture(autouse=True)
def _back_to_a(uw, checkpoints):
    yield
    uw.post("/continue_generation", {})
    uw.post(
        "/update_weights_from_disk",
        {"model_path": str(checkpoints["llama"]), "weight_version": "default", "abort_all_requests": True},
    )


def _variant(tmp_path, src, name, mutate=None, config=None):
    """A copy of checkpoint ``src`` with its tensors / config changed."""
    out = tmp_path / name
    shutil.copytree(src, out)
    if mutate is not None:
        tensors = load_file(str(out / "model.safetensors"))
        mutate(tensors)
        save_file(tensors, str(out / "model.safetensors"))
    if config is not None:
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(config)
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_update_changes_outputs_version_and_checksum(uw, checkpoints, expected_checksums):
    before = uw.generate("update me", 16)
    assert uw.checksum() == expected_checksums["llama"]
    uw.ok("POST", "/weights_checker", {"action": "snapshot"})

    body = uw.ok(
        "POST",
        "/update_weights_from_disk",
        {"model_path": str(checkpoints["llama_b"]), "weight_version": "step-1", "token_step": 7},
    )
    parsed = UpdateWeightsFromDiskResult.model_validate(body)
    assert parsed.success is True and parsed.num_paused_requests == 0
    assert body["rank_results"][0]["success"] is True
    info = uw.info()
    assert (
        info["weight_version"] == "step-1"
        and info["model_path"] == str(checkpoints["llama_b"])
        and info["is_paused"] is False
    )
    assert uw.ok("GET", "/get_weight_version") == {"weight_version": "step-1"}

    after = uw.generate("update me", 16)
    assert after["output_ids"] != before["output_ids"]
    assert after["meta_info"]["weight_version"] == "step-1"
    assert uw.checksum() == expected_checksums["llama_b"]

    status, diff = uw.post("/weights_checker", {"action": "compare"})
    assert status == 400 and diff["success"] is False
    assert diff["changed"] and not diff["missing"] and not diff["unexpected"]

    uw.ok("POST", "/update_weights_from_disk", {"model_path": str(checkpoints["llama"])})
    assert uw.generate("update me", 16)["output_ids"] == before["output_ids"]
    assert uw.info()["weight_version"] == "step-1"  # unchanged when the request names none
    compare = uw.ok("POST", "/weights_checker", {"action": "compare"})
    assert compare["changed"] == [] and len(compare["matched"]) == compare["tensor_count"]


def _bad_checkpoints(tmp_path, src, qwen):
    def wrong_shape(t):
        t["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 100)

    def missing(t):
        del t["model.layers.3.self_attn.v_proj.weight"]

    def unknown(t):
        t["model.layers.9.mlp.extra.weight"] = torch.zeros(2, 2)

    corrupt = _variant(tmp_path, src, "corrupt")
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])
    garbage = _variant(tmp_path, src, "garbage")
    (garbage / "model.safetensors").write_bytes(b"\xff" * 64)
    no_config = _variant(tmp_path, src, "no-config")
    (no_config / "config.json").unlink()
    no_weights = _variant(tmp_path, src, "no-weights")
    (no_weights / "model.safetensors").unlink()
    return {
        "corrupt": (corrupt, ""),
        "garbage": (garbage, ""),
        "wrong shape": (_variant(tmp_path, src, "shape", wrong_shape), "shape"),
        "missing tensor": (_variant(tmp_path, src, "missing", missing), "missing"),
        "unknown tensor": (_variant(tmp_path, src, "unknown", unknown), "unknown"),
        "other hidden size": (_variant(tmp_path, src, "hidden", config={"hidden_size": 32}), "hidden_size"),
        "other architecture": (qwen, "architecture"),
        "no config": (no_config, "config.json"),
        "no safetensors": (no_weights, "safetensors"),
        "not a directory": (tmp_path / "does-not-exist", "not an existing directory"),
    }


def test_failed_updates_leave_weights_bit_for_bit(uw, checkpoints, tmp_path, expected_checksums):
    before = uw.generate("stable", 16)["output_ids"]
    uw.ok("POST", "/update_weight_version", {"new_version": "v-stable"})
    for label, (path, hint) in _bad_checkpoints(tmp_path, checkpoints["llama_b"], checkpoints["qwen2"]).items():
        status, body = uw.post("/update_weights_from_disk", {"model_path": str(path), "weight_version": "never"})
        assert status == 400, (label, body)
        assert body["success"] is False and body["error"]["message"] == body["message"], label
        assert hint.lower() in body["message"].lower(), (label, body["message"])
    status, body = uw.post(
        "/update_weights_from_disk", {"model_path": str(checkpoints["llama_b"]), "load_format": "gguf"}
    )
    assert status == 400 and "load_format" in body["message"]

    assert uw.checksum() == expected_checksums["llama"]
    assert uw.generate("stable", 16)["output_ids"] == before
    info = uw.info()
    assert (
        info["weight_version"] == "v-stable"
        and info["model_path"] == str(checkpoints["llama"])
        and not info["weights_partial"]
    )


def test_update_refused_while_active_unless_aborting(uw, pool, checkpoints, expected_checksums):
    fut = pool.submit(uw.generate, "long", 500)
    uw.wait_running(1)
    status, body = uw.post("/update_weights_from_disk", {"model_path": str(checkpoints["llama_b"])})
    assert status == 400 and "active request" in body["message"]
    assert uw.checksum() == expected_checksums["llama"]
    assert uw.state()["num_running_reqs"] == 1  # still running

    body = uw.ok(
        "POST",
        "/update_weights_from_disk",
        {"model_path": str(checkpoints["llama_b"]), "abort_all_requests": True, "weight_version": "w2"},
    )
    assert body["num_aborted"] == 1
    out = result(fut)
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["meta_info"]["completion_tokens"] < 500
    assert out["meta_info"]["weight_version"] == "default"  # answered before the weights changed
    assert uw.info()["weight_version"] == "w2"
    assert uw.checksum() == expected_checksums["llama_b"]


def test_update_while_retract_paused_keeps_pause_and_requests_finish(uw, pool, checkpoints, expected_checksums):
    futures = [pool.submit(uw.generate, f"q{i}", 30) for i in range(2)]
    uw.wait_running(2)
    uw.ok("POST", "/pause_generation", {"mode": "retract"})
    body = uw.ok(
        "POST", "/update_weights_from_disk", {"model_path": str(checkpoints["llama_b"]), "weight_version": "w3"}
    )
    assert body["num_paused_requests"] == 2
    info = uw.info()
    assert info["is_paused"] is True and info["pause_mode"] == "retract"
    assert not any(f.done() for f in futures)
    uw.ok("POST", "/continue_generation", {})
    outs = [result(f) for f in futures]
    assert all(o["meta_info"]["finish_reason"] == {"type": "length", "length": 30} for o in outs)
    assert all(o["meta_info"]["weight_version"] == "w3" for o in outs)
    assert uw.checksum() == expected_checksums["llama_b"]


def test_keep_pause_leaves_generation_paused(uw, pool, checkpoints):
    body = uw.ok(
        "POST",
        "/update_weights_from_disk",
        {"model_path": str(checkpoints["llama_b"]), "keep_pause": True, "flush_cache": False},
    )
    assert body["is_paused"] is True
    info = uw.info()
    assert info["is_paused"] is True and info["pause_mode"] == "in_place"
    fut = pool.submit(uw.generate, "after keep_pause", 4)
    uw.wait_state(lambda s: s["num_waiting_reqs"] == 1, what="the request to queue")
    uw.ok("POST", "/continue_generation", {})
    assert result(fut)["meta_info"]["completion_tokens"] == 4


def test_update_weight_version_aborts_by_default(uw, pool):
    fut = pool.submit(uw.generate, "versioned", 500)
    uw.wait_running(1)
    body = uw.ok("POST", "/update_weight_version", {"new_version": "v-keep", "abort_all_requests": False})
    assert body == {**body, "success": True, "new_version": "v-keep", "message": "Weight version updated to v-keep"}
    assert uw.state()["num_running_reqs"] == 1
    body = uw.ok("POST", "/update_weight_version", {"new_version": "v-abort"})
    assert body["num_aborted"] == 1
    out = result(fut)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["weight_version"] == "v-abort"  # read when the response is built
    assert uw.ok("GET", "/get_weight_version") == {"weight_version": "v-abort"}
