"""/update_weights_from_disk and /update_weight_version on a real worker.

Successful updates change outputs, ``weight_version`` and the weights checksum
(which then equals the checkpoint's own). The refusals (bad checkpoints, requests
holding KV) are checked in-process, test_worker_policy_inprocess.py.
"""

from __future__ import annotations

import pytest

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
    # SGLang's meaning: the version of the last span, whose tokens were generated before the relabel aborted it.
    spans = out["meta_info"]["weight_versions"]
    assert out["meta_info"]["weight_version"] == spans[-1]["version"] in ("default", "v-keep")
    assert uw.ok("GET", "/get_weight_version") == {"weight_version": "v-abort"}
