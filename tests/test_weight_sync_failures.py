"""Weight-sync failures through real processes: nothing hangs, and each worker ends in
the documented state (streaming: paused and partial; atomic: old weights, serving)."""

from __future__ import annotations

import threading
from pathlib import Path

from tests._weight_sync_fixtures import PROMPTS, checksum, greedy, model_info, run_trainer, steps
from tests.procs import free_port, http_json

GROUP = "weight_update_group"


def poll_health_while(url: str, busy: threading.Thread) -> list[int]:
    """Hit /health until ``busy`` ends; every answer's status."""
    statuses = []
    while busy.is_alive():
        statuses.append(http_json("GET", url + "/health", timeout=5)[0])
        busy.join(0.1)
    return statuses


class TestProtocolMisuse:
    def test_prepare_without_group_and_complete_without_prepare(self, sync_workers: list[str]) -> None:
        url = sync_workers[0]
        bucket = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]}
        status, body = http_json(
            "POST", url + "/prepare_weights_update", {"num_buckets": 1, "buckets": [bucket], "group_name": "nope"}
        )
        assert status == 400 and body["status"] == "error" and "not initialized" in body["message"]
        status, body = http_json("POST", url + "/complete_weights_update", {"group_name": "nope"})
        assert status == 400 and body["success"] is False and "no weight update was prepared" in body["message"]
        status, body = http_json(
            "POST",
            url + "/update_weights_from_distributed",
            {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1], [1]]},
        )
        assert status == 400 and "equal lengths" in body["error"]["message"]
        status, body = http_json("POST", url + "/destroy_weights_update_group", {"group_name": "nope"})
        assert status == 400 and body["message"] == "The group to be destroyed does not exist."


class TestInitFailures:
    def test_peer_never_arrives_fails_while_health_answers(self, sync_workers: list[str]) -> None:
        url = sync_workers[0]
        answer: dict = {}
        body = {
            "master_address": "127.0.0.1",
            "master_port": free_port(),
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "lonely",
            "timeout_s": 3,
        }
        call = threading.Thread(
            target=lambda: answer.update(r=http_json("POST", url + "/init_weights_update_group", body))
        )
        call.start()
        health = poll_health_while(url, call)
        status, reply = answer["r"]
        assert status == 400 and reply["success"] is False
        assert reply["message"].startswith("Failed to initialize custom process group")
        assert len(health) >= 3 and set(health) == {200}

    def test_wrong_world_size_fails_on_both_sides(self, sync_workers: list[str], tmp_path: Path) -> None:
        """The trainer hosts a world of 3; the only worker believes it is 2."""
        url = sync_workers[0]
        box: dict = {}
        run = threading.Thread(
            target=lambda: box.update(
                r=run_trainer(tmp_path, [url], scenario="join", world_size=3, worker_world_sizes=[2], timeout_s=3)
            )
        )
        run.start()
        health = poll_health_while(url, run)
        report, _ = box["r"]
        (connect,) = steps(report, "connect")
        assert connect["ok"] is False and "rank 0 of 3" in connect["error"]
        assert len(health) >= 3 and set(health) == {200}
        # The worker's failed join left nothing behind: the name is free again.
        status, body = http_json("POST", url + "/destroy_weights_update_group", {"group_name": GROUP})
        assert status == 400 and "does not exist" in body["message"]


class TestTrainerKilledMidBroadcast:
    def test_streaming_partial_and_paused_atomic_intact_and_serving(
        self, sync_ckpts: dict[str, str], sync_workers: list[str], tmp_path: Path
    ) -> None:
        streaming, atomic = sync_workers
        before = [checksum(u) for u in sync_workers]
        outputs_before = [greedy(atomic, p) for p in PROMPTS]
        report, _ = run_trainer(
            tmp_path,
            sync_workers,
            scenario="two_phase",
            pause=False,
            timeout_s=20,
            rounds=[
                {
                    "ckpt": sync_ckpts["c"],
                    "format": "flattened_bucket",
                    "atomic": [False, True],
                    "version": "dead",
                    "kill_after": 20,
                }
            ],
        )
        assert steps(report, "killing"), report  # it died mid-broadcast, after a ready prepare
        assert all(body["status"] == "ready" for _, body in steps(report, "prepare")[0]["answers"])

        for url in sync_workers:
            status, body = http_json("POST", url + "/complete_weights_update", {"group_name": GROUP, "timeout_s": 15})
            assert status == 400 and body["success"] is False, body
            assert 0 < body["num_buckets_received"] < 73
            assert "receive failed" in body["message"] or "still at bucket" in body["message"]
            if url == streaming:
                assert body["weights_partial"] is True and "partially updated" in body["message"]

        info = model_info(streaming)
        assert info["is_paused"] and info["weights_partial"] and info["weight_version"] == "default"
        assert checksum(streaming) != before[0]

        info = model_info(atomic)
        assert not info["is_paused"] and not info["weights_partial"] and info["weight_version"] == "default"
        assert checksum(atomic) == before[1]
        assert [greedy(atomic, p) for p in PROMPTS] == outputs_before

        # The group is out of lockstep: destroy it on both workers, then a full update repairs the streaming one.
        for url in sync_workers:
            assert http_json("POST", url + "/destroy_weights_update_group", {"group_name": GROUP})[0] == 200
        report, _ = run_trainer(
            tmp_path,
            sync_workers,
            scenario="two_phase",
            rounds=[{"ckpt": sync_ckpts["a"], "format": None, "version": "repaired"}],
        )
        assert steps(report, "update")[0]["ok"] is True, report
        for url in sync_workers:
            info = model_info(url)
            assert not info["weights_partial"] and not info["is_paused"] and info["weight_version"] == "repaired"
            assert checksum(url) == before[0]
        assert [greedy(streaming, p) for p in PROMPTS] == outputs_before
