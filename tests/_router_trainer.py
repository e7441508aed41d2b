"""A trainer process that syncs weights through the router (used by test_router_sync
and test_client_recovery).

    python -m tests._router_trainer CONFIG_JSON

Loads the tiny checkpoint, and for each configured step perturbs every tensor
(unless ``"perturb": false``: then it sends the checkpoint as it is), then runs ``RouterClient.sync_weights`` (group init on the first step, pause,
prepare/broadcast/complete or the single-phase calls, verify, continue) with
the transfer package's sender doing the broadcasts. Writes a JSON report.

A step is ``[protocol, load_format]`` or ``[protocol, load_format, options]``;
options: ``atomic`` (two-phase mode), ``fail_at_bucket`` (the broadcast
callable raises instead of sending that bucket) and ``die_at_bucket`` (the
process exits at once, with no clean-up, instead of sending that bucket: a
trainer that crashed mid-sync), ``short_by`` / ``long_by`` (bucket ``at`` is
broadcast with that many bytes fewer or more than announced: a buggy trainer;
the step is expected to fail like a ``fail_at_bucket`` one). A step with ``fail_at_bucket``
is expected to fail: its :class:`SyncError` is recorded in the step's entry,
followed by what the router says right after (``after_failure``), and the
next step goes on with the same client. ``"client": "async"`` in the config
runs every sync through one :class:`AsyncRouterClient` instead; ``"keep_group": true`` leaves the
group on the workers at the end (a trainer that exits without its clean-up).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from router.trainer import (
    AsyncRouterClient,
    BucketPlan,
    RouterCallError,
    RouterClient,
    SyncError,
    SyncReport,
    TrainerWeightSender,
    sent_checksum,
)
from tests._router_fixtures import ADMIN_KEY
from tests._transfer_peer import send_tampered_bucket
from tests.procs import ManagedProcess, free_port
from worker.model.checkpoint import read_checkpoint

#: The router's admin-lock wait as the tests configure it: a router still holding its
#: lock answers the probe's pause 503 within it.
PROBE_LOCK_WAIT_S = 5
#: The exit status of a trainer told to die mid-sync.
DIED = 17


class InjectedFailure(RuntimeError):
    """The broadcast callable's planned failure."""


def after_failure(client: RouterClient | AsyncRouterClient) -> dict:
    """The router's state right after a failed sync: is its admin lock free, is anything fenced?"""
    probe = RouterClient(client.url, admin_key=client.admin_key, lock_wait_s=PROBE_LOCK_WAIT_S)
    try:
        probe.pause_generation()
        pause: dict = {"status": 200}
    except RouterCallError as exc:
        pause = {"status": exc.status, "message": exc.message}
    pending = probe.update_journal().pending
    return {
        "joined_groups": sorted(client.joined_groups),
        "pause": pause,
        "journal_pending": None if pending is None else pending.model_dump(mode="json"),
        "disabled": [w.url for w in probe.list_workers().workers if w.disabled],
        "checksums": probe.weights_checker("checksum").rank_checksums,
    }


def sync(client: RouterClient | AsyncRouterClient, **options: object) -> SyncReport:
    if isinstance(client, AsyncRouterClient):
        return asyncio.run(client.sync_weights(**options))  # type: ignore[arg-type]
    return client.sync_weights(**options)  # type: ignore[arg-type]


