"""A weight-sync call's own ``timeout_s`` caps its wait for the worker's weight-sync call lock.

One real omni-worker; the test process is the trainer (rank 0 of a real gloo group). A
``/complete_weights_update`` waits for a receive the trainer has not sent yet, and holds the
worker's call lock meanwhile. A ``/prepare_weights_update`` and an
``/update_weights_from_distributed`` behind it, each with a short ``timeout_s``, answer 503 once
their own ``timeout_s`` has passed, not after the lock's 30 s default, and change nothing: the
trainer then sends, and the held update completes as it was prepared.
"""

from __future__ import annotations

import time
import urllib.error
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from router.trainer.rendezvous import alongside
from router.trainer.sender import BucketPlan, TrainerWeightSender, sent_checksum
from tests._weight_sync_fixtures import WORKER_ARGS
from tests._worker_helpers import Worker
from tests.procs import free_port
from worker.model import read_checkpoint

GROUP = "weight_update_group"
GROUP_TIMEOUT_S = 60.0
#: The lock's default wait is 30 s: a call still waiting at this bound did not cap its wait.
CALL_TIMEOUT_S = 20.0
#: The complete's wait for the receive: long enough to hold the lock through every probe below.
COMPLETE_TIMEOUT_S = 25
#: How long the test waits for the complete to be the one holding the lock.
HOLDER_WAIT_S = 15.0


@pytest.fixture(scope="module")
def worker(worker_factory: Callable[..., Worker], checkpoints: dict[str, Path]) -> Worker:
    return worker_factory(checkpoints["llama"], *WORKER_ARGS)


@pytest.fixture
def sender(worker: Worker) -> Iterator[TrainerWeightSender]:
    """A group of the trainer (this process) and the worker; left by both afterwards (destroying the
    group also drops a receive still pending, so a complete still waiting ends at once)."""
    s = TrainerWeightSender(master_port=free_port(), world_size=2, timeout_s=GROUP_TIMEOUT_S)
    status, body = alongside(
        lambda: worker.post("/init_weights_update_group", s.init_request(1), timeout=90),
        s.join,
        timeout_s=120,
        what="init",
    )
    assert status == 200 and body["success"], body
    try:
        yield s
    finally:
        worker.post("/destroy_weights_update_group", {"group_name": GROUP}, timeout=CALL_TIMEOUT_S)
        s.close()


def bounded_post(worker: Worker, path: str, body: object) -> tuple[int, dict]:
    """``body`` on ``path``, failing the test (rather than hanging it) if no answer comes within
    :data:`CALL_TIMEOUT_S`."""
    try:
        return worker.post(path, body, timeout=CALL_TIMEOUT_S)
    except (TimeoutError, urllib.error.URLError) as exc:
        pytest.fail(f"{path} still waited after {CALL_TIMEOUT_S:g}s: its timeout_s did not cap its lock wait ({exc})")


def busy_behind_complete(worker: Worker, path: str, body: object, wait_s: int) -> str:
    """The 503 of ``body`` on ``path`` while the complete holds the call lock. Until the complete has
    taken the lock, the call answers otherwise, harmlessly (400: an update is in progress; 503: the
    writer lock is held) and is tried again."""
    action = path.strip("/")
    holder = f"{action}: complete_weights_update is still running on this worker (waited {wait_s}s)"
    deadline = time.monotonic() + HOLDER_WAIT_S
    while True:
        status, answer = bounded_post(worker, path, body)
        message = answer["error"]["message"] if isinstance(answer, dict) and "error" in answer else str(answer)
        if status == 503 and message == holder:
            return message
        assert status in (400, 503), (status, answer)
        assert time.monotonic() < deadline, f"the complete never held the call lock; last answer: {status} {answer}"


def test_a_calls_timeout_caps_its_wait_for_the_call_lock(
    worker: Worker, sender: TrainerWeightSender, checkpoints: dict[str, Path]
) -> None:
    tensors = dict(read_checkpoint(str(checkpoints["llama_b"]), torch.float32))
    plan = BucketPlan.from_named_tensors(tensors, budget_bytes=64 * 1024)
    version = worker.info()["weight_version"]
    status, ready = worker.post(
        "/prepare_weights_update", plan.prepare_request(GROUP, weight_version="held", timeout_s=30)
    )
    assert status == 200 and ready["status"] == "ready", ready

    with ThreadPoolExecutor(max_workers=1) as pool:
        complete = {"group_name": GROUP, "return_checksum": True, "timeout_s": COMPLETE_TIMEOUT_S}
        completed = pool.submit(worker.post, "/complete_weights_update", complete, timeout=60)

        # A prepare with timeout_s 2 behind the complete: its 503 names the 2 s it waited.
        busy_behind_complete(
            worker, "/prepare_weights_update", plan.prepare_request(GROUP, weight_version="never", timeout_s=2), 2
        )
        # SGLang's single-phase call, with its own 1 s.
        single = {**plan.metadata()[0].model_dump(), "group_name": GROUP, "weight_version": "never", "timeout_s": 1}
        busy_behind_complete(worker, "/update_weights_from_distributed", single, 1)
        assert not completed.done()  # the complete still waits for the trainer: the refusals were in its shadow

        info = worker.info()
        assert info["weight_version"] == version and not info["weights_partial"]

        # Nothing the refused calls did reached the held update: it completes as prepared.
        sender.send(plan, tensors)
        status, result = completed.result(timeout=60)
    assert status == 200 and result["success"], result
    assert result["weight_version"] == "held" == worker.info()["weight_version"]
    assert result["checksum"] == sent_checksum(tensors.items())
