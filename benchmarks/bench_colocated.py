"""Colocated update: ``/update_weights_from_tensor`` against a plain memcpy of the same bytes, one run.

    .venv/bin/python -m benchmarks.bench_colocated [--layers 6 --hidden-size 1024 --rounds 5]

One real ``omni-worker`` on 127.0.0.1; the trainer is this process. It writes the new weights into
one CPU shared-memory segment (``build_cpu_handles``, not timed: a colocated trainer holds them
there), then each round POSTs the handle message and times request → answer: the worker checks the
message against the model, maps the segment and writes its tensors through the update pipeline
straight from the mapping (one atomic step, with a backup of the old weights for rollback unless
they are partial), and answers once they are in the model. The baseline is ``copy_`` of the same tensors into preallocated tensors in this process,
with as many threads as the worker. Printed: the median of each over the rounds (after one warm-up
round; update and memcpy interleaved) and the ratio update ÷ memcpy.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_weight_sync_e2e import post, start_worker
from router.trainer.sender import sent_checksum
from router.trainer.tensor_handles import build_cpu_handles
from worker.model import read_checkpoint, write_tiny_checkpoint


def shape(args: argparse.Namespace) -> dict[str, int]:
    heads = args.hidden_size // args.head_dim
    return {
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": args.head_dim,
    }


def memcpy_s(named: list[tuple[str, torch.Tensor]], into: list[torch.Tensor]) -> float:
    """Seconds to ``copy_`` every tensor into its preallocated destination."""
    start = time.perf_counter()
    for (_, src), dst in zip(named, into, strict=True):
        dst.copy_(src)
    return time.perf_counter() - start


def update_s(url: str, body: dict, version: str, *, release_first: bool = False) -> float:
    """Seconds from the request to the worker's answer (which comes once the weights are in the model).

    ``release_first`` (not timed): slime's colocated cycle around it, release of weights and KV cache
    without a host copy, resume of the weights before the update and of the KV cache after it; the
    update then writes weights that are partial, which need no backup."""
    if release_first:
        post(url + "/release_memory_occupation", {"tags": ["weights", "kv_cache"], "keep_weights": False})
        post(url + "/resume_memory_occupation", {"tags": ["weights"]})
    try:
        return _timed_update(url, body, version)
    finally:
        if release_first:
            post(url + "/resume_memory_occupation", {"tags": ["kv_cache"]})


def _timed_update(url: str, body: dict, version: str) -> float:
    start = time.perf_counter()
    answer = post(url + "/update_weights_from_tensor", {**body, "weight_version": version})
    elapsed = time.perf_counter() - start
    assert answer.get("success"), answer
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--intermediate-size", type=int, default=2816)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (after one warm-up round)")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads, in the worker and for the memcpy")
    p.add_argument(
        "--release-first",
        action="store_true",
        help="each update follows a release without a host copy (slime's colocated cycle; not timed)",
    )
    args = p.parse_args()
    torch.set_num_threads(args.num_threads)

    root = Path(tempfile.mkdtemp(prefix="bench-colocated-"))
    served = write_tiny_checkpoint(root / "served", "llama", 1, **shape(args))
    pushed = write_tiny_checkpoint(root / "pushed", "llama", 2, **shape(args))
    named = [(n, t.contiguous()) for n, t in read_checkpoint(pushed, torch.float32)]
    total = sum(t.numel() * t.element_size() for _, t in named)
    into = [torch.empty_like(t) for _, t in named]
    for dst in into:
        dst.zero_()  # touch every page, as the worker's parameters are

    proc, url = start_worker(served, "--num-threads", str(args.num_threads))
    body, segment = build_cpu_handles(named)
    try:
        update_s(url, body, "warm-up")
        memcpy_s(named, into)
        updates, copies = [], []
        for i in range(args.rounds):
            updates.append(update_s(url, body, f"round-{i}", release_first=args.release_first))
            copies.append(memcpy_s(named, into))
        checked = post(url + "/weights_checker", {"action": "checksum"})
        assert checked.get("per_gpu_checksum") == sent_checksum(named), "the worker does not hold the pushed weights"
    finally:
        segment.close()
        segment.unlink()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)

    update, memcpy = statistics.median(updates), statistics.median(copies)
    print(
        f"machine: {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, "
        f"cuda {torch.cuda.is_available()}, {args.num_threads} thread(s)"
    )
    print(
        f"\n== colocated update into one worker: {total / 2**20:.0f} MiB, {len(named)} float32 tensors, "
        f"median of {args.rounds} rounds{', each after a release without a copy' if args.release_first else ''} =="
    )
    print(f"{'path':44s} {'time s':>8s} {'GB/s':>8s}")
    print(f"{'update_weights_from_tensor (request->answer)':44s} {update:8.3f} {total / update / 1e9:8.2f}")
    print(f"{'memcpy (copy_ into preallocated, in-process)':44s} {memcpy:8.3f} {total / memcpy / 1e9:8.2f}")
    print(f"update / memcpy: {update / memcpy:.2f}x")


if __name__ == "__main__":
    main()
