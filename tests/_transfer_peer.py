"""A trainer or receiver process for the transfer tests (no HTTP).

    python -m tests._transfer_peer trainer  CONFIG_JSON
    python -m tests._transfer_peer receiver CONFIG_JSON

Both sides derive the same deterministic bucket plan from the config and run
the same sequence of rounds over one weight-update group; each writes a JSON
report (to ``config["out"]``) with per-bucket sha256 digests of the bytes it
sent or received, so the test can compare them.

A trainer round may misbehave: ``kill_after`` / ``stall_after`` (buckets sent
before it dies or stalls), or ``short_by`` / ``long_by`` (bytes fewer or more
than announced in one broadcast: bucket ``at``, and for the per-tensor format its
tensor ``tensor``; see :func:`send_tampered`).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from router.contract.bucket_layout import BucketLayout
from router.dataplane.buckets import pack, raw_bytes
from router.dataplane.formats import for_load_format, get_format
from router.dataplane.group import GroupError, WeightUpdateGroup, init_weight_update_group
from router.trainer.sender import BucketPlan, TrainerWeightSender
from worker.transfer.group.receiver import BucketReceiver

# One bucket's tensors: mixed dtypes and odd sizes, so a naive order would be unaligned.
BUCKET_TEMPLATE = [
    ("w_bf16", "bfloat16", [7, 13]),
    ("w_f32", "float32", [16, 33]),
    ("w_i8", "int8", [5]),
    ("w_f16", "float16", [3, 3]),
    ("w_i64", "int64", [4]),
    ("w_bool", "bool", [3]),
    ("w_f64", "float64", [2, 3]),
]


def make_plan(num_buckets: int) -> BucketPlan:
    spec = [(f"layers.{b}.{n}", d, s) for b in range(num_buckets) for n, d, s in BUCKET_TEMPLATE]
    per_bucket = BucketPlan.from_spec(
        [(f"x.{n}", d, s) for n, d, s in BUCKET_TEMPLATE], budget_bytes=1 << 30
    ).total_bytes
    plan = BucketPlan.from_spec(spec, budget_bytes=per_bucket)
    assert len(plan.buckets) == num_buckets, (len(plan.buckets), num_buckets)
    return plan


def make_tensors(plan: BucketPlan, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for layout in plan.buckets:
        for slot in layout.slots:
            dtype = getattr(torch, slot.dtype)
            if dtype.is_floating_point:
                t = torch.randn(slot.shape, generator=gen, dtype=torch.float32).to(dtype)
            elif dtype == torch.bool:
                t = torch.randint(0, 2, slot.shape, generator=gen).bool()
            else:
                t = torch.randint(-100, 100, slot.shape, generator=gen).to(dtype)
            out[slot.name] = t
    return out


def bucket_digest(named: list[tuple[str, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for name, t in named:
        h.update(name.encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def resized(data: torch.Tensor, delta: int) -> torch.Tensor:
    """``data`` (flat ``uint8``) cut short by ``-delta`` bytes, or ``delta`` bytes longer."""
    if delta < 0:
        return data[: data.numel() + delta].clone()
    return torch.cat([data, torch.full((delta,), 0xA5, dtype=torch.uint8)])


def tampered_broadcasts(
    layout: BucketLayout, tensors: dict[str, torch.Tensor], load_format: str | None, delta: int, tensor: int
) -> list[torch.Tensor]:
    """What the format would broadcast for ``layout``, with one message ``delta`` bytes off
    (the whole packed bucket, or tensor number ``tensor`` of a per-tensor bucket)."""
    if load_format == "flattened_bucket":
        return [resized(pack([(n, tensors[n]) for n in layout.names], layout), delta)]
    messages = [tensors[n].contiguous() for n in layout.names]
    messages[tensor] = resized(raw_bytes(messages[tensor]), delta)
    return messages


def send_tampered(
    group: WeightUpdateGroup,
    plan: BucketPlan,
    tensors: dict[str, torch.Tensor],
    load_format: str | None,
    tamper: dict[str, int],
    timeout_s: float,
) -> None:
    """Broadcast ``plan`` as the format does, bucket by bucket, but bucket ``tamper["at"]``
    (default 3) with ``short_by`` fewer or ``long_by`` more bytes in one of its messages."""
    fmt = for_load_format(load_format)
    at = tamper.get("at", 3)
    for index, layout in enumerate(plan.buckets):
        if index == at:
            send_tampered_bucket(group, layout, tensors, load_format, tamper, timeout_s)
            continue
        for work in fmt.post_send(group, layout, tensors, None):
            group.wait(work, timeout_s)


def send_tampered_bucket(
    group: WeightUpdateGroup,
    layout: BucketLayout,
    tensors: dict[str, torch.Tensor],
    load_format: str | None,
    tamper: dict[str, int],
    timeout_s: float,
) -> None:
    """Broadcast one bucket as the format would, but with ``short_by`` fewer or ``long_by`` more
    bytes in one message (the packed bucket, or per-tensor message number ``tensor``)."""
    delta = tamper.get("long_by", 0) - tamper.get("short_by", 0)
    messages = tampered_broadcasts(layout, tensors, load_format, delta, tamper.get("tensor", 0))
    for work in [group.broadcast_async(m) for m in messages]:
        group.wait(work, timeout_s)


def run_trainer(cfg: dict[str, Any]) -> dict[str, Any]:
    plan = make_plan(cfg["num_buckets"])
    sender = TrainerWeightSender(
        master_port=cfg["port"], world_size=cfg["world_size"], group_name=cfg["group"], timeout_s=cfg["timeout_s"]
    )
    report: dict[str, Any] = {"rounds": []}
    try:
        sender.join()
    except GroupError as exc:
        report["init"] = f"error: {exc}"
        return report
    report["init"] = "ok"
    for r, rnd in enumerate(cfg["rounds"]):
        tensors = make_tensors(plan, seed=cfg["seed"] + r)
        fmt = None if rnd["format"] == "per_tensor" else "flattened_bucket"
        kill_after = rnd.get("kill_after")
        stall_after = rnd.get("stall_after")

        def progress(done: int, total: int, nbytes: int, kill_after=kill_after, stall_after=stall_after) -> None:
            if kill_after is not None and done == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash, as far as the peers can tell
            if stall_after is not None and done == stall_after:
                time.sleep(cfg["timeout_s"] * 3)
                os._exit(3)

        digests = [bucket_digest([(n, tensors[n]) for n in b.names]) for b in plan.buckets]
        try:
            if rnd.get("short_by") or rnd.get("long_by"):
                assert sender.group is not None
                send_tampered(sender.group, plan, tensors, fmt, rnd, cfg["timeout_s"])
                report["rounds"].append({"ok": True, "digests": digests})
                continue
            stats = sender.send(plan, tensors, load_format=fmt, progress=progress)
            report["rounds"].append({"ok": True, "digests": digests, "bytes": stats.bytes})
        except Exception as exc:
            report["rounds"].append({"ok": False, "error": str(exc), "digests": digests})
    sender.close()
    return report


def run_receiver(cfg: dict[str, Any]) -> dict[str, Any]:
    plan = make_plan(cfg["num_buckets"])
    report: dict[str, Any] = {"rounds": []}
    try:
        group = init_weight_update_group(
            master_address="127.0.0.1",
            master_port=cfg["port"],
            rank=cfg["rank"],
            world_size=cfg["world_size"],
            group_name=cfg["group"],
            timeout_s=cfg["timeout_s"],
        )
    except GroupError as exc:
        report["init"] = f"error: {exc}"
        return report
    report["init"] = "ok"
    # Stands in for the worker's scheduler thread: applies run there, one at a time.
    applier = ThreadPoolExecutor(max_workers=1)
    for rnd in cfg["rounds"]:
        digests: dict[int, str] = {}
        fail_at = rnd.get("fail_apply_at")

        def apply_one(index: int, named: list[tuple[str, torch.Tensor]], fail_at=fail_at, digests=digests) -> None:
            if fail_at is not None and index == fail_at:
                raise ValueError(f"refusing bucket {index}")
            digests[index] = bucket_digest(named)

        apply = None if rnd.get("atomic") else (lambda i, named: applier.submit(apply_one, i, named))
        receiver = BucketReceiver(group, plan.buckets, fmt=get_format(rnd["format"]), apply=apply)
        try:
            receiver.start(timeout_s=cfg["timeout_s"])
        except GroupError as exc:
            report["rounds"].append({"state": "not-started", "error": str(exc)})
            continue
        outcome = receiver.wait(timeout_s=cfg["timeout_s"] + 5)
        if outcome.ok and rnd.get("atomic"):
            for index, named in receiver.staged():
                digests[index] = bucket_digest(named)
            receiver.release()
        report["rounds"].append(
            {
                "state": outcome.state.value,
                "error": outcome.error,
                "buckets_received": outcome.buckets_received,
                "buckets_applied": outcome.buckets_applied,
                "digests": [digests.get(i) for i in range(len(plan.buckets))],
                "group_broken": group.broken_reason,
            }
        )
    applier.shutdown(wait=False)
    group.destroy()
    return report


def main() -> None:
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    started = time.monotonic()
    try:
        report = run_trainer(cfg) if role == "trainer" else run_receiver(cfg)
    except Exception:
        report = {"crash": traceback.format_exc()}
    report["elapsed_s"] = time.monotonic() - started
    with open(cfg["out"], "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
