"""Aborting a prepared update, and updates refused while requests are active.

One real omni-worker (slowed with ``--step-delay-ms`` so a request stays in
flight); the test process is the trainer (rank 0 of a real gloo group) and
drives the worker's HTTP routes. Every test reads the state it starts from.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from router.trainer.rendezvous import alongside
from router.trainer.sender import BucketPlan, TrainerWeightSender, sent_checksum
from tests._router_fixtures import wait_for
from tests._weight_sync_fixtures import WORKER_ARGS
from tests._worker_helpers import Worker
from tests.procs import free_port, start_worker
from worker.model import read_checkpoint

GROUP = "weight_update_group"
BROKEN = f"group {GROUP!r} is broken (a prepared receive was aborted); destroy and re-initialize it"
GROUP_TIMEOUT_S = 60.0
#: Bounds calls that must not wait for a pending receive; well below the group's own timeout.
PROMPT_CALL_TIMEOUT_S = 20.0
BUCKET_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def worker(sync_ckpts: dict[str, str]) -> Iterator[Worker]:
    proc, url = start_worker(sync_ckpts["a"], extra_args=[*WORKER_ARGS, "--step-delay-ms", "20"])
    try:
        yield Worker(proc, url, Path(sync_ckpts["a"]))
    finally:
        proc.stop()


def join(worker: Worker) -> TrainerWeightSender:
    sender = TrainerWeightSender(master_port=free_port(), world_size=2, timeout_s=GROUP_TIMEOUT_S)
    init = sender.init_request(1)
    status, body = alongside(
        lambda: worker.post("/init_weights_update_group", init, timeout=90), sender.join, timeout_s=120, what="init"
    )
    assert status == 200 and body["success"], body
    return sender


@pytest.fixture
def sender(worker: Worker) -> Iterator[TrainerWeightSender]:
    """A group of the trainer (this process) and the worker; left by both afterwards."""
    s = join(worker)
    try:
        yield s
    finally:
        worker.post("/destroy_weights_update_group", {"group_name": GROUP}, timeout=PROMPT_CALL_TIMEOUT_S)
        s.close()


def weights(path: str) -> tuple[dict[str, torch.Tensor], BucketPlan]:
    tensors = dict(read_checkpoint(path, torch.float32))
    return tensors, BucketPlan.from_named_tensors(tensors, budget_bytes=BUCKET_BYTES)


def two_phase(worker: Worker, sender: TrainerWeightSender, path: str, version: str, **prepare: object) -> str:
    """A whole update of ``path``'s tensors (prepare, broadcast, complete); returns the checksum the trainer sent."""
    tensors, plan = weights(path)
    status, ready = worker.post(
        "/prepare_weights_update", plan.prepare_request(GROUP, weight_version=version, timeout_s=30, **prepare)
    )
    assert status == 200 and ready["status"] == "ready", ready
    sender.send(plan, tensors)
    complete = {"group_name": GROUP, "weight_version": version, "return_checksum": True, "timeout_s": 30}
    status, result = worker.post("/complete_weights_update", complete)
    assert status == 200 and result["checksum"] == sent_checksum(tensors.items()), result
    return result["checksum"]


def abort(worker: Worker, **kw: object) -> tuple[int, dict]:
    return worker.post("/abort_weights_update", {"group_name": GROUP}, timeout=PROMPT_CALL_TIMEOUT_S, **kw)


