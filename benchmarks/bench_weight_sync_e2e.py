"""End-to-end part of ``bench_weight_sync``: one real ``omni-worker`` process over HTTP.

Times, per sync (median of a few): pause → prepare → broadcast → complete →
continue (the downtime window, "pause→resume") next to its pure broadcast
time, for the two-phase flattened path and for SGLang's single-phase
per-tensor sequence (slime: pause, flush, per bucket HTTP call + broadcast,
continue). The model is a generated checkpoint of about 80 MB.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from router.contract.base import WireRequest
from router.trainer.rendezvous import alongside
from router.trainer.sender import BucketPlan, TrainerWeightSender
from worker.model import read_checkpoint, write_tiny_checkpoint

SHAPE = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 8, "head_dim": 128}
BUCKET_BYTES = 16 << 20
REPEATS = 3


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: Any = None, method: str = "POST") -> dict[str, Any]:
    data = body.to_json() if isinstance(body, WireRequest) else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return json.loads(err.read() or b"null")


def start_worker(model_dir: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _port()
    exe = Path(sys.executable).with_name("omni-worker")
    log_path = tempfile.mktemp(prefix="bench-worker-", suffix=".log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(exe), "--model-path", str(model_dir), "--port", str(port), *extra],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError(f"omni-worker did not start; see {log_path}")


def two_phase_sync(
    url: str, sender: TrainerWeightSender, plan: BucketPlan, tensors: dict[str, torch.Tensor], request: Any
) -> float:
    """One paused two-phase flattened sync (pause, prepare, broadcast, complete, continue); its broadcast seconds."""
    post(url + "/pause_generation", {"mode": "retract"})
    ready = post(url + "/prepare_weights_update", request)
    assert ready.get("status") == "ready", ready
    transfer = sender.send(plan, tensors, load_format="flattened_bucket").elapsed_s
    done = post(url + "/complete_weights_update", {"group_name": sender.group_name})
    assert done.get("success"), done
    post(url + "/continue_generation", {})
    return transfer


def timed(fn: Callable[[], float]) -> tuple[float, float]:
    """Median (window, broadcast) seconds over REPEATS runs after one warm-up."""
    fn()
    runs = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        transfer = fn()
        runs.append((time.perf_counter() - start, transfer))
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def e2e_section() -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-weight-sync-"))
    served = write_tiny_checkpoint(root / "served", "llama", 1, **SHAPE)
    pushed = write_tiny_checkpoint(root / "pushed", "llama", 2, **SHAPE)
    tensors = dict(read_checkpoint(pushed, torch.float32))
    plan = BucketPlan.from_named_tensors(tensors, BUCKET_BYTES)
    proc, url = start_worker(served)
    sender = TrainerWeightSender(master_port=_port(), world_size=2, timeout_s=120)
    try:
        init = sender.init_request(1)
        answer = alongside(
            lambda: post(url + "/init_weights_update_group", init), sender.join, timeout_s=300, what="init"
        )
        assert answer.get("success"), answer

        plain = plan.prepare_request(sender.group_name, load_format="flattened_bucket")
        # Each bucket with nbytes and its crc32 (what RouterClient users send via plan.metadata(tensors));
        # the worker verifies every bucket before applying it. Computed before the pause, as a trainer does.
        checked = plan.prepare_request(sender.group_name, tensors=tensors, load_format="flattened_bucket")

        def two_phase(request: Any = plain) -> float:
            return two_phase_sync(url, sender, plan, tensors, request)

        def single_phase() -> float:
            post(url + "/pause_generation", {})
            post(url + "/flush_cache", method="GET")
            transfer = 0.0
            for layout in plan.buckets:
                body = {
                    "names": layout.names,
                    "dtypes": layout.dtypes,
                    "shapes": layout.shapes,
                    "group_name": sender.group_name,
                    "flush_cache": False,
                }
                sent: list[float] = []
                answer = alongside(
                    lambda body=body: post(url + "/update_weights_from_distributed", body),
                    lambda layout=layout, sent=sent: sent.append(
                        sender.send(BucketPlan((layout,), BUCKET_BYTES), tensors).elapsed_s
                    ),
                    timeout_s=300,
                    what="update_weights_from_distributed",
                )
                assert answer.get("success"), answer
                transfer += sent[0]
            post(url + "/continue_generation", {})
            return transfer

        rows = [
            ("two-phase flattened", *timed(two_phase)),
            ("two-phase flattened, checksums", *timed(lambda: two_phase(checked))),
            ("single-phase per-tensor (SGLang)", *timed(single_phase)),
        ]
        started = time.perf_counter()
        for _ in range(5):
            plan.metadata(tensors)
        metadata_s = (time.perf_counter() - started) / 5
        post(url + "/destroy_weights_update_group", {"group_name": sender.group_name})
    finally:
        sender.close()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    print(
        f"\n== end to end through one omni-worker: {plan.total_bytes / 2**20:.0f} MiB, {plan.num_tensors} tensors, "
        f"{len(plan.buckets)} buckets =="
    )
    print(f"{'path':36s} {'pause->resume s':>16s} {'broadcast s':>12s} {'window/broadcast':>17s}")
    for name, window, transfer in rows:
        print(f"{name:36s} {window:16.3f} {transfer:12.3f} {window / transfer:16.2f}x")
    gbps = plan.total_bytes / metadata_s / 1e9
    print(f"trainer side, sizes + crc32 of every bucket (before the pause): {metadata_s:.3f} s ({gbps:.2f} GB/s)")
