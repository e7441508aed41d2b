"""The whole weight-sync cycle through one router URL: a real trainer process,
two real workers, rank assignment by the router, both protocols and both
bucket formats; and the two-phase barrier when one worker cannot prepare."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._router_fixtures import (
    ADMIN_KEY,
    Fleet,
    auth,
    generate_via,
    start_router,
    workers,
)
from tests._router_trainer import run_trainer
from tests.procs import free_port, http_json

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def fleet(worker_fleet) -> Fleet:
    return worker_fleet(2, extra_args=["--admin-api-key", ADMIN_KEY])


@pytest.fixture(scope="module")
def qwen(worker_fleet, checkpoints) -> tuple[str, Path]:
    """A qwen2 worker beside the fleet's llama ones, and its checkpoint: qwen2's metadata (with qkv
    biases) suits only this worker."""
    served = worker_fleet(1, extra_args=["--admin-api-key", ADMIN_KEY], model=checkpoints["qwen2"])
    return served.urls[0], served.model


def test_full_sync_cycle_through_one_url(fleet: Fleet, tmp_path):
    urls, model = fleet.urls, fleet.model
    proc, url = start_router(urls, admin_key=ADMIN_KEY, state_dir=tmp_path / "state")
    try:
        steps = [
            ["two_phase", "flattened_bucket"],
            ["two_phase", None],
            ["single_phase", None],
            ["single_phase", "flattened_bucket"],
        ]
        done, report = run_trainer(url, str(model), tmp_path, steps)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "error" not in report, json.dumps(report.get("error"), indent=1)[:3000] + proc.log_text()
        assert report["world_size"] == 3 and report["num_buckets"] > 1
        first = report["steps"][0]
        # The router gave each worker its own rank: 1 and 2 (the trainer is 0).
        assert sorted(r["rank_offset"] for r in first["group_init"]["ranks"]) == [1, 2]
        for step in report["steps"]:
            assert step["fleet_identical"] is True and step["matches_expected"] is True
            assert len(set(step["checksums"].values())) == 1
            assert step["stages"][-1] == "continue"
        assert [s["protocol"] for s in report["steps"]] == ["two_phase", "two_phase", "single_phase", "single_phase"]
        assert {w["weight_version"] for w in workers(url, ADMIN_KEY)} == {"step-3"}
        assert not any(w["disabled"] for w in workers(url, ADMIN_KEY))
        status, body, _ = generate_via(url)
        assert status == 200 and body["meta_info"]["weight_version"] == "step-3"
        assert http_json("GET", url + "/weight_update_journal", headers=auth())[1]["pending"] is None
    finally:
        proc.stop()


def test_prepare_error_on_one_worker_releases_the_others(fleet: Fleet, qwen, tmp_path):
    import torch

    from router.trainer import BucketPlan, TrainerWeightSender
    from router.trainer.rendezvous import alongside
    from worker.model.checkpoint import read_checkpoint

    # One llama worker (it may have synced already: what it serves must not change here) and the qwen2 one.
    qwen_url, qwen = qwen
    urls = [fleet.urls[0], qwen_url]
    status, body = http_json(
        "POST", urls[1] + "/abort_weights_update", {"group_name": "weight_update_group"}, headers=auth()
    )
    assert status == 400 and "no prepared weight update" in body["message"]  # nothing to abort yet
    before = [
        http_json("POST", u + "/weights_checker", {"action": "checksum"}, headers=auth())[1]["per_gpu_checksum"]
        for u in urls
    ]
    versions = [http_json("GET", u + "/model_info", headers=auth())[1]["weight_version"] for u in urls]
    proc, url = start_router(urls, admin_key=ADMIN_KEY, state_dir=tmp_path / "state")
    sender = TrainerWeightSender(master_port=free_port(), world_size=3, timeout_s=30)
    try:
        init = sender.init_request(1)
        answer = alongside(
            lambda: http_json("POST", url + "/init_weights_update_group", init, headers=auth(), timeout=90),
            sender.join,
            timeout_s=120,
            what="init",
        )
        assert answer[0] == 200, answer
        tensors = dict(read_checkpoint(qwen, torch.float32))
        plan = BucketPlan.from_named_tensors(tensors, budget_bytes=64 * 1024)
        status, body = http_json(
            "POST", url + "/prepare_weights_update", plan.prepare_request(timeout_s=20), headers=auth()
        )
        assert status == 502 and body["status"] == "error"
        ok = {r["url"]: r["success"] for r in body["results"]}
        assert ok == {urls[0]: False, urls[1]: True}
        (dropped,) = body["aborts"]
        assert dropped["success"] is True and dropped["body"]["weights_partial"] is False
        # Nothing was received anywhere, so nobody is fenced and the lock is free again.
        assert not any(w["disabled"] for w in workers(url, ADMIN_KEY))
        assert http_json("GET", url + "/weight_update_journal", headers=auth())[1]["pending"] is None
        after = [
            http_json("POST", u + "/weights_checker", {"action": "checksum"}, headers=auth())[1]["per_gpu_checksum"]
            for u in urls
        ]
        assert after == before
        for u, version in zip(urls, versions, strict=True):
            info = http_json("GET", u + "/model_info", headers=auth())[1]
            assert not info["is_paused"] and not info["weights_partial"] and info["weight_version"] == version
        assert http_json("POST", url + "/pause_generation", {"mode": "retract"}, headers=auth())[0] == 200
        assert http_json("POST", url + "/continue_generation", {}, headers=auth())[0] == 200
        # The dropped receive had been posted: that worker's side of the group is out of
        # lockstep, so the next prepare is refused there until the group is re-initialized.
        # The other worker refuses the layout too, so every target refused untouched: the
        # router answers with the workers' own 4xx and fences nobody.
        status, body = http_json("POST", url + "/prepare_weights_update", plan.prepare_request(), headers=auth())
        assert status == 400, body
        assert "2 of 2 worker(s) not ready" in body["error"]["message"]
        refused = {r["url"]: r["body"]["message"] for r in body["results"]}
        assert "a prepared receive was aborted" in refused[urls[1]] and "re-initialize" in refused[urls[1]]
        assert all(r["body"]["weights"] == "intact" for r in body["results"])
        assert not any(w["disabled"] for w in workers(url, ADMIN_KEY))
        status, body = http_json(
            "POST",
            url + "/destroy_weights_update_group",
            {"group_name": "weight_update_group"},
            headers=auth(),
            timeout=20,
        )
        assert status == 200, body
    finally:
        sender.close()
        proc.stop()