class TestAbort:
    def test_nothing_prepared_is_a_clear_400(self, worker: Worker) -> None:
        status, body = abort(worker)
        assert status == 400 and body["success"] is False and body["weights_partial"] is False
        assert body["message"] == f"no prepared weight update for group {GROUP!r} to abort"
        assert body["error"]["message"] == body["message"]
        status, body = worker.post("/abort_weights_update", {"group_name": ""})
        assert status == 400 and "group_name" in body["error"]["message"]

    def test_before_any_broadcast_drops_the_receive_and_breaks_the_group(
        self, worker: Worker, sender: TrainerWeightSender, sync_ckpts: dict[str, str]
    ) -> None:
        before, version = worker.checksum(), worker.info()["weight_version"]
        _, plan = weights(sync_ckpts["c"])
        status, body = worker.post(
            "/prepare_weights_update", plan.prepare_request(GROUP, weight_version="never", timeout_s=30)
        )
        assert status == 200 and body["status"] == "ready", body
        assert worker.info()["is_paused"]  # a streaming update holds generation

        status, body = abort(worker)
        assert status == 200 and body["success"] is True and body["weights_partial"] is False, body
        assert f"0 of {len(plan.buckets)} bucket(s) received, none applied" in body["message"]
        assert "a prepared receive was aborted" in body["message"]
        info = worker.info()
        assert not info["is_paused"] and not info["weights_partial"] and info["weight_version"] == version
        assert worker.checksum() == before
        assert worker.generate([1, 2, 3], max_new_tokens=2)["meta_info"]["finish_reason"]["type"] == "length"

        # The group is out of lockstep: every later use fails fast and says why.
        status, body = worker.post("/prepare_weights_update", plan.prepare_request(GROUP))
        assert status == 400 and body["status"] == "error" and body["message"] == BROKEN
        single = {**plan.metadata()[0].model_dump(), "group_name": GROUP}
        status, body = worker.post("/update_weights_from_distributed", single)
        assert status == 400 and body["message"] == f"Failed to update parameter online: {BROKEN}."
        assert abort(worker)[0] == 400  # dropped already

    def test_a_bucket_broadcast_after_the_abort_is_dropped(
        self, worker: Worker, sender: TrainerWeightSender, sync_ckpts: dict[str, str]
    ) -> None:
        before = worker.checksum()
        tensors, plan = weights(sync_ckpts["c"])
        body = plan.prepare_request(GROUP, load_format="flattened_bucket", timeout_s=30)
        assert worker.post("/prepare_weights_update", body)[1]["status"] == "ready"
        assert abort(worker)[1]["success"] is True
        # A trainer that broadcasts anyway: the posted receive takes the bytes and throws them away.
        sender.send(BucketPlan(plan.buckets[:1], plan.budget_bytes), tensors, load_format="flattened_bucket")
        assert worker.checksum() == before
        info = worker.info()
        assert not info["weights_partial"] and not info["is_paused"]

    def test_destroy_with_a_pending_receive_returns_and_a_new_group_works(
        self, worker: Worker, sync_ckpts: dict[str, str]
    ) -> None:
        old = join(worker)
        try:
            _, plan = weights(sync_ckpts["c"])
            assert (
                worker.post("/prepare_weights_update", plan.prepare_request(GROUP, timeout_s=45))[1]["status"]
                == "ready"
            )
            assert abort(worker)[0] == 200
            # The trainer still holds its side, so the worker's receive stays posted; leaving
            # the group must not wait for it (the call's timeout is well below the group's).
            status, body = worker.post(
                "/destroy_weights_update_group", {"group_name": GROUP}, timeout=PROMPT_CALL_TIMEOUT_S
            )
            assert status == 200 and body["success"], body
            assert worker.get("/health")[0] == 200
        finally:
            old.close()
        new = join(worker)
        try:
            sent = two_phase(worker, new, sync_ckpts["b"], "after-abort")
            assert worker.checksum() == sent and worker.info()["weight_version"] == "after-abort"
        finally:
            worker.post("/destroy_weights_update_group", {"group_name": GROUP})
            new.close()

    def test_after_buckets_were_applied_the_worker_stays_fenced(
        self, worker: Worker, sender: TrainerWeightSender, sync_ckpts: dict[str, str]
    ) -> None:
        before, version = worker.checksum(), worker.info()["weight_version"]
        tensors, plan = weights(sync_ckpts["c"])
        assert worker.post("/prepare_weights_update", plan.prepare_request(GROUP, timeout_s=30))[1]["status"] == "ready"
        sender.send(BucketPlan(plan.buckets[:3], plan.budget_bytes), tensors)  # the trainer had started
        wait_for(lambda: worker.info()["weights_partial"], 30, worker.proc, "a streamed bucket applied")

        status, body = abort(worker)
        assert status == 400 and body["success"] is False and body["weights_partial"] is True, body
        assert "bucket(s) had already been applied" in body["message"]
        assert "a prepared receive was aborted" in body["message"]
        info = worker.info()
        assert info["is_paused"] and info["weights_partial"] and info["weight_version"] == version
        assert worker.checksum() != before
        status, body = worker.post("/prepare_weights_update", plan.prepare_request(GROUP))
        assert status == 400 and body["message"] == BROKEN

        # Repair: a new group and a full update, then continue.
        assert (
            worker.post("/destroy_weights_update_group", {"group_name": GROUP}, timeout=PROMPT_CALL_TIMEOUT_S)[0] == 200
        )
        sender.close()
        repaired = join(worker)
        try:
            sent = two_phase(worker, repaired, sync_ckpts["a"], "repaired")
        finally:
            worker.post("/destroy_weights_update_group", {"group_name": GROUP})
            repaired.close()
        assert worker.checksum() == sent and not worker.info()["weights_partial"]
        worker.ok("POST", "/continue_generation", {})
        assert not worker.info()["is_paused"]


