"""Weight-sync throughput: raw transport vs. the two-phase and single-phase paths.

    python -m benchmarks.bench_weight_sync [--total-mb 256] [--tensors 64] [--receivers 2] [--bucket-mb 64]
                                           [--repeats 5] [--backend auto|gloo|nccl] [--no-e2e]

Part 1 — transport (receiver classes in processes, no HTTP). This process is
the trainer (rank 0, ``TrainerWeightSender``); ``--receivers`` spawned
processes run ``worker.transfer.group.receiver.BucketReceiver`` exactly as a worker
does, applying each bucket into a preallocated "model" (one destination tensor
per name) on a separate apply thread, as the worker's scheduler thread would.
Control messages travel over multiprocessing queues instead of HTTP. Rows:

* raw — one broadcast of a flat buffer of the same bytes (the ceiling);
* two-phase flattened / per-tensor — receive loop started first ("prepare"),
  then the planned buckets, double-buffered, streaming apply;
* single-phase per-tensor (SGLang style) — per bucket: a metadata message, the
  receiver allocates each tensor, receives, applies, acknowledges; the trainer
  waits for the acknowledgement before the next bucket (slime's ``ray.get``);
* two-phase flattened with 10x the tensors at the same bytes.

Each row's time runs from the first broadcast to the moment every receiver has
applied everything (a closing all-reduce): the median over ``--repeats`` rounds,
each round running every path once (after two warm-up rounds).

Part 2 — end to end (real ``omni-worker`` process over HTTP, unless
``--no-e2e``): pause → prepare → broadcast → complete → continue on a
generated checkpoint, reporting the pause→resume window next to its pure
transfer time, and SGLang's single-phase sequence through HTTP.

Backend: NCCL when CUDA has a GPU per rank, else gloo on CPU. The defaults
finish in well under two minutes on two CPU cores.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import socket
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from router.contract.bucket_layout import BucketLayout
from router.dataplane.formats import get_format
from router.dataplane.group import init_weight_update_group
from router.trainer.sender import BucketPlan, TrainerWeightSender
from worker.transfer.group.receiver import BucketReceiver, ReceiveBuffers

GROUP = "bench_weight_sync"
TIMEOUT_S = 300.0
WARMUP_ROUNDS = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_threaded_copies() -> None:
    """On a small CPU box, OpenMP threads that spin-wait after each parallel copy
    starve gloo's transport threads (measured: 3x slower syncs on 2 cores)."""
    torch.set_num_threads(1)


