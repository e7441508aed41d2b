"""vLLM's weight-transfer API on one real omni-worker.

The test process is the trainer: rank 0 of a real gloo group built through
``/init_weight_transfer_engine``, broadcasting with :mod:`router.trainer.vllm_sender`
while its ``/update_weights`` call is open, as vLLM's HTTP trainers do. Checkpoint
``a`` is served at start; syncs push checkpoint ``b`` (or ``c``), compared with a
worker freshly loaded from it.
"""

from __future__ import annotations

import base64
import os
import pickle
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from router.contract.vllm import packed_chunks
from router.trainer import vllm_sender
from router.trainer.rendezvous import alongside
from router.trainer.sender import TrainerWeightSender
from router.trainer.tensor_handles import build_cpu_handles
from tests._polling import wait_for
from tests._weight_sync_fixtures import WORKER_ARGS
from tests._worker_helpers import Worker
from tests.procs import free_port, start_worker
from worker.model import read_checkpoint

GROUP_TIMEOUT_S = 60.0
SEND_TIMEOUT_S = 30.0
PROMPT = [1, 2, 3, 4, 5]


def _start(path: str, *args: str) -> Worker:
    proc, url = start_worker(path, extra_args=[*WORKER_ARGS, *args])
    return Worker(proc, url, Path(path))


@pytest.fixture(scope="module")
def worker(sync_ckpts: dict[str, str]) -> Iterator[Worker]:
    w = _start(sync_ckpts["a"], "--step-delay-ms", "20")
    try:
        yield w
    finally:
        w.proc.stop()


@pytest.fixture(scope="module")
def reference(sync_ckpts: dict[str, str]) -> Iterator[dict[str, Any]]:
    """Checksum and greedy output of fresh workers loaded from ``b`` and ``c``."""
    out: dict[str, Any] = {}
    for name in ("b", "c"):
        w = _start(sync_ckpts[name])
        try:
            out[name] = (w.checksum(), w.generate(PROMPT, 8)["output_ids"])
        finally:
            w.proc.stop()
    return out


@pytest.fixture(scope="module")
def sender(worker: Worker) -> Iterator[TrainerWeightSender]:
    s = TrainerWeightSender(
        master_port=free_port(), world_size=2, group_name="weight_transfer", timeout_s=GROUP_TIMEOUT_S
    )
    init = {
        "init_info": {"master_address": "127.0.0.1", "master_port": s.master_port, "rank_offset": 1, "world_size": 2}
    }
    status, body = alongside(
        lambda: worker.post("/init_weight_transfer_engine", init, timeout=90), s.join, timeout_s=120, what="init"
    )
    assert status == 200 and body["message"] == "Weight transfer initialized", body
    yield s
    s.close()


def tensors(path: str) -> list[tuple[str, torch.Tensor]]:
    return sorted(read_checkpoint(path, torch.float32))


def update(
    worker: Worker, sender: TrainerWeightSender, named: list[tuple[str, torch.Tensor]], **kw: Any
) -> tuple[int, Any]:
    """One ``/update_weights`` call with its broadcast running alongside; the worker's answer."""
    status, body, error = update_sending(worker, sender, named, **kw)
    assert error is None, f"the send failed: {error}; worker answered {status} {body}"
    return status, body


def update_sending(
    worker: Worker,
    sender: TrainerWeightSender,
    named: list[tuple[str, torch.Tensor]],
    *,
    send_buffer: int | None = None,
    send_timeout_s: float = SEND_TIMEOUT_S,
    **info: Any,
) -> tuple[int, Any, BaseException | None]:
    """``/update_weights`` on a thread while this process broadcasts (in buffers of ``send_buffer``
    bytes when given, else as announced): the worker's answer and the send's error, if any."""
    announce = vllm_sender.update_info(named, **info)
    group = sender.group
    assert group is not None
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(worker.post, "/update_weights", {"update_info": announce}, timeout=90)
        error: BaseException | None = None
        try:
            vllm_sender.send(
                group,
                named,
                packed=announce["packed"],
                packed_buffer_size_bytes=send_buffer or announce["packed_buffer_size_bytes"],
                timeout_s=send_timeout_s,
            )
        except Exception as exc:
            error = exc
        status, body = call.result(timeout=120)
    return status, body, error


def _ok(answer: tuple[int, Any]) -> Any:
    status, body = answer
    assert status == 200, body
    return body


def sync(worker: Worker, sender: TrainerWeightSender, path: str, version: str) -> list[Any]:
    """start → two update calls (unpacked first half, packed rest in small buffers) → finish."""
    named = tensors(path)
    half = len(named) // 2
    answers = [worker.ok("POST", "/start_weight_update")]
    answers.append(_ok(update(worker, sender, named[:half])))
    answers.append(_ok(update(worker, sender, named[half:], packed=True, packed_buffer_size_bytes=64 * 1024)))
    answers.append(worker.ok("POST", "/finish_weight_update", {"weight_version": version}))
    return answers


