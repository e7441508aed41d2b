"""A trainer process for the weight-sync tests: rank 0 of the group, HTTP to real workers.

    python -m tests._weight_sync_trainer CONFIG_JSON

``config["scenario"]`` picks the sequence; every step's HTTP answers are
written to ``config["out"]`` (also after each step, so a run that kills itself
mid-broadcast still leaves its report).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from router.contract.bucket_layout import BucketLayout
from tests.procs import http_json
from worker.model import read_checkpoint
from router.dataplane.group import GroupError
from router.trainer.sender import BucketPlan, TrainerWeightSender, WeightSyncError, sent_checksum

HTTP_TIMEOUT_S = 120.0


class Trainer:
    def __init__(self, cfg: dict[str, Any]):
        self.cfg = cfg
        self.workers: list[str] = cfg["workers"]
        self.report: dict[str, Any] = {"steps": []}
        self.pool = ThreadPoolExecutor(max_workers=max(2, len(self.workers)))
        self.sender = TrainerWeightSender(
            master_port=cfg["port"], world_size=cfg.get("world_size", 1 + len(self.workers)),
            group_name=cfg["group"], timeout_s=cfg["timeout_s"],
        )

    def log(self, step: str, **data: Any) -> None:
        self.report["steps"].append({"step": step, **data})
        self.flush()

    def flush(self) -> None:
        with open(self.cfg["out"], "w") as f:
            json.dump(self.report, f)

    def fanout(self, method: str, path: str, bodies: list[Any] | Any) -> list[tuple[int, Any]]:
        if not isinstance(bodies, list):
            bodies = [bodies] * len(self.workers)
        futures = [self.pool.submit(http_json, method, url + path, body, timeout=HTTP_TIMEOUT_S)
                   for url, body in zip(self.workers, bodies)]
        return [f.result() for f in futures]

    # -- steps --------------------------------------------------------------------------------

    def connect(self, world_sizes: list[int] | None = None) -> bool:
        sizes = world_sizes or [self.sender.world_size] * len(self.workers)
        bodies = [self.sender.init_body(i + 1, world_size=w) for i, w in enumerate(sizes)]
        try:
            answers = self.sender.connect(lambda: self.fanout("POST", "/init_weights_update_group", bodies))
        except GroupError as exc:
            self.log("connect", ok=False, error=str(exc))
            return False
        self.log("connect", ok=True, answers=answers)
        return True

    def disconnect(self) -> None:
        answers = self.fanout("POST", "/destroy_weights_update_group", {"group_name": self.cfg["group"]})
        self.sender.close()
        self.log("disconnect", answers=answers)

    def two_phase(self, plan: BucketPlan, tensors: dict[str, torch.Tensor], *, load_format: str | None,
                  atomic: list[bool], version: str, progress: Callable | None = None) -> None:
        def prepare(body: dict) -> dict:
            bodies = [{**body, "atomic": a} for a in atomic]
            answers = self.fanout("POST", "/prepare_weights_update", bodies)
            self.log("prepare", answers=answers)
            ok = all(status == 200 and ans.get("status") == "ready" for status, ans in answers)
            return {"status": "ready" if ok else "error", "message": str(answers)}

        def complete(body: dict) -> dict:
            answers = self.fanout("POST", "/complete_weights_update", body)
            self.log("complete", answers=answers)
            return {"success": all(a.get("success") for _, a in answers), "message": str(answers)}

        try:
            self.sender.update_two_phase(plan, tensors, prepare=prepare, complete=complete, load_format=load_format,
                                         weight_version=version, return_checksum=True, progress=progress,
                                         timeout_s=self.cfg["timeout_s"])
            self.log("update", ok=True, sent_checksum=sent_checksum(tensors.items()))
        except WeightSyncError as exc:
            self.log("update", ok=False, error=str(exc))

    def single_phase(self, plan: BucketPlan, tensors: dict[str, torch.Tensor], *, load_format: str | None,
                     version: str) -> None:
        """slime's sequence (reference §3.1): pause (abort mode), flush, then per bucket
        fire the HTTP call and broadcast at once; continue at the end."""
        self.log("pause", answers=self.fanout("POST", "/pause_generation", {}))
        self.log("flush", answers=self.fanout("GET", "/flush_cache", None))

        def post_update(body: dict) -> dict:
            answers = self.fanout("POST", "/update_weights_from_distributed", body)
            return {"success": all(a.get("success") for _, a in answers), "message": str(answers)}

        try:
            answers = self.sender.update_single_phase(plan, tensors, post_update=post_update, load_format=load_format,
                                                      weight_version=version, flush_cache=False)
            self.log("update", ok=True, buckets=len(answers), sent_checksum=sent_checksum(tensors.items()))
        except WeightSyncError as exc:
            self.log("update", ok=False, error=str(exc))
        self.log("continue", answers=self.fanout("POST", "/continue_generation", {}))

    def checksums(self, label: str) -> None:
        answers = self.fanout("POST", "/weights_checker", {"action": "checksum"})
        self.log(label, checksums=[a.get("per_gpu_checksum") for _, a in answers],
                 versions=[http_json("GET", u + "/model_info")[1]["weight_version"] for u in self.workers])


def load_weights(path: str) -> dict[str, torch.Tensor]:
    return dict(read_checkpoint(path, torch.float32))


def plan_with_buckets(tensors: dict[str, torch.Tensor], num_buckets: int) -> BucketPlan:
    """Exactly ``num_buckets`` buckets: one tensor each, the first few holding two."""
    names = list(tensors)
    doubles = len(names) - num_buckets
    groups = [names[2 * i : 2 * i + 2] for i in range(doubles)] + [[n] for n in names[2 * doubles :]]
    layouts = [BucketLayout.from_meta(g, ["float32"] * len(g), [list(tensors[n].shape) for n in g]) for g in groups]
    return BucketPlan(buckets=tuple(layouts), budget_bytes=1 << 30)


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    t = Trainer(cfg)
    scenario = cfg["scenario"]
    if scenario == "join":
        t.connect(cfg.get("worker_world_sizes"))
        return t.report
    if not t.connect():
        return t.report
    rounds = cfg["rounds"]
    for rnd in rounds:
        tensors = load_weights(rnd["ckpt"])
        plan = plan_with_buckets(tensors, cfg["num_buckets"])
        if rnd.get("bad_shape"):
            # Announce one tensor with a wrong shape: prepare must refuse and nothing is broadcast.
            name = plan.buckets[3].names[0]
            tensors[name] = torch.zeros(3, 5)
            plan = BucketPlan(buckets=plan.buckets[:3] + (BucketLayout.from_meta([name], ["float32"], [[3, 5]]),)
                              + plan.buckets[4:], budget_bytes=plan.budget_bytes)
        fmt = rnd.get("format")
        if scenario == "two_phase":
            if cfg.get("pause", True):
                t.log("pause", answers=t.fanout("POST", "/pause_generation", {"mode": "retract"}))
            progress = None
            if rnd.get("kill_after") is not None:
                def progress(done: int, total: int, nbytes: int, k: int = rnd["kill_after"]) -> None:
                    if done == k:
                        t.log("killing", buckets_sent=done)
                        os.kill(os.getpid(), signal.SIGKILL)
            t.two_phase(plan, tensors, load_format=fmt, atomic=rnd.get("atomic", [False] * len(t.workers)),
                        version=rnd["version"], progress=progress)
            if cfg.get("pause", True):
                t.log("continue", answers=t.fanout("POST", "/continue_generation", {}))
        else:
            t.single_phase(plan, tensors, load_format=fmt, version=rnd["version"])
        t.checksums(f"after {rnd['version']}")
    t.disconnect()
    return t.report


def main() -> None:
    cfg = json.loads(sys.argv[1])
    try:
        report = run(cfg)
    except Exception:
        report = {"crash": traceback.format_exc()}
    with open(cfg["out"], "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
