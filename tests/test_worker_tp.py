"""A tensor-parallel worker (``omni-worker --tp-size 2``) against a TP=1 worker on the same checkpoint.

Real parts: two omni-worker processes, the TP=2 one with its follower rank in a
process of its own, joined by gloo; tiny safetensors checkpoints. Covered:
generation equals TP=1 (single prompts, a batch, streaming); every admin
operation answers one ``rank_results`` entry per rank; an update from disk
reaches every rank and generation still equals TP=1 after it, as do weight sync
(SGLang's and vLLM's) and the tensor path's handle message; a killed follower
makes the worker fail admin operations naming the rank, stop taking traffic and
exit, without hanging.
"""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from router.trainer import sent_checksum, vllm_sender
from router.trainer.rendezvous import alongside
from router.trainer.sender import TrainerWeightSender
from router.trainer.tensor_handles import build_cpu_handles
from tests._polling import wait_for
from tests._router_fixtures import ADMIN_KEY, auth, start_router
from tests._router_trainer import run_trainer
from tests._worker_helpers import Worker
from tests.procs import free_port, http_json
from worker.model.checkpoint import read_checkpoint

REPO_ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["hello world", "the quick brown fox", "1 2 3 4"]
THREADS = ["--num-threads", "1"]


@pytest.fixture(scope="module")
def pair(checkpoints, worker_factory) -> tuple[Worker, Worker]:
    tp1 = worker_factory(checkpoints["llama"], *THREADS)
    tp2 = worker_factory(checkpoints["llama"], "--tp-size", "2", *THREADS)
    return tp1, tp2


def greedy(worker: Worker, prompt: str | list[str], n: int = 12) -> Any:
    """Greedy output ids of one prompt, or of a batch (``text`` as a list)."""
    body = {"text": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}
    out = worker.ok("POST", "/generate", body, timeout=120)
    return [o["output_ids"] for o in out] if isinstance(out, list) else out["output_ids"]


def follower_pids(worker: Worker) -> list[int]:
    """The worker's child processes (its follower ranks), from /proc."""
    parent = worker.proc.proc.pid
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            # Followers are spawned interpreters (multiprocessing's resource tracker is the other child).
            if int(fields[1]) == parent and "spawn_main" in _cmdline(entry):
                children.append(int(entry.name))
    return children