class TestSync:
    def test_unpacked_and_packed_calls_install_the_checkpoint(
        self, worker: Worker, sender: TrainerWeightSender, sync_ckpts: dict[str, str], reference: dict[str, Any]
    ) -> None:
        answers = sync(worker, sender, sync_ckpts["b"], "v-b")
        assert [a["message"] for a in answers] == [
            "Weight update started",
            "Weights updated",
            "Weights updated",
            "Weight update finished",
        ]
        assert answers[-1]["weight_version"] == "v-b"
        assert worker.info()["weight_version"] == "v-b"
        assert worker.checksum() == reference["b"][0]
        assert worker.generate(PROMPT, 8)["output_ids"] == reference["b"][1]

    def test_a_second_sync_on_the_same_group(
        self, worker: Worker, sender: TrainerWeightSender, sync_ckpts: dict[str, str], reference: dict[str, Any]
    ) -> None:
        sync(worker, sender, sync_ckpts["c"], "v-c")
        assert worker.checksum() == reference["c"][0]
        assert worker.get("/is_paused")[1] == {"is_paused": False}


class TestOrderAndInput:
    def test_calls_out_of_order_are_409_and_change_nothing(self, worker: Worker) -> None:
        before = worker.checksum(), worker.info()["weight_version"]
        meta = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[64]]}
        status, body = worker.post("/update_weights", {"update_info": meta})
        assert status == 409 and "/start_weight_update" in body["error"]["message"]
        status, body = worker.post("/finish_weight_update", {"weight_version": "x"})
        assert status == 409
        worker.ok("POST", "/start_weight_update")
        assert worker.get("/health")[1]["weight_update"] == "open"
        status, body = worker.post("/start_weight_update")
        assert status == 409 and "already started" in body["error"]["message"]
        worker.ok("POST", "/finish_weight_update")  # an empty update commits nothing but the (unchanged) version
        assert worker.get("/health")[1]["weight_update"] is None
        assert (worker.checksum(), worker.info()["weight_version"]) == before

    def test_an_update_nobody_finishes_ends_by_itself(self, worker: Worker) -> None:
        worker.ok("POST", "/start_weight_update", {"timeout_s": 1.0})
        assert worker.post("/start_weight_update")[0] == 409
        # 409 while the abandoned one is open; the first 200 starts the next update.
        wait_for(lambda: worker.post("/start_weight_update")[0] == 200, 30, worker.proc, "the abandoned update to end")
        worker.ok("POST", "/finish_weight_update")
        assert worker.get("/is_paused")[1]["is_paused"] is False

    def test_missing_fields_and_bad_metadata_are_400(self, worker: Worker) -> None:
        status, body = worker.post("/init_weight_transfer_engine", {})
        assert status == 400 and "Missing 'init_info'" in body["error"]["message"]
        status, body = worker.post("/update_weights", {})
        assert status == 400 and "Missing 'update_info'" in body["error"]["message"]
        worker.ok("POST", "/start_weight_update")
        try:
            short = {"names": ["a", "b"], "dtype_names": ["float32"], "shapes": [[1], [1]]}
            status, body = worker.post("/update_weights", {"update_info": short})
            assert status == 400 and "dtype_names" in body["error"]["message"]
            wrong = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[3, 5]]}
            status, body = worker.post("/update_weights", {"update_info": wrong})
            assert status == 400 and body["weights"] == "intact", body
            bad_size = {**wrong, "shapes": [[64]], "packed": True, "packed_buffer_size_bytes": 0}
            status, body = worker.post("/update_weights", {"update_info": bad_size})
            assert status == 400
        finally:
            worker.ok("POST", "/finish_weight_update")  # the refused calls left the update open and unchanged


def test_packed_chunks_match_vllms_producer_loop() -> None:
    """Buffer boundaries equal those of a loop written as vLLM's packed producer does it."""
    sizes = [10, 30, 5, 64, 1, 1, 100, 7, 0, 50]
    for limit in (1, 16, 40, 64, 65, 1000):
        produced, current, total = [], [], 0
        for i, size in enumerate(sizes):
            current.append(i)
            total += size
            if total > limit:
                produced.append(current)
                current, total = [], 0
        if current:
            produced.append(current)
        assert [list(r) for r in packed_chunks(sizes, limit)] == produced


