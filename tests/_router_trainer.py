"""A trainer process that syncs weights through the router (used by test_router_sync).

    python -m tests._router_trainer CONFIG_JSON

Loads the tiny checkpoint, and for each configured step perturbs every tensor,
then runs ``RouterClient.sync_weights`` (group init on the first step, pause,
prepare/broadcast/complete or the single-phase calls, verify, continue) with
the transfer package's sender doing the broadcasts. Writes a JSON report.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import traceback

import torch

from router.client import GroupSpec, RouterClient, SyncError
from worker.model.checkpoint import read_checkpoint
from worker.transfer.sender import BucketPlan, TrainerWeightSender, sent_checksum


def main(cfg: dict) -> dict:
    client = RouterClient(cfg["router"], admin_key=cfg["admin_key"], timeout_s=60)
    tensors = {n: t.clone() for n, t in read_checkpoint(cfg["model"], torch.float32)}
    plan = BucketPlan.from_named_tensors(tensors, budget_bytes=cfg["bucket_bytes"])
    world = client.get_world_size()["world_size"] + 1
    sender = TrainerWeightSender(master_port=cfg["port"], world_size=world, timeout_s=60)
    group = GroupSpec(master_address="127.0.0.1", master_port=cfg["port"], join=lambda _world: sender.join(), timeout_s=60)
    report: dict = {"world_size": world, "num_buckets": len(plan.buckets), "steps": []}
    try:
        for step, (protocol, fmt) in enumerate(cfg["steps"]):
            with torch.no_grad():
                for t in tensors.values():
                    t.add_(0.001 * (step + 1))
            expected = sent_checksum(tensors.items())

            def broadcast(i: int, fmt=fmt) -> None:
                sender.send(BucketPlan((plan.buckets[i],), plan.budget_bytes), tensors, load_format=fmt)

            stages: list[str] = []
            result = client.sync_weights(
                buckets=plan.metadata(), broadcast=broadcast, group=group, protocol=protocol, load_format=fmt,
                weight_version=f"step-{step}", expected_checksum=expected, timeout_s=60,
                progress=lambda stage, info: stages.append(stage) if info.get("state") == "done" else None,
            )  # fmt: skip
            entry = dataclasses.asdict(result)
            entry.update(expected=expected, stages=stages)
            report["steps"].append(entry)
        client.destroy_weights_update_group()
    except SyncError as exc:
        report["error"] = {"stage": exc.stage, "message": str(exc), "results": exc.results}
    except Exception:  # noqa: BLE001 - reported to the test
        report["error"] = {"stage": "?", "message": traceback.format_exc()}
    finally:
        sender.close()
    return report


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    out = main(config)
    with open(config["out"], "w") as f:
        json.dump(out, f, default=str)