class TestActiveRequests:
    """Updates are refused while a request holds KV computed with the current weights,
    unless the caller asks to abort them (``abort_all_requests``)."""

    @pytest.fixture
    def in_flight(self, worker: Worker) -> Iterator[object]:
        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(worker.generate, [5, 6, 7], max_new_tokens=400)
            worker.wait_running(1)
            yield future
            # Whatever the test did, the request ends (aborted, or finished).
            future.result(timeout=60)

    def test_prepare_refused_then_proceeds_with_abort_all_requests(
        self, worker: Worker, sender: TrainerWeightSender, in_flight, sync_ckpts: dict[str, str]
    ) -> None:
        before, version = worker.checksum(), worker.info()["weight_version"]
        _, plan = weights(sync_ckpts["c"])
        status, body = worker.post("/prepare_weights_update", plan.prepare_request(GROUP))
        assert status == 400 and body["status"] == "error", body
        assert "cannot update weights: 1 active request(s) hold KV cache" in body["message"]
        assert "abort_all_requests=true" in body["message"]
        assert worker.checksum() == before and worker.info()["weight_version"] == version
        assert worker.state()["num_running_reqs"] == 1 and not worker.info()["is_paused"]

        sent = two_phase(worker, sender, sync_ckpts["c"], "forced", abort_all_requests=True)
        assert in_flight.result(timeout=60)["meta_info"]["finish_reason"]["type"] == "abort"
        assert worker.checksum() == sent != before and worker.info()["weight_version"] == "forced"

    def test_single_phase_refused_then_proceeds_with_abort_all_requests(
        self, worker: Worker, sender: TrainerWeightSender, in_flight, sync_ckpts: dict[str, str]
    ) -> None:
        before = worker.checksum()
        tensors, plan = weights(sync_ckpts["b"])
        single = {**plan.metadata()[0].model_dump(), "group_name": GROUP}
        status, body = worker.post("/update_weights_from_distributed", single)
        assert status == 400 and body["success"] is False
        assert body["message"].startswith(
            "Failed to update parameter online: cannot update weights: 1 active request(s)"
        )
        assert worker.checksum() == before and worker.state()["num_running_reqs"] == 1

        for i, meta in enumerate(plan.metadata()):  # slime's sequence: per bucket, the call and its broadcast at once
            forced = {
                **meta.model_dump(),
                "group_name": GROUP,
                "abort_all_requests": True,
                "weight_version": "forced-single",
            }
            status, body = alongside(
                lambda forced=forced: worker.post("/update_weights_from_distributed", forced),
                lambda i=i: sender.send_bucket(plan, i, tensors),
                timeout_s=120,
                what="update_weights_from_distributed",
            )
            assert status == 200 and body["success"], body
        assert in_flight.result(timeout=60)["meta_info"]["finish_reason"]["type"] == "abort"
        assert worker.checksum() == sent_checksum(tensors.items()) != before
        assert worker.info()["weight_version"] == "forced-single"