class TestPause:
    def _in_flight(self, worker: Worker, pool: ThreadPoolExecutor, tokens: int = 60) -> Any:
        fut = pool.submit(worker.generate, PROMPT, tokens)
        worker.wait_state(lambda s: s.get("num_running_reqs", 0) >= 1 or s.get("running", 0) >= 1, what="running")
        return fut

    def test_wait_drains_running_requests_before_answering(self, worker: Worker, pool: ThreadPoolExecutor) -> None:
        fut = self._in_flight(worker, pool, tokens=40)
        assert worker.ok("POST", "/pause?mode=wait")["status"] == "paused"
        # What the pause waited for is the worker's own: nothing runs once it answered (the caller's thread may
        # still be reading the request's answer, so the future itself is not what is checked).
        state = worker.state()
        assert state.get("num_running_reqs", 0) == 0, f"pause(wait) answered with requests running: {state}"
        assert fut.result(timeout=30)["meta_info"]["finish_reason"]["type"] == "length"
        assert worker.get("/is_paused")[1]["is_paused"] is True
        assert worker.ok("POST", "/resume")["status"] == "resumed"
        assert worker.get("/is_paused")[1]["is_paused"] is False

    def test_keep_freezes_requests_through_an_update(
        self, worker: Worker, sender: TrainerWeightSender, sync_ckpts: dict[str, str], pool: ThreadPoolExecutor
    ) -> None:
        fut = self._in_flight(worker, pool)
        worker.ok("POST", "/pause?mode=keep")
        assert not fut.done()
        sync(worker, sender, sync_ckpts["b"], "v-keep")
        assert not fut.done()  # still frozen: the update does not resume what the caller paused
        worker.ok("POST", "/resume")
        assert fut.result(timeout=60)["meta_info"]["finish_reason"]["type"] == "length"

    def test_abort_ends_requests_and_bad_mode_is_400(self, worker: Worker, pool: ThreadPoolExecutor) -> None:
        fut = self._in_flight(worker, pool)
        worker.ok("POST", "/pause")  # vLLM's default mode: abort
        assert fut.result(timeout=30)["meta_info"]["finish_reason"]["type"] == "abort"
        worker.ok("POST", "/resume")
        status, _ = worker.post("/pause?mode=sideways")
        assert status == 400 and worker.get("/is_paused")[1]["is_paused"] is False
        assert worker.get("/get_world_size")[1] == {"world_size": 1}


class TestSharedMemory:
    def test_tensor_handles_install_the_checkpoint(
        self, worker: Worker, sync_ckpts: dict[str, str], reference: dict[str, Any]
    ) -> None:
        named = tensors(sync_ckpts["c"])
        body, segment = build_cpu_handles(named)
        try:
            worker.ok("POST", "/start_weight_update")
            meta = vllm_sender.update_info(named)
            answer = worker.ok(
                "POST", "/update_weights", {"update_info": {**meta, "tensor_handles": body["tensor_handles"]}}
            )
            assert answer["source"] == "shared memory"
        finally:
            segment.close()
            segment.unlink()
        worker.ok("POST", "/finish_weight_update", {"weight_version": "v-shm"})
        assert worker.checksum() == reference["c"][0]

    def test_pickled_ipc_handles_need_the_flag_and_admit_no_other_callable(
        self, worker: Worker, sync_ckpts: dict[str, str], tmp_path: Path
    ) -> None:
        marker = tmp_path / "pwned"

        class Evil:
            def __reduce__(self) -> Any:
                return (os.system, (f"touch {marker}",))

        meta = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[64]]}
        evil = base64.b64encode(pickle.dumps([{"GPU-0": Evil()}])).decode()
        worker.ok("POST", "/start_weight_update")
        try:
            status, body = worker.post("/update_weights", {"update_info": {**meta, "ipc_handles_pickled": evil}})
            assert status == 400 and "--allow-pickled-tensors" in body["error"]["message"]
        finally:
            worker.ok("POST", "/finish_weight_update")
        flagged = _start(sync_ckpts["a"], "--allow-pickled-tensors")
        try:
            flagged.ok("POST", "/start_weight_update")
            status, body = flagged.post("/update_weights", {"update_info": {**meta, "ipc_handles_pickled": evil}})
            assert status == 400 and "not on the allowlist" in body["error"]["message"], body
            flagged.ok("POST", "/finish_weight_update")
        finally:
            flagged.proc.stop()
        assert not marker.exists()


