"""The trainer client after a failed sync: the router's prepared update ends at
once, the group is torn down on every side, and the next ``sync_weights`` of
the same client rebuilds it and succeeds.

Real parts: a router, two omni-workers on one tiny llama, and a trainer
process (``tests._router_trainer``, syncing through one ``AsyncRouterClient``)
whose broadcast callable raises before the second bucket of an atomic
two-phase sync.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests._router_fixtures import ADMIN_KEY, auth, generate_via, start_router, start_workers, workers
from tests._router_trainer import run_trainer
from tests._weight_sync_fixtures import WORKER_ARGS
from tests.procs import ManagedProcess, free_port, http_json

pytestmark = pytest.mark.process

#: The router's admin-lock wait: a pause arriving while a prepared update still
#: holds the lock is answered 503 after this long (rather than queued).
LOCK_TIMEOUT_S = 3


def test_failed_broadcast_ends_the_session_and_the_next_sync_rebuilds_the_group(checkpoints, tmp_path):
    pair = start_workers(checkpoints["llama"], 2, extra_args=["--admin-api-key", ADMIN_KEY, *WORKER_ARGS])
    urls = [url for _, url in pair]
    router, url = start_router(
        urls,
        admin_key=ADMIN_KEY,
        state_dir=tmp_path / "state",
        extra_args=["--admin-lock-timeout-s", str(LOCK_TIMEOUT_S)],
    )
    try:
        out = tmp_path / "report.json"
        cfg = {
            "router": url,
            "admin_key": ADMIN_KEY,
            "model": str(checkpoints["llama"]),
            "port": free_port(),
            "out": str(out),
            "bucket_bytes": 64 * 1024,
            "client": "async",
            # Every sync uses the same GroupSpec, hence the same master_port.
            "steps": [
                ["two_phase", "flattened_bucket", {"atomic": True, "fail_at_bucket": 1}],
                ["two_phase", "flattened_bucket", {"atomic": True}],
                ["two_phase", "flattened_bucket", {"atomic": True}],
            ],
        }
        before = http_json("POST", url + "/weights_checker", {"action": "checksum"}, headers=auth())[1][
            "rank_checksums"
        ]
        # Forked from the suite's fork server (torch already imported), as the other trainers are.
        trainer = ManagedProcess("trainer", [sys.executable, "-m", "tests._router_trainer", json.dumps(cfg)]).start()
        assert trainer.wait_exit(120) == 0, trainer.log_text(3000)
        report = json.loads(out.read_text())
        assert report["num_buckets"] > 2 and report["steps"], json.dumps(report, indent=1)[:3000]
        failed = report["steps"][0]

        # The failed sync: broadcast stage, weights uncertain, and the clean-up the client did.
        error = failed["failed"]
        assert error["stage"] == "broadcast" and error["weights_uncertain"] is True
        assert error["cause"] == "InjectedFailure" and "before sending bucket 1" in error["message"]
        assert failed["stages"] == ["init_group", "pause", "prepare"]
        recovery = error["recovery"]
        assert set(recovery) == {"abort_weights_update", "destroy_weights_update_group", "leave"}, recovery
        assert all(v.startswith("ok") for v in recovery.values()), recovery
        seen = failed["after_failure"]
        assert seen["joined_groups"] == []  # forgotten: the next sync initializes the group again
        # The prepared update was ended at once: the admin lock is free (no 503 after the lock timeout).
        assert seen["pause"] == {"status": 200}, seen["pause"]
        # Atomic: the dropped receive applied nothing, so nobody is fenced and the weights are the old ones.
        assert seen["journal_pending"] is None and seen["disabled"] == []
        assert seen["checksums"] == before

        # The next sync of the same client: group rebuilt (ranks assigned again), verified against the trainer.
        assert "error" not in report, json.dumps(report["error"], indent=1)[:3000] + router.log_text()[-3000:]
        recovered, after = report["steps"][1:]
        assert recovered["stages"][0] == "init_group" and recovered["stages"][-1] == "continue"
        assert recovered["world_size"] == 3
        assert sorted(r["rank_offset"] for r in recovered["group_init"]["ranks"]) == [1, 2]
        assert recovered["fleet_identical"] is True and recovered["matches_expected"] is True
        assert {c for per in recovered["rank_checksums"].values() for c in per} == {recovered["expected"]}
        # A sync after a good one uses the group as it is (the async client keeps what it joined).
        assert after["group_init"] is None and after["world_size"] is None and after["matches_expected"] is True
        checked = http_json("POST", url + "/weights_checker", {"action": "checksum"}, headers=auth())[1]
        assert checked["identical"] is True
        assert {c for per in checked["rank_checksums"].values() for c in per} == {after["expected"]}

        assert not any(w["disabled"] for w in workers(url, ADMIN_KEY))
        assert http_json("GET", url + "/weight_update_journal", headers=auth())[1]["pending"] is None
        status, body, _ = generate_via(url)
        assert status == 200 and body["meta_info"]["weight_version"] == "step-2"

        # A trainer that exits without leaving its group, then starts again (a new client, which holds no group,
        # while the router records the old one and the workers still hold it): its first sync has the workers
        # leave the old group, builds a new one and syncs.
        step = [["two_phase", "flattened_bucket"]]
        done, first = run_trainer(url, checkpoints["llama"], tmp_path, step, keep_group=True)
        assert done.returncode == 0 and "error" not in first, done.stderr[-3000:]
        assert http_json("GET", url + "/get_world_size", headers=auth())[1]["groups"], "the group is left over"
        done, again = run_trainer(url, checkpoints["llama"], tmp_path, step)
        assert done.returncode == 0 and "error" not in again, json.dumps(again)[:3000] + done.stderr[-3000:]
        restarted = again["steps"][0]
        assert restarted["stages"][0] == "init_group" and restarted["matches_expected"] is True, restarted
        assert "left over on the workers" in done.stderr
    finally:
        router.stop()
        for proc, _ in pair:
            proc.stop()
