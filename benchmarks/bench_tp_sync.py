"""Weight sync into a tensor-parallel worker: TP=2 against TP=1, same model bytes, one run.

    .venv/bin/python -m benchmarks.bench_tp_sync

One real ``omni-worker`` at a time (``--tp-size 1``, then ``--tp-size 2``: rank 0
plus one follower process, gloo on CPU), the trainer in this process. Every TP
rank is a rank of the weight-update group and receives every bucket itself, so
at TP=2 the trainer's broadcast reaches two receivers; each rank then writes
its shard. Printed per TP size: the median pause → resume window of a two-phase
flattened sync and its pure broadcast time, and the ratio TP=2 ÷ TP=1 of both.
"""

from __future__ import annotations

import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_weight_sync_e2e import BUCKET_BYTES, REPEATS, SHAPE, _port, post, start_worker, two_phase_sync
from router.trainer.rendezvous import alongside
from router.trainer.sender import BucketPlan, TrainerWeightSender
from worker.model import read_checkpoint, write_tiny_checkpoint


def sync_times(served: Path, tensors: dict[str, torch.Tensor], plan: BucketPlan, tp: int) -> tuple[float, float]:
    """Median (window, broadcast) seconds of a two-phase flattened sync into a TP=``tp`` worker."""
    proc, url = start_worker(served, "--tp-size", str(tp), "--num-threads", "1")
    sender = TrainerWeightSender(master_port=_port(), world_size=1 + tp, timeout_s=120)
    try:
        answer = alongside(
            lambda: post(url + "/init_weights_update_group", sender.init_request(1)),
            sender.join,
            timeout_s=300,
            what="init",
        )
        assert answer.get("success"), answer
        request = plan.prepare_request(sender.group_name, load_format="flattened_bucket")

        def once() -> tuple[float, float]:
            start = time.perf_counter()
            transfer = two_phase_sync(url, sender, plan, tensors, request)
            return time.perf_counter() - start, transfer

        once()  # warm-up: buffers, first collectives
        runs = [once() for _ in range(REPEATS)]
        post(url + "/destroy_weights_update_group", {"group_name": sender.group_name})
    finally:
        sender.close()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-tp-sync-"))
    served = write_tiny_checkpoint(root / "served", "llama", 1, **SHAPE)
    pushed = write_tiny_checkpoint(root / "pushed", "llama", 2, **SHAPE)
    tensors = dict(read_checkpoint(pushed, torch.float32))
    plan = BucketPlan.from_named_tensors(tensors, BUCKET_BYTES)
    results = {tp: sync_times(served, tensors, plan, tp) for tp in (1, 2)}
    print(
        f"\n== two-phase flattened sync into one worker: {plan.total_bytes / 2**20:.0f} MiB, "
        f"{plan.num_tensors} tensors, {len(plan.buckets)} buckets; cpus {os.cpu_count()} =="
    )
    print(f"{'tp_size':>8s} {'pause->resume s':>16s} {'broadcast s':>12s}")
    for tp, (window, transfer) in results.items():
        print(f"{tp:8d} {window:16.3f} {transfer:12.3f}")
    (w1, b1), (w2, b2) = results[1], results[2]
    print(f"TP=2 / TP=1: window {w2 / w1:.2f}x, broadcast {b2 / b1:.2f}x")


if __name__ == "__main__":
    main()
