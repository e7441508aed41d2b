"""Real processes over gloo (no HTTP): a trainer and two receivers in one weight-update group.

Each peer is ``python -m tests._transfer_peer``; the test compares the sha256 of
every bucket the trainer sent with what each receiver got, and checks that
every failure ends in a reported error instead of a hang.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.procs import ManagedProcess, free_port

pytestmark = pytest.mark.process

NUM_BUCKETS = 73
PEER_EXIT_TIMEOUT_S = 90  # a hang guard only: far above every timeout the peers are given


def run_peers(
    tmp: Path,
    *,
    world_size: int,
    trainer_rounds: list[dict],
    receiver_rounds: list[list[dict]],
    timeout_s: float,
    start_trainer: bool = True,
    wait_trainer: bool = True,
) -> tuple[dict | None, list[dict]]:
    port = free_port()
    base = {
        "port": port,
        "world_size": world_size,
        "group": "test_group",
        "num_buckets": NUM_BUCKETS,
        "seed": 7,
        "timeout_s": timeout_s,
    }
    procs: list[tuple[ManagedProcess, Path]] = []
    try:
        if start_trainer:
            out = tmp / "trainer.json"
            cfg = {**base, "rank": 0, "rounds": trainer_rounds, "out": str(out)}
            procs.append((_spawn("trainer", cfg), out))
        for i, rounds in enumerate(receiver_rounds, start=1):
            out = tmp / f"receiver{i}.json"
            cfg = {**base, "rank": i, "rounds": rounds, "out": str(out)}
            procs.append((_spawn("receiver", cfg), out))
        reports = []
        for index, (proc, out) in enumerate(procs):
            if index == 0 and start_trainer and not wait_trainer:
                reports.append(None)
                continue
            try:
                proc.proc.wait(timeout=PEER_EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{proc.name} hung:\n{proc.log_text()}")
            reports.append(_read(out, proc))
    finally:
        for proc, _ in procs:
            proc.kill()
    if start_trainer:
        return reports[0], reports[1:]
    return None, reports


def _spawn(role: str, cfg: dict[str, Any]) -> ManagedProcess:
    argv = [sys.executable, "-m", "tests._transfer_peer", role, json.dumps(cfg)]
    return ManagedProcess(f"{role}{cfg['rank']}", argv).start()


def _read(out: Path, proc: ManagedProcess) -> dict:
    if not out.exists():
        pytest.fail(f"{proc.name} wrote no report:\n{proc.log_text()}")
    report = json.loads(out.read_text())
    assert "crash" not in report, report["crash"]
    return report


class TestBytesArrive:
    def test_73_buckets_both_formats_streaming_and_atomic(self, tmp_path: Path) -> None:
        """Both formats and both modes deliver every byte; an apply failure drains the
        round (the trainer never blocks) and the group stays usable for the next round."""
        rounds = [
            {"format": "per_tensor"},
            {"format": "flattened_bucket"},
            {"format": "per_tensor", "atomic": True},
            {"format": "flattened_bucket", "atomic": True},
            {"format": "flattened_bucket", "fail_apply_at": 5},
            {"format": "flattened_bucket"},
        ]
        trainer, receivers = run_peers(
            tmp_path,
            world_size=3,
            timeout_s=60,
            trainer_rounds=[{"format": r["format"]} for r in rounds],
            receiver_rounds=[rounds, rounds],
        )
        assert trainer["init"] == "ok"
        assert all(r["ok"] for r in trainer["rounds"]), trainer["rounds"]
        for rep in receivers:
            assert rep["init"] == "ok"
            for index, (sent, got) in enumerate(zip(trainer["rounds"], rep["rounds"], strict=True)):
                if index == 4:
                    assert got["state"] == "failed"
                    assert "refusing bucket 5" in got["error"]
                    assert got["buckets_received"] == NUM_BUCKETS  # drained
                    assert got["group_broken"] is None
                    continue
                assert got["state"] in ("done", "staged"), got
                assert got["buckets_received"] == NUM_BUCKETS
                assert got["digests"] == sent["digests"]
            # Rounds use different seeds, so equal digests are not an accident.
            assert rep["rounds"][0]["digests"] != rep["rounds"][1]["digests"]


class TestFailures:
    def test_trainer_killed_mid_broadcast_fails_receivers(self, tmp_path: Path) -> None:
        rounds_stream = [{"format": "flattened_bucket"}]
        rounds_atomic = [{"format": "flattened_bucket", "atomic": True}]
        _, receivers = run_peers(
            tmp_path,
            world_size=3,
            timeout_s=30,
            trainer_rounds=[{"format": "flattened_bucket", "kill_after": 10}],
            receiver_rounds=[rounds_stream, rounds_atomic],
            wait_trainer=False,
        )
        for rep in receivers:
            (got,) = rep["rounds"]
            assert got["state"] == "failed"
            # The kill lands while bucket 10 is in flight; a few earlier ones may still be in the socket.
            assert 5 <= got["buckets_received"] < NUM_BUCKETS
            assert "receive failed at bucket" in got["error"]
            assert got["group_broken"]  # out of lockstep: unusable until re-created
        assert receivers[1]["rounds"][0]["digests"] == [None] * NUM_BUCKETS  # atomic: nothing applied

    def test_stalled_trainer_hits_receive_deadline(self, tmp_path: Path) -> None:
        _, receivers = run_peers(
            tmp_path,
            world_size=2,
            timeout_s=4,
            trainer_rounds=[{"format": "per_tensor", "stall_after": 3}],
            receiver_rounds=[[{"format": "per_tensor"}]],
            wait_trainer=False,
        )
        (got,) = receivers[0]["rounds"]
        assert got["state"] == "failed"
        assert got["buckets_received"] == 3
        assert "bucket 4/73" in got["error"]

    def test_missing_peer_fails_init(self, tmp_path: Path) -> None:
        trainer, receivers = run_peers(
            tmp_path,
            world_size=3,
            timeout_s=3,
            trainer_rounds=[],
            receiver_rounds=[[]],
        )
        assert trainer["init"].startswith("error:"), trainer
        assert receivers[0]["init"].startswith("error:"), receivers[0]
        assert "rank 1 of 3" in receivers[0]["init"]

    def test_no_trainer_fails_init(self, tmp_path: Path) -> None:
        _, receivers = run_peers(
            tmp_path, world_size=2, timeout_s=2, trainer_rounds=[], receiver_rounds=[[]], start_trainer=False
        )
        assert "nothing listens" in receivers[0]["init"]
