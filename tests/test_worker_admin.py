"""Admin surface of a real worker: model/server info, the weights checker, health,
and the routes that are not implemented. Memory release/resume and the update policy
are checked in-process, test_worker_policy_inprocess.py."""

from __future__ import annotations

import pytest

from router.contract.admin import ModelInfo, WeightsCheckerResult
from worker.model import digest_named_tensors, load_model


@pytest.fixture(scope="module")
def aw(worker_factory, checkpoints):
    return worker_factory(checkpoints["llama"], "--step-delay-ms", "5", "--api-key", "gen-secret")


@pytest.fixture(scope="module")
def expected(checkpoints):
    model = load_model(checkpoints["llama"])
    return digest_named_tensors(model.iter_checkpoint_tensors())


def test_compare_before_snapshot_is_400(aw):
    status, body = aw.post("/weights_checker", {"action": "compare"})
    assert status == 400 and body["success"] is False
    assert "compare requires snapshot first" in body["message"]


def test_checksum_matches_the_checkpoint(aw, expected):
    digests, checksum = expected
    for method, body in (("POST", {"action": "checksum"}), ("GET", None), ("POST", {})):
        out = aw.ok(method, "/weights_checker", body)
        WeightsCheckerResult.model_validate(out)
        assert out["action"] == "checksum" and out["success"] is True
        assert out["per_gpu_checksum"] == checksum
        assert out["checksums"] == digests and out["tensor_count"] == len(digests)
        assert out["per_engine_checksum"] and out["per_engine_checksum"] != checksum
        assert out["ranks"][0]["per_gpu_checksum"] == checksum
        assert out["rank_results"][0]["per_gpu_checksum"] == checksum


def test_snapshot_compare_and_reset_tensors(aw, expected):
    snap = aw.ok("POST", "/weights_checker", {"action": "snapshot"})
    assert snap["per_gpu_checksum"] == expected[1]
    cmp = aw.ok("POST", "/weights_checker", {"action": "compare"})
    assert cmp["changed"] == [] and cmp["missing"] == [] and cmp["unexpected"] == []
    assert sorted(cmp["matched"]) == sorted(expected[0])
    # reset_tensors re-snapshots (sglang-omni); the weights themselves are untouched.
    reset = aw.ok("POST", "/weights_checker", {"action": "reset_tensors"})
    assert reset["per_gpu_checksum"] == expected[1]
    skipped = aw.ok("POST", "/weights_checker", {"action": "compare", "skip_tensor_list": ["model.norm.weight"]})
    assert skipped["missing"] == [] and "model.norm.weight" not in skipped["matched"]
    assert skipped["tensor_count"] == len(expected[0]) - 1
    status, body = aw.post("/weights_checker", {"action": "randomize"})
    assert status == 400 and "action" in body["error"]["message"]


def test_model_info_fields(aw, checkpoints):
    for path in ("/model_info", "/get_model_info"):
        for method in ("GET", "POST"):
            info = aw.ok(method, path)
            ModelInfo.model_validate(info)
            assert info["model_path"] == str(checkpoints["llama"])
            assert info["weight_version"] == "default" and info["tp_size"] == 1
            assert info["dtype"] == "float32" and info["device"] == "cpu"
            assert info["architectures"] == ["LlamaForCausalLM"] and info["model_type"] == "llama"
            assert info["is_paused"] is False and info["pause_mode"] is None and info["weights_partial"] is False
            assert info["supports_weight_update"] is True and info["supports_weight_checker"] is True
            assert info["is_generation"] is True and info["tokenizer_path"]
            assert info["rank_results"][0]["rank"] == 0
    assert aw.ok("GET", "/get_weight_version") == {"weight_version": "default"}


def test_server_info_hides_secrets(aw):
    for path in ("/server_info", "/get_server_info"):
        info = aw.ok("GET", path)
        assert info["api_key"] is None and info["api_key_set"] is True
        assert "gen-secret" not in str(info)
        assert info["internal_states"][0]["num_running_reqs"] == 0
        assert info["version"]


def test_health_and_unimplemented_routes(aw):
    assert aw.ok("GET", "/health")["status"] == "ok"
    assert aw.ok("GET", "/health_generate")["message"] == "ok"
    status, body = aw.post("/update_weights_from_tensor", {"serialized_named_tensors": ["gASV"]})
    assert status == 400 and "--allow-pickled-tensors" in body["error"]["message"]
    status, body = aw.get("/no_such_route")
    assert status == 404 and "error" in body
    status, body = aw.call("DELETE", "/model_info")
    assert status == 405 and "error" in body
    status, body = aw.get("/pause_generation")
    assert status == 405
