"""A trainer process for the weight-sync tests: rank 0 of the group, HTTP to real workers.

    python -m tests._weight_sync_trainer CONFIG_JSON

It stands for a hand-written SGLang-style trainer (slime, miles): it talks to
every worker directly, giving each its own ``rank_offset``, and sequences the
HTTP calls itself; the project's own sync driver (``router.trainer``) talks to
the router instead and is tested in ``test_router_sync``.

``config["scenario"]`` picks the sequence (a round's ``mode`` overrides it for
that round); every step's HTTP answers are written to ``config["out"]`` (also
after each step, so a run that kills itself mid-broadcast still leaves its report).

Two-phase prepares carry each bucket's ``nbytes`` and ``checksum`` unless a round
says ``checksums: false``. A round may misbehave on the wire: ``short_by`` /
``long_by`` bytes in one message of bucket ``at`` (``tests._transfer_peer.send_tampered``),
or ``bad_checksum``: other bytes than announced in bucket ``at``, same sizes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from router.contract.bucket_layout import BucketLayout
from router.dataplane.group import GroupError
from router.trainer.rendezvous import alongside
from router.trainer.sender import BucketPlan, TrainerWeightSender, sent_checksum
from tests._transfer_peer import send_tampered
from tests.procs import http_json
from worker.model import read_checkpoint

HTTP_TIMEOUT_S = 120.0


class WeightSyncError(RuntimeError):
    """A worker refused or failed an update."""


class Trainer:
    def __init__(self, cfg: dict[str, Any]):
        self.cfg = cfg
        self.workers: list[str] = cfg["workers"]
        self.report: dict[str, Any] = {"steps": []}
        self.pool = ThreadPoolExecutor(max_workers=max(2, len(self.workers)))
        self.sender = TrainerWeightSender(
            master_port=cfg["port"],
            world_size=cfg.get("world_size", 1 + len(self.workers)),
            group_name=cfg["group"],
            timeout_s=cfg["timeout_s"],
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
        futures = [
            self.pool.submit(http_json, method, url + path, body, timeout=HTTP_TIMEOUT_S)
            for url, body in zip(self.workers, bodies, strict=True)
        ]
        return [f.result() for f in futures]

    # -- steps --------------------------------------------------------------------------------

    def connect(self, world_sizes: list[int] | None = None) -> bool:
        sizes = world_sizes or [self.sender.world_size] * len(self.workers)
        bodies = [self.sender.init_request(i + 1, world_size=w) for i, w in enumerate(sizes)]
        try:
            answers = alongside(
                lambda: self.fanout("POST", "/init_weights_update_group", bodies),
                self.sender.join,
                timeout_s=HTTP_TIMEOUT_S,
                what="init",
            )
        except GroupError as exc:
            self.log("connect", ok=False, error=str(exc))
            return False
        self.log("connect", ok=True, answers=answers)
        return True

    def disconnect(self) -> None:
        answers = self.fanout("POST", "/destroy_weights_update_group", {"group_name": self.cfg["group"]})
        self.sender.close()
        self.log("disconnect", answers=answers)

    def two_phase(
        self,
        plan: BucketPlan,
        tensors: dict[str, torch.Tensor],
        *,
        load_format: str | None,
        atomic: list[bool],
        version: str,
        progress: Callable | None = None,
        checksums: bool = True,
        tamper: dict[str, int] | None = None,
    ) -> None:
        """prepare on every worker -> broadcast every bucket -> complete on every worker."""
        body = plan.prepare_request(
            self.cfg["group"],
            tensors=tensors if checksums else None,
            load_format=load_format,
            weight_version=version,
            timeout_s=self.cfg["timeout_s"],
        )
        answers = self.fanout(
            "POST", "/prepare_weights_update", [body.model_copy(update={"atomic": a}) for a in atomic]
        )
        self.log("prepare", answers=answers)
        if not all(status == 200 and ans.get("status") == "ready" for status, ans in answers):
            self.log("update", ok=False, error=f"prepare_weights_update refused: {answers}")
            return
        send_error: Exception | None = None
        try:
            self.broadcast(plan, tensors, load_format, progress, tamper)
        except Exception as exc:  # still call complete: it reports the receivers' view
            send_error = exc
        complete = {
            "group_name": self.cfg["group"],
            "weight_version": version,
            "return_checksum": True,
            "timeout_s": self.cfg["timeout_s"],
        }
        answers = self.fanout("POST", "/complete_weights_update", complete)
        self.log("complete", answers=answers)
        if send_error is not None:
            self.log("update", ok=False, error=f"broadcast failed: {send_error}; complete answered {answers}")
        elif not all(a.get("success") for _, a in answers):
            self.log("update", ok=False, error=f"complete_weights_update failed: {answers}")
        else:
            self.log("update", ok=True, sent_checksum=sent_checksum(tensors.items()))

    def broadcast(
        self,
        plan: BucketPlan,
        tensors: dict[str, torch.Tensor],
        load_format: str | None,
        progress: Callable | None = None,
        tamper: dict[str, int] | None = None,
    ) -> None:
        """Send ``plan``; with ``tamper``, bucket ``tamper["at"]`` is not what was announced."""
        if not tamper:
            self.sender.send(plan, tensors, load_format=load_format, progress=progress)
        elif tamper.get("bad_checksum"):
            sent = dict(tensors)
            name = plan.buckets[tamper["at"]].names[0]
            sent[name] = tensors[name] + 1.0  # same dtype and shape: only the checksum can tell
            self.sender.send(plan, sent, load_format=load_format, progress=progress)
        else:
            assert self.sender.group is not None
            send_tampered(self.sender.group, plan, tensors, load_format, tamper, self.cfg["timeout_s"])

    def single_phase(
        self,
        plan: BucketPlan,
        tensors: dict[str, torch.Tensor],
        *,
        load_format: str | None,
        version: str,
        tamper: dict[str, int] | None = None,
    ) -> None:
        """slime's sequence: pause (abort mode), flush, then per bucket
        fire the HTTP call and broadcast at once; continue at the end."""
        self.log("pause", answers=self.fanout("POST", "/pause_generation", {}))
        self.log("flush", answers=self.fanout("GET", "/flush_cache", None))
        try:
            for index, layout in enumerate(plan.buckets):
                wrong = {**tamper, "at": 0} if tamper and tamper.get("at") == index else None
                body = {
                    "names": layout.names,
                    "dtypes": layout.dtypes,
                    "shapes": layout.shapes,
                    "group_name": self.cfg["group"],
                    "flush_cache": False,
                    "weight_version": version,
                    "load_format": load_format,
                }
                answers = alongside(
                    lambda b=body: self.fanout("POST", "/update_weights_from_distributed", b),
                    lambda layout=layout, wrong=wrong: self.broadcast(
                        BucketPlan((layout,), plan.budget_bytes), tensors, load_format, tamper=wrong
                    ),
                    timeout_s=HTTP_TIMEOUT_S,
                    what="update_weights_from_distributed",
                    settle_on_failure=False,
                )
                if not all(a.get("success") for _, a in answers):
                    raise WeightSyncError(f"update_weights_from_distributed failed: {answers}")
            self.log("update", ok=True, buckets=len(plan.buckets), sent_checksum=sent_checksum(tensors.items()))
        except (WeightSyncError, GroupError, TimeoutError) as exc:
            self.log("update", ok=False, error=str(exc))
        self.log("continue", answers=self.fanout("POST", "/continue_generation", {}))

    def checksums(self, label: str) -> None:
        answers = self.fanout("POST", "/weights_checker", {"action": "checksum"})
        infos = [http_json("GET", u + "/model_info")[1] for u in self.workers]
        self.log(
            label,
            checksums=[a.get("per_gpu_checksum") for _, a in answers],
            versions=[i["weight_version"] for i in infos],
            partial=[i.get("weights_partial") for i in infos],
            health=[http_json("GET", u + "/health")[0] for u in self.workers],
        )


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
            plan = BucketPlan(
                buckets=(*plan.buckets[:3], BucketLayout.from_meta([name], ["float32"], [[3, 5]]), *plan.buckets[4:]),
                budget_bytes=plan.budget_bytes,
            )
        fmt = rnd.get("format")
        tamper = {k: rnd[k] for k in ("short_by", "long_by", "bad_checksum", "at", "tensor") if k in rnd}
        if rnd.get("mode", scenario) == "two_phase":
            if cfg.get("pause", True):
                t.log("pause", answers=t.fanout("POST", "/pause_generation", {"mode": "retract"}))
            progress = None
            if rnd.get("kill_after") is not None:

                def progress(done: int, total: int, nbytes: int, k: int = rnd["kill_after"]) -> None:
                    if done == k:
                        t.log("killing", buckets_sent=done)
                        os.kill(os.getpid(), signal.SIGKILL)

            t.two_phase(
                plan,
                tensors,
                load_format=fmt,
                atomic=rnd.get("atomic", [False] * len(t.workers)),
                version=rnd["version"],
                progress=progress,
                checksums=rnd.get("checksums", True),
                tamper=tamper,
            )
            if cfg.get("pause", True):
                t.log("continue", answers=t.fanout("POST", "/continue_generation", {}))
        else:
            t.single_phase(plan, tensors, load_format=fmt, version=rnd["version"], tamper=tamper)
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