def make_spec(total_bytes: int, count: int, dtype: str) -> list[tuple[str, str, list[int]]]:
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    numel = max(1, total_bytes // itemsize // count)
    return [(f"layers.{i}.weight", dtype, [numel]) for i in range(count)]


# -- receiver process ------------------------------------------------------------------------------


def receiver_main(rank: int, cfg: dict[str, Any], commands: mp.Queue[Any], results: mp.Queue[Any]) -> None:
    device = torch.device(f"cuda:{rank}" if cfg["backend"] == "nccl" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        single_threaded_copies()
    group = init_weight_update_group(
        master_address="127.0.0.1",
        master_port=cfg["port"],
        rank=rank,
        world_size=cfg["world_size"],
        group_name=GROUP,
        backend=cfg["backend"],
        timeout_s=TIMEOUT_S,
    )
    applier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="apply")  # stands in for the scheduler thread
    models: dict[str, dict[str, torch.Tensor]] = {}

    def model_for(plan: BucketPlan) -> dict[str, torch.Tensor]:
        key = f"{plan.num_tensors}"
        if key not in models:
            models[key] = {
                s.name: torch.empty(s.shape, dtype=getattr(torch, s.dtype), device=device)
                for b in plan.buckets
                for s in b.slots
            }
        return models[key]

    def apply_named(model: dict[str, torch.Tensor], named: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named:
            model[name].copy_(tensor)
        if device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    raw: torch.Tensor | None = None
    buffers = ReceiveBuffers()  # as the worker's controller keeps them across updates
    while True:
        cmd = commands.get()
        if cmd["mode"] == "stop":
            break
        plan: BucketPlan = cmd.get("plan")
        if cmd["mode"] == "raw":
            if raw is None or raw.numel() != cmd["nbytes"]:
                raw = torch.empty(cmd["nbytes"], dtype=torch.uint8, device=device)
            results.put("ready")
            group.broadcast(raw, TIMEOUT_S)
        elif cmd["mode"] in ("flattened_bucket", "per_tensor"):
            model = model_for(plan)
            receiver = BucketReceiver(
                group,
                plan.buckets,
                fmt=get_format(cmd["mode"]),
                device=device,
                buffers=buffers,
                apply=lambda i, named, m=model: applier.submit(apply_named, m, named),
            )
            receiver.start(TIMEOUT_S)
            results.put("ready")
            outcome = receiver.wait(TIMEOUT_S)
            assert outcome.ok, outcome.error
        elif cmd["mode"] == "single_phase":
            model = model_for(plan)
            results.put("ready")
            for _ in plan.buckets:
                meta: BucketLayout = commands.get()
                tensors = [
                    (s.name, torch.empty(s.shape, dtype=getattr(torch, s.dtype), device=device)) for s in meta.slots
                ]
                works = [group.broadcast_async(t) for _, t in tensors]  # SGLang: enqueue all, then wait all
                for work in works:
                    group.wait(work, TIMEOUT_S)
                applier.submit(apply_named, model, tensors).result()
                results.put("ack")
        dist.all_reduce(torch.zeros(1, device=device), group=group.pg)  # "every receiver is done"
    group.destroy()


# -- trainer side ----------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        backend = args.backend
        if backend == "auto":
            backend = "nccl" if n_gpus >= args.receivers + 1 else "gloo"
        self.backend = backend
        self.device = torch.device("cuda:0" if backend == "nccl" else "cpu")
        self.cfg = {"port": free_port(), "world_size": args.receivers + 1, "backend": backend}
        ctx = mp.get_context("spawn")
        self.commands = [ctx.Queue() for _ in range(args.receivers)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=receiver_main, args=(r + 1, self.cfg, self.commands[r], self.results), daemon=True)
            for r in range(args.receivers)
        ]
        for p in self.procs:
            p.start()
        self.sender = TrainerWeightSender(
            master_port=self.cfg["port"],
            world_size=self.cfg["world_size"],
            group_name=GROUP,
            backend=backend,
            timeout_s=TIMEOUT_S,
            device=self.device,
        )
        self.sender.join()

    def tell(self, message: dict[str, Any]) -> None:
        for q in self.commands:
            q.put(message)

    def await_all(self, what: str) -> None:
        for _ in self.procs:
            got = self.results.get(timeout=TIMEOUT_S)
            assert got == what, got

    def barrier(self) -> None:
        dist.all_reduce(torch.zeros(1, device=self.device), group=self.sender.group.pg)  # type: ignore[union-attr]
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def run(self, mode: str, plan: BucketPlan, tensors: dict[str, torch.Tensor]) -> float:
        group = self.sender.group
        assert group is not None
        if mode == "raw":
            flat = torch.empty(plan.total_bytes, dtype=torch.uint8, device=self.device)
            self.tell({"mode": "raw", "nbytes": plan.total_bytes})
            self.await_all("ready")
            start = time.perf_counter()
            group.broadcast(flat, TIMEOUT_S)
        elif mode == "single_phase":
            self.tell({"mode": mode, "plan": plan})
            self.await_all("ready")
            start = time.perf_counter()
            for layout in plan.buckets:
                self.tell(layout)  # the HTTP metadata call, fired first ...
                self.sender.send(BucketPlan((layout,), plan.budget_bytes), tensors)  # ... broadcast right after
                self.await_all("ack")  # ... and its answer collected before the next bucket
        else:
            self.tell({"mode": mode, "plan": plan})
            self.await_all("ready")  # prepare answered "ready"
            start = time.perf_counter()
            self.sender.send(plan, tensors, load_format="flattened_bucket" if mode == "flattened_bucket" else None)
        self.barrier()
        return time.perf_counter() - start

    def close(self) -> None:
        self.tell({"mode": "stop"})
        self.sender.close()
        for p in self.procs:
            p.join(timeout=30)


def tensors_for(plan: BucketPlan, device: torch.device) -> dict[str, torch.Tensor]:
    return {
        s.name: torch.randn(s.shape, device=device).to(getattr(torch, s.dtype)) for b in plan.buckets for s in b.slots
    }


def transport_section(args: argparse.Namespace) -> None:
    total = args.total_mb << 20
    budget = args.bucket_mb << 20
    plan = BucketPlan.from_spec(make_spec(total, args.tensors, args.dtype), budget)
    plan10 = BucketPlan.from_spec(make_spec(total, args.tensors * 10, args.dtype), budget)
    cases = [
        ("raw transport (1 flat broadcast)", "raw", plan),
        ("two-phase flattened", "flattened_bucket", plan),
        ("two-phase per-tensor", "per_tensor", plan),
        ("single-phase per-tensor (SGLang)", "single_phase", plan),
        (f"two-phase flattened, {10 * args.tensors} tensors", "flattened_bucket", plan10),
    ]
    bench = Bench(args)
    times: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    try:
        data = {id(plan): tensors_for(plan, bench.device), id(plan10): tensors_for(plan10, bench.device)}
        # Rounds interleave the paths so that load drift on a shared machine hits all
        # of them alike; the first rounds only warm up (page faults, connections).
        for round_index in range(WARMUP_ROUNDS + args.repeats):
            for name, mode, p in cases:
                seconds = bench.run(mode, p, data[id(p)])
                if round_index >= WARMUP_ROUNDS:
                    times[name].append(seconds)
    finally:
        bench.close()
    rows = [(name, statistics.median(times[name]), p) for name, _, p in cases]
    raw_s = rows[0][1]
    print(
        f"\n== transport: {plan.total_bytes / 2**20:.0f} MiB, {args.tensors} x {args.dtype} tensors, "
        f"{len(plan.buckets)} buckets of <= {args.bucket_mb} MiB, {args.receivers} receiver(s), {bench.backend} =="
    )
    print(f"{'path':44s} {'time s':>8s} {'GB/s':>8s} {'vs raw':>8s}")
    for name, seconds, p in rows:
        print(f"{name:44s} {seconds:8.3f} {p.total_bytes / seconds / 1e9:8.2f} {raw_s / seconds:8.1%}")
    flat, flat10 = rows[1][1], rows[4][1]
    print(f"10x tensors at the same bytes: {flat10 / flat - 1:+.1%} time (target <= +10%)")
    print(f"two-phase flattened vs raw: {raw_s / flat:.1%} (target >= 90%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-mb", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--receivers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--no-e2e", action="store_true", help="skip the end-to-end run through an omni-worker")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        single_threaded_copies()
    print(
        f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus, torch {torch.__version__}, "
        f"cuda {torch.cuda.is_available()}"
    )
    transport_section(args)
    if not args.no_e2e:
        from benchmarks.bench_weight_sync_e2e import e2e_section

        e2e_section()


if __name__ == "__main__":
    main()