class TestBufferSizeMismatch:
    """Last in the module: it leaves the module's group out of step (as a real mismatch does)."""

    def test_a_packed_buffer_size_mismatch_fails_the_update_without_a_hang(
        self, worker: Worker, sender: TrainerWeightSender, sync_ckpts: dict[str, str]
    ) -> None:
        before = worker.checksum()
        named = tensors(sync_ckpts["b"])
        worker.ok("POST", "/start_weight_update")
        status, body, send_error = update_sending(
            worker,
            sender,
            named,
            packed=True,
            packed_buffer_size_bytes=256 * 1024,
            send_buffer=32 * 1024,
            # The worker refuses the first buffer within milliseconds; the send nobody takes fails at this bound.
            send_timeout_s=3.0,
        )
        assert status == 400, body
        assert "receive failed" in body["error"]["message"] and "bytes" in body["error"]["message"], body
        assert body["weights"] == "intact"  # the first buffer already mismatched: nothing was written
        assert send_error is not None  # the trainer sent more buffers than the worker took: its send failed
        # The update ended and the weights are the old ones, served again.
        assert worker.post("/finish_weight_update")[0] == 409
        assert worker.checksum() == before
        assert worker.get("/health")[1]["weight_state"] == "serving"
        # The group is out of step: the next update is refused until the engine is initialized again.
        worker.ok("POST", "/start_weight_update")
        try:
            meta = vllm_sender.update_info(named[:1])
            status, body = worker.post("/update_weights", {"update_info": meta}, timeout=30)
            assert status == 400 and "/init_weight_transfer_engine" in body["error"]["message"], body
        finally:
            worker.ok("POST", "/finish_weight_update")


class TestWireParamsAtInit:
    """vLLM 0.28+ trainers send ``packed`` and the buffer geometry once, in ``init_info``, and
    per-round ``update_info`` without them. Last in the module: it initializes the engine again
    (its own rendezvous and group, as a restarted trainer would)."""

    BUFFER = 64 * 1024

    @pytest.fixture(scope="class")
    def packed_sender(self, worker: Worker) -> Iterator[TrainerWeightSender]:
        s = TrainerWeightSender(
            master_port=free_port(), world_size=2, group_name="packed_at_init", timeout_s=GROUP_TIMEOUT_S
        )
        info = {
            "group_name": "packed_at_init",
            "master_address": "127.0.0.1",
            "master_port": str(s.master_port),  # as a string: the model coerces it, as vLLM's does
            "rank_offset": 1,
            "world_size": 2,
            "packed": True,
            "packed_buffer_size_bytes": self.BUFFER,
            "packed_num_buffers": 2,
        }
        status, body = alongside(
            lambda: worker.post("/init_weight_transfer_engine", {"init_info": info}, timeout=90),
            s.join,
            timeout_s=120,
            what="init",
        )
        assert status == 200, body
        yield s
        s.close()

    def _push(self, worker: Worker, sender: TrainerWeightSender, path: str, version: str) -> Any:
        """One sync whose ``update_info`` carries no wire params; the trainer sends the init's."""
        named = tensors(path)
        announce = {k: v for k, v in vllm_sender.update_info(named).items() if not k.startswith("packed")}
        group = sender.group
        assert group is not None
        worker.ok("POST", "/start_weight_update")
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(worker.post, "/update_weights", {"update_info": announce}, timeout=90)
            sent = vllm_sender.send(
                group, named, packed=True, packed_buffer_size_bytes=self.BUFFER, timeout_s=SEND_TIMEOUT_S
            )
            status, body = call.result(timeout=120)
        assert status == 200, body
        assert sent == len(packed_chunks([t.numel() * t.element_size() for _, t in named], self.BUFFER)) > 1
        assert body["source"] == f"{sent} buffer(s)", body
        return worker.ok("POST", "/finish_weight_update", {"weight_version": version})

    def test_updates_use_the_init_time_params(
        self,
        worker: Worker,
        packed_sender: TrainerWeightSender,
        sync_ckpts: dict[str, str],
        reference: dict[str, Any],
    ) -> None:
        self._push(worker, packed_sender, sync_ckpts["c"], "v-init-params")
        assert worker.checksum() == reference["c"][0]

    def test_an_update_that_contradicts_the_init_is_400_before_any_receive(
        self,
        worker: Worker,
        packed_sender: TrainerWeightSender,
        sync_ckpts: dict[str, str],
        reference: dict[str, Any],
    ) -> None:
        before = worker.checksum(), worker.info()["weight_version"]
        named = tensors(sync_ckpts["b"])[:2]
        worker.ok("POST", "/start_weight_update")
        try:
            for override in ({"packed": False}, {"packed": True, "packed_buffer_size_bytes": self.BUFFER // 2}):
                announce = {**vllm_sender.update_info(named)}
                for key in ("packed", "packed_buffer_size_bytes", "packed_num_buffers"):
                    announce.pop(key)
                status, body = worker.post("/update_weights", {"update_info": {**announce, **override}}, timeout=30)
                assert status == 400 and "disagrees" in body["error"]["message"], body
                assert body["weights"] == "intact"
        finally:
            worker.ok("POST", "/finish_weight_update")  # the refusals left the update open and unchanged
        assert (worker.checksum(), worker.info()["weight_version"]) == before
        # Nothing was received and the group is still in step: the next sync goes through.
        self._push(worker, packed_sender, sync_ckpts["b"], "v-after-refusal")
        assert worker.checksum() == reference["b"][0]