def _cmdline(entry: Path) -> str:
    try:
        return (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_qwen2_generation_equals_tp1(checkpoints, worker_factory) -> None:
    """Qwen2: qkv bias sharded per section, tied embeddings replicated."""
    tp1 = worker_factory(checkpoints["qwen2"], *THREADS)
    tp2 = worker_factory(checkpoints["qwen2"], "--tp-size", "2", *THREADS)
    assert greedy(tp2, PROMPTS) == greedy(tp1, PROMPTS)


def test_generation_equals_tp1(pair) -> None:
    tp1, tp2 = pair
    for prompt in PROMPTS:
        assert greedy(tp2, prompt) == greedy(tp1, prompt), prompt
    assert greedy(tp2, PROMPTS) == greedy(tp1, PROMPTS)
    info = tp2.ok("GET", "/model_info")
    assert info["tp_size"] == 2 and [r["tp_rank"] for r in info["rank_results"]] == [0, 1]


ADMIN_CALLS: list[tuple[str, dict[str, Any]]] = [
    ("/pause_generation", {"mode": "retract"}),
    ("/continue_generation", {}),
    ("/flush_cache", {}),
    ("/abort_request", {"abort_all": True}),
    ("/update_weight_version", {"new_version": "tp-v1"}),
    ("/weights_checker", {"action": "checksum"}),
    ("/release_memory_occupation", {}),
    ("/resume_memory_occupation", {}),
]


@pytest.mark.parametrize(("path", "body"), ADMIN_CALLS, ids=[p for p, _ in ADMIN_CALLS])
def test_every_admin_operation_answers_for_every_rank(pair, path: str, body: dict[str, Any]) -> None:
    _, tp2 = pair
    answer = tp2.ok("POST", path, body)
    ranks = answer["rank_results"]
    assert [(r["tp_rank"], r["tp_size"]) for r in ranks] == [(0, 2), (1, 2)], answer
    assert all(r["success"] for r in ranks), ranks


WEIGHT_SYNC_CALLS: list[tuple[str, dict[str, Any], int]] = [
    ("/begin_weight_update", {}, 200),
    ("/end_weight_update", {}, 200),
    ("/destroy_weights_update_group", {"group_name": "never-made"}, 400),
    ("/abort_weights_update", {"group_name": "never-made"}, 400),
    (
        "/prepare_weights_update",
        {
            "group_name": "never-made",
            "num_buckets": 1,
            "buckets": [{"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]}],
        },
        400,
    ),
    ("/complete_weights_update", {"group_name": "never-made"}, 400),
]


@pytest.mark.parametrize(("path", "body", "status"), WEIGHT_SYNC_CALLS, ids=[p for p, _, _ in WEIGHT_SYNC_CALLS])
def test_weight_sync_routes_answer_for_every_rank(pair, path: str, body: dict[str, Any], status: int) -> None:
    _, tp2 = pair
    code, answer = tp2.post(path, body)
    assert code == status, answer
    ranks = answer["rank_results"]
    assert [(r["tp_rank"], r["tp_size"]) for r in ranks] == [(0, 2), (1, 2)], answer
    assert {r["success"] for r in ranks} == {status == 200}


def test_the_version_reaches_every_rank(pair) -> None:
    _, tp2 = pair
    tp2.ok("POST", "/update_weight_version", {"new_version": "tp-v2"})
    ranks = tp2.ok("GET", "/model_info")["rank_results"]
    assert [r["weight_version"] for r in ranks] == ["tp-v2", "tp-v2"]


def test_an_update_from_disk_reaches_every_rank(pair, checkpoints) -> None:
    tp1, tp2 = pair
    before = greedy(tp2, PROMPTS[0])
    for worker in (tp1, tp2):
        answer = worker.ok("POST", "/update_weights_from_disk", {"model_path": str(checkpoints["llama_b"])})
        assert len(answer["rank_results"]) == (2 if worker is tp2 else 1) and answer["success"], answer
    after = greedy(tp2, PROMPTS[0])
    assert after == greedy(tp1, PROMPTS[0]) and after != before
    for worker in (tp1, tp2):
        worker.ok("POST", "/update_weights_from_disk", {"model_path": str(checkpoints["llama"])})
    assert greedy(tp2, PROMPTS[0]) == before


def test_a_bad_checkpoint_changes_no_rank(pair, tmp_path) -> None:
    _, tp2 = pair
    before = tp2.ok("POST", "/weights_checker", {"action": "checksum"})["per_engine_checksum"]
    status, answer = tp2.post("/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
    assert status == 400 and not answer["success"], answer
    assert tp2.ok("POST", "/weights_checker", {"action": "checksum"})["per_engine_checksum"] == before


def test_a_killed_follower_fails_the_worker_without_a_hang(checkpoints, worker_factory) -> None:
    worker = worker_factory(checkpoints["llama"], "--tp-size", "2", *THREADS)
    assert greedy(worker, "warm up", 4)
    (follower,) = follower_pids(worker)
    os.kill(follower, signal.SIGKILL)
    # Every wait is bounded: the admin call fails naming the rank (or the worker is already stopping),
    # and the process exits instead of serving with a rank missing.
    try:
        status, answer = worker.post("/flush_cache", {}, timeout=60)
    except OSError:
        status, answer = None, None
    if status is not None:
        assert status != 200 or not answer.get("success"), answer
    wait_for(lambda: not worker.proc.alive, 60, worker.proc, "the worker to exit")
    assert "tensor-parallel rank 1 is lost" in worker.proc.log_text()


def test_checksums_of_the_full_tensors_match_tp1_and_the_trainer(pair, checkpoints) -> None:
    tp1, tp2 = pair
    for worker in (tp1, tp2):
        worker.ok("POST", "/update_weights_from_disk", {"model_path": str(checkpoints["llama"])})
    expected = sent_checksum(read_checkpoint(checkpoints["llama"], torch.float32))
    one = tp1.ok("POST", "/weights_checker", {"action": "checksum"})
    two = tp2.ok("POST", "/weights_checker", {"action": "checksum"})
    assert one["per_gpu_checksum"] == expected
    # Each TP rank digests its shards (SGLang's per-GPU scheme) and the full tensors rebuilt from all shards.
    assert [r["full_checksum"] for r in two["ranks"]] == [expected, expected]
    assert len({r["per_gpu_checksum"] for r in two["ranks"]}) == 2


def test_through_the_router_a_tp2_worker_takes_two_ranks_and_compares_with_tp1(pair, tmp_path) -> None:
    tp1, tp2 = pair
    proc, url = start_router([tp1.url, tp2.url], state_dir=tmp_path / "state")
    try:
        status, world = http_json("GET", url + "/get_world_size", timeout=30)
        assert status == 200 and world["world_size"] == 3, world
        assert [(w["rank_offset"], w["tp_size"]) for w in world["workers"]] == [(1, 1), (2, 2)]
        status, checked = http_json("POST", url + "/weights_checker", {"action": "checksum"}, timeout=60)
        assert status == 200 and checked["identical"], checked
        assert [len(v) for v in checked["rank_checksums"].values()] == [1, 2]
    finally:
        proc.stop()


def test_weight_sync_through_the_router_with_two_tp2_workers_and_a_tp1_one(checkpoints, worker_factory, tmp_path):
    """world_size 1 + 2 + 2 + 1 = 6; every protocol and format; each rank holds the trainer's tensors."""
    model = checkpoints["llama"]
    tp2s = [worker_factory(model, "--tp-size", "2", "--admin-api-key", ADMIN_KEY, *THREADS) for _ in range(2)]
    tp1 = worker_factory(model, "--admin-api-key", ADMIN_KEY, *THREADS)
    tp1.headers = tp2s[0].headers = tp2s[1].headers = auth()
    proc, url = start_router([w.url for w in (*tp2s, tp1)], admin_key=ADMIN_KEY, state_dir=tmp_path / "state")
    try:
        steps = [
            ["two_phase", "flattened_bucket", {"atomic": True}],
            ["two_phase", None],
            ["two_phase", "flattened_bucket"],
            ["single_phase", None],
        ]
        done, report = run_trainer(url, str(model), tmp_path, steps)
        assert done.returncode == 0, done.stderr[-3000:]
        logs = "".join(w.proc.log_text(2000) for w in (*tp2s, tp1))
        assert "error" not in report, json.dumps(report.get("error"), indent=1)[:3000] + logs
        assert report["world_size"] == 6 and report["num_buckets"] > 1
        ranks = report["steps"][0]["group_init"]["ranks"]
        assert sorted((r["rank_offset"], r["tp_size"]) for r in ranks) == [(1, 2), (3, 2), (5, 1)]
        for step in report["steps"]:
            assert step["fleet_identical"] is True and step["matches_expected"] is True, step
            assert [len(v) for v in step["rank_checksums"].values()] == [2, 2, 1]
        # The same weights generate the same text at TP=2 and TP=1.
        outputs = [greedy(w, PROMPTS) for w in (*tp2s, tp1)]
        assert outputs[0] == outputs[1] == outputs[2]
    finally:
        proc.stop()


def test_vllm_packed_update_reaches_every_rank(pair, checkpoints) -> None:
    """vLLM's init/start/update/finish into a TP=2 worker: both ranks join (world_size 3) and each
    writes its shards of every packed buffer."""
    _, tp2 = pair
    sender = TrainerWeightSender(master_port=free_port(), world_size=3, group_name="weight_transfer", timeout_s=60)
    init = {
        "init_info": {
            "master_address": "127.0.0.1",
            "master_port": sender.master_port,
            "rank_offset": 1,
            "world_size": 3,
        }
    }
    status, body = alongside(
        lambda: tp2.post("/init_weight_transfer_engine", init, timeout=90), sender.join, timeout_s=120, what="init"
    )
    assert status == 200, body
    try:
        named = sorted(read_checkpoint(checkpoints["llama_b"], torch.float32))
        tp2.ok("POST", "/start_weight_update")
        info = vllm_sender.update_info(named, packed=True, packed_buffer_size_bytes=32 * 1024)
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(tp2.post, "/update_weights", {"update_info": info}, timeout=90)
            assert sender.group is not None
            vllm_sender.send(sender.group, named, packed=True, packed_buffer_size_bytes=32 * 1024, timeout_s=30)
            status, body = call.result(timeout=120)
        assert status == 200, body
        tp2.ok("POST", "/finish_weight_update", {"weight_version": "tp-vllm"})
        expected = sent_checksum(read_checkpoint(checkpoints["llama_b"], torch.float32))
        ranks = tp2.ok("POST", "/weights_checker", {"action": "checksum"})["ranks"]
        assert [r["full_checksum"] for r in ranks] == [expected, expected]
    finally:
        sender.close()
        tp2.ok("POST", "/update_weights_from_disk", {"model_path": str(checkpoints["llama"])})


def _assert_every_rank_holds_then_reload(tp2: Worker, named: list[tuple[str, torch.Tensor]], boot: Path) -> None:
    """Both ranks hold the full tensors of ``named``; afterwards the worker reloads ``boot``."""
    try:
        ranks = tp2.ok("POST", "/weights_checker", {"action": "checksum"})["ranks"]
        assert [r["full_checksum"] for r in ranks] == [sent_checksum(named)] * 2
    finally:
        tp2.ok("POST", "/update_weights_from_disk", {"model_path": str(boot)})


def test_an_update_from_tensor_handles_reaches_every_rank(pair, checkpoints) -> None:
    _, tp2 = pair
    named = sorted(read_checkpoint(checkpoints["llama_b"], torch.float32))
    body, segment = build_cpu_handles(named, weight_version="tp-shm")
    try:
        answer = tp2.ok("POST", "/update_weights_from_tensor", body)
        assert [r["success"] for r in answer["rank_results"]] == [True, True], answer
    finally:
        segment.close()
        segment.unlink()
    _assert_every_rank_holds_then_reload(tp2, named, checkpoints["llama"])


def test_vllm_shared_memory_update_reaches_every_rank(pair, checkpoints) -> None:
    _, tp2 = pair
    named = sorted(read_checkpoint(checkpoints["llama_b"], torch.float32))
    body, segment = build_cpu_handles(named)
    try:
        tp2.ok("POST", "/start_weight_update")
        info = {**vllm_sender.update_info(named), "tensor_handles": body["tensor_handles"]}
        tp2.ok("POST", "/update_weights", {"update_info": info})
        tp2.ok("POST", "/finish_weight_update", {"weight_version": "tp-vllm-shm"})
    finally:
        segment.close()
        segment.unlink()
    _assert_every_rank_holds_then_reload(tp2, named, checkpoints["llama"])
