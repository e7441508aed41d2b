"""Weight updates through real processes: a trainer (rank 0) and two omni-workers over gloo.

The trainer is ``python -m tests._weight_sync_trainer``; it drives the real HTTP
routes and broadcasts with ``router.trainer.sender``. Checkpoint ``a`` is
served at start; the updates push the tensors of checkpoints ``c`` and ``b``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._weight_sync_fixtures import NUM_BUCKETS, PROMPTS, checksum, greedy, model_info, run_trainer, steps
from tests.procs import start_worker


@pytest.fixture(scope="module")
def reference(sync_ckpts: dict[str, str]) -> Iterator[str]:
    """A fresh worker started from checkpoint ``b``: what an updated worker must equal."""
    proc, url = start_worker(sync_ckpts["b"])
    try:
        yield url
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def two_phase_run(
    sync_ckpts: dict[str, str], sync_workers: list[str], tmp_path_factory: pytest.TempPathFactory
) -> dict:
    """One trainer session: a refused prepare, then per-tensor streaming (→ c), then
    flattened with worker 1 atomic and worker 2 streaming (→ b)."""
    before = [checksum(u) for u in sync_workers]
    report, _ = run_trainer(
        tmp_path_factory.mktemp("two-phase"),
        sync_workers,
        scenario="two_phase",
        rounds=[
            {"ckpt": sync_ckpts["a"], "bad_shape": True, "version": "bad"},
            {"ckpt": sync_ckpts["c"], "format": None, "version": "v1"},
            {"ckpt": sync_ckpts["b"], "format": "flattened_bucket", "atomic": [True, False], "version": "v2"},
        ],
    )
    return {"report": report, "before": before}


class TestTwoPhase:
    def test_bad_metadata_is_refused_before_any_broadcast(self, two_phase_run: dict) -> None:
        report = two_phase_run["report"]
        refused = steps(report, "prepare")[0]["answers"]
        for status, body in refused:
            assert status == 400 and body["status"] == "error"
            assert "shape [3, 5] does not match the model's [128, 64]" in body["message"]
        assert steps(report, "update")[0]["ok"] is False  # the trainer never broadcast
        after = steps(report, "after bad")[0]
        assert after["checksums"] == two_phase_run["before"]
        assert after["versions"] == ["default", "default"]

    @pytest.mark.parametrize(("round_index", "version"), [(1, "v1"), (2, "v2")])
    def test_73_buckets_arrive_and_checksums_match_the_trainer(
        self, two_phase_run: dict, round_index: int, version: str
    ) -> None:
        report = two_phase_run["report"]
        ready = steps(report, "prepare")[round_index]["answers"]
        assert all(status == 200 and body["status"] == "ready" for status, body in ready), ready
        completed = steps(report, "complete")[round_index - 1]["answers"]
        update = steps(report, "update")[round_index]
        assert update["ok"] is True, update
        for status, body in completed:
            assert status == 200 and body["success"] is True, body
            assert body["num_buckets_received"] == NUM_BUCKETS
            assert body["weight_version"] == version
            assert body["checksum"] == update["sent_checksum"]
        after = steps(report, f"after {version}")[0]
        assert after["checksums"] == [update["sent_checksum"]] * 2
        assert after["versions"] == [version, version]

    def test_rounds_really_changed_the_weights(self, two_phase_run: dict) -> None:
        sums = [steps(two_phase_run["report"], "update")[i]["sent_checksum"] for i in (1, 2)]
        assert len({*sums, two_phase_run["before"][0]}) == 3

    def test_generation_equals_a_worker_started_from_the_new_checkpoint(
        self, two_phase_run: dict, sync_workers: list[str], reference: str
    ) -> None:
        assert checksum(reference) == steps(two_phase_run["report"], "update")[2]["sent_checksum"]
        for url in sync_workers:
            info = model_info(url)
            assert not info["is_paused"] and not info["weights_partial"]
            for prompt in PROMPTS:
                assert greedy(url, prompt) == greedy(reference, prompt)


class TestSinglePhase:
    def test_slime_sequence_both_formats(
        self, sync_ckpts: dict[str, str], sync_workers: list[str], two_phase_run: dict, tmp_path: Path
    ) -> None:
        """slime's sequence: pause, flush, then per bucket the HTTP call fired first
        and the broadcast right after, ``flush_cache=false``, ``weight_version`` a string."""
        report, _ = run_trainer(
            tmp_path,
            sync_workers,
            scenario="single_phase",
            rounds=[
                {"ckpt": sync_ckpts["c"], "format": None, "version": "s1"},
                {"ckpt": sync_ckpts["a"], "format": "flattened_bucket", "version": "s2"},
            ],
        )
        for index, version in enumerate(("s1", "s2")):
            update = steps(report, "update")[index]
            assert update == {**update, "ok": True, "buckets": NUM_BUCKETS}, update
            after = steps(report, f"after {version}")[0]
            assert after["checksums"] == [update["sent_checksum"]] * 2
            assert after["versions"] == [version, version]
        assert steps(report, "update")[1]["sent_checksum"] == two_phase_run["before"][0]  # back to checkpoint a
        assert all(status == 200 for status, _ in steps(report, "disconnect")[0]["answers"])