def main(cfg: dict) -> dict:
    client = RouterClient(cfg["router"], admin_key=cfg["admin_key"])
    tensors = {n: t.clone() for n, t in read_checkpoint(cfg["model"], torch.float32)}
    plan = BucketPlan.from_named_tensors(tensors, budget_bytes=cfg["bucket_bytes"])
    world = client.get_world_size().world_size + 1
    sender = TrainerWeightSender(master_port=cfg["port"], world_size=world, timeout_s=60)
    group = sender.group_spec()
    report: dict = {"world_size": world, "num_buckets": len(plan.buckets), "steps": []}
    syncing: RouterClient | AsyncRouterClient = client
    if cfg.get("client") == "async":
        syncing = AsyncRouterClient(cfg["router"], admin_key=cfg["admin_key"])
    try:
        for step, (protocol, fmt, *more) in enumerate(cfg["steps"]):
            options = more[0] if more else {}
            fail_at = options.get("fail_at_bucket")
            die_at = options.get("die_at_bucket")
            tamper = {k: options[k] for k in ("short_by", "long_by") if k in options}
            tamper_at = options.get("at", 1) if tamper else None
            if cfg.get("perturb", True):
                with torch.no_grad():
                    for t in tensors.values():
                        t.add_(0.001 * (step + 1))
            expected = sent_checksum(tensors.items())

            def broadcast(i: int, fmt=fmt, fail_at=fail_at, die_at=die_at, tamper_at=tamper_at, tamper=tamper) -> None:
                if i == die_at:
                    os._exit(DIED)
                if i == fail_at:
                    raise InjectedFailure(f"the trainer failed before sending bucket {i}")
                if i == tamper_at:
                    assert sender.group is not None
                    send_tampered_bucket(sender.group, plan.buckets[i], tensors, fmt, tamper, 60)
                    return
                sender.send(BucketPlan((plan.buckets[i],), plan.budget_bytes), tensors, load_format=fmt)

            stages: list[str] = []
            try:
                result = sync(
                    syncing,
                    buckets=plan.metadata(),
                    broadcast=broadcast,
                    group=group,
                    protocol=protocol,
                    load_format=fmt,
                    weight_version=f"step-{step}",
                    expected_checksum=expected,
                    timeout_s=60,
                    atomic=options.get("atomic"),
                    progress=lambda stage, info, stages=stages: (
                        stages.append(stage) if info.get("state") == "done" else None
                    ),
                )
            except SyncError as exc:
                if fail_at is None and tamper_at is None:
                    raise
                report["steps"].append(
                    {
                        "failed": {
                            "stage": exc.stage,
                            "weights_uncertain": exc.weights_uncertain,
                            "message": str(exc),
                            "cause": type(exc.cause).__name__,
                            "recovery": exc.recovery,
                            "results": [r.model_dump(mode="json") for r in exc.results],
                        },
                        "stages": stages,
                        "after_failure": after_failure(syncing),
                    }
                )
                continue
            entry = result.model_dump(mode="json")
            entry.update(expected=expected, stages=stages)
            report["steps"].append(entry)
        if not cfg.get("keep_group"):  # kept: a trainer that exits without its clean-up (it crashed, it restarts)
            client.destroy_weights_update_group()
    except SyncError as exc:
        results = [r.model_dump(mode="json") for r in exc.results]
        report["error"] = {"stage": exc.stage, "message": str(exc), "results": results, "recovery": exc.recovery}
    except Exception:
        report["error"] = {"stage": "?", "message": traceback.format_exc()}
    finally:
        sender.close()
    return report


def run_trainer(
    router_url: str, model: Any, out_dir: Any, steps: list[Any], *, timeout: float = 240, **extra: Any
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """Run this module as a trainer process against ``router_url`` to its end: its exit (``stderr``
    holds all it wrote) and its report (``{}`` when it wrote none)."""
    out = Path(out_dir) / f"trainer-report-{os.getpid()}-{len(steps)}-{free_port()}.json"
    cfg = {
        "router": router_url,
        "admin_key": extra.pop("admin_key", ADMIN_KEY),
        "model": str(model),
        "port": free_port(),
        "out": str(out),
        "bucket_bytes": 64 * 1024,
        "steps": steps,
        **extra,
    }
    trainer = ManagedProcess("trainer", [sys.executable, "-m", "tests._router_trainer", json.dumps(cfg)]).start()
    code = trainer.wait_exit(timeout)
    done = subprocess.CompletedProcess(trainer.argv, code, "", trainer.log_text())
    return done, json.loads(out.read_text()) if out.exists() else {}


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    out = main(config)
    with open(config["out"], "w") as f:
        json.dump(out, f, default=str)
