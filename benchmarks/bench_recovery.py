"""Recovery, measured: a worker SIGKILLed in the middle of a trainer's sync through the router, then restarted.

    python -m benchmarks.bench_recovery [--workers 8] [--rounds 3] [--kill-at transfer,complete]

Starts ``--workers`` real ``omni-worker`` processes on the tiny checkpoint (``omni-worker make-tiny``), one
``omni-router`` over them (``--state-dir``, one process, probes every ``--health-check-interval-s``), and
plays the trainer in this process: ``RouterClient.sync_weights`` over a gloo group (the two-phase flow:
group init when the fleet changed, pause, prepare, broadcast, complete, verify, continue) with
``TrainerWeightSender`` as rank 0, every tensor of the checkpoint perturbed before each sync so every sync
brings new weights.

A sync in flight is what is measured, not an update from disk: that is the case where a dead worker can
hold the others (a collective that waits for its rank, a prepared update the router holds under its lock).

First a few fault-free syncs (the reference: their median, the *sync time*). Then each round, for each kill
point in ``--kill-at``:

* ``transfer``: one worker (a different one each time) is SIGKILLed (its whole process group) by the
  trainer's broadcast callable just before it sends the middle bucket, and the broadcast goes on;
* ``complete``: it is SIGKILLed once every bucket was broadcast, before the trainer calls complete.

Measured:

* (a) *resolve*: from the kill until ``sync_weights`` returns or raises (the router's answer and the
  client's own clean-up: abort, group destroy, leave). Target: within max(5 s, 2 x the sync time).
  The outcome is read from the router: which workers hold the new version, which are fenced, what the
  journal holds. The benchmark then acts as the operator and the trainer: it resolves the journal
  entry (``POST /weight_update_journal/resolve``) and continues generation.
* (b) *rejoin*: the killed worker is started again on its port (its boot checkpoint) at once; from that
  start until it serves the fleet's weights: ``GET /workers`` on the router shows it healthy, enabled,
  not pending (so the router routes to it), and its own ``/get_weight_version`` equals the fleet's.
  Target: within 30 s (llm-d's engine recovery target). Once the router sees the new process, the
  workers leave the old group (``/destroy_weights_update_group``: the client's own leave after the
  failure was refused while the journal entry was pending, and a survivor still in the group would
  refuse the next init); then the router's catch-up loads the fleet's weights into it from a peer
  when the survivors committed, and when the update broke off on every survivor (nobody holds the
  fleet's weights whole) the trainer syncs again, as a trainer loop retries a failed step.

Then a fault-free sync brings the whole fleet (the restarted worker included: the group is rebuilt for
its new process) to the trainer's next weights, checked against the trainer's checksum, before the next
kill. Prints one JSON line per fault and a summary table (p50 and max of each figure, the targets, met
or not) with the machine line. Every process listens on 127.0.0.1, every wait is bounded, the whole run
is bounded by ``--budget-s``, and every process is stopped on exit.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.peer_tools import machine_line
from demo.launch import ManagedProcess, cli, free_port, http_json

KEY = "bench-recovery-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
KILL_POINTS = ("transfer", "complete")
#: llm-d's target for an engine back in service after a restart.
REJOIN_TARGET_S = 30.0
#: The floor of the resolve target: max(RESOLVE_FLOOR_S, 2 x the fault-free sync time).
RESOLVE_FLOOR_S = 5.0


class OutOfTime(RuntimeError):
    """The run's ``--budget-s`` is spent."""


@dataclass
class Worker:
    port: int
    proc: ManagedProcess

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Bench:
    root: Path
    boot: Path
    deadline: float
    interval_s: float
    workers: list[Worker] = field(default_factory=list)
    router: ManagedProcess | None = None
    router_url: str = ""

    def left(self, cap: float) -> float:
        """A wait's bound: ``cap``, or what is left of the run's budget when less (never below 1 s)."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise OutOfTime("the run's --budget-s is spent")
        return max(1.0, min(cap, left))

    # ------------------------------------------------------------------ processes

    def launch_worker(self, port: int) -> ManagedProcess:
        argv = [cli("omni-worker"), "--model-path", str(self.boot), "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--admin-api-key", KEY, "--num-threads", "1"]
        return ManagedProcess(f"recovery-worker-{port}", argv).start()

    def start_fleet(self, n: int) -> None:
        """``n`` workers started at once (torch's import dominates their start), then the router over them."""
        self.workers = [Worker(port, self.launch_worker(port)) for port in (free_port() for _ in range(n))]
        for w in self.workers:
            w.proc.wait_http_ready(w.url + "/health", timeout=self.left(300))
        port = free_port()
        argv = [cli("omni-router"), "--host", "127.0.0.1", "--port", str(port), "--admin-api-key", KEY]
        argv += ["--worker-urls", *(w.url for w in self.workers), "--data-plane-processes", "1"]
        argv += ["--health-check-interval-s", str(self.interval_s), "--state-dir", str(self.root / "state")]
        self.router = ManagedProcess("recovery-router", argv).start()
        self.router_url = f"http://127.0.0.1:{port}"
        self.router.wait_http_ready(self.router_url + "/liveness", timeout=self.left(60))
        until(lambda: all(_routable(v) for v in self.views().values()), self.left(120), "every worker routable")

    def stop(self) -> None:
        for w in self.workers:
            w.proc.stop()
        if self.router is not None:
            self.router.stop()

    # ------------------------------------------------------------------ the router's view

    def admin(self, method: str, path: str, body: Any = None, timeout: float = 30) -> tuple[int, Any]:
        return http_json(method, self.router_url + path, body, headers=HEADERS, timeout=self.left(timeout))

    def views(self) -> dict[str, dict[str, Any]]:
        """``GET /workers``, by URL."""
        status, body = self.admin("GET", "/workers")
        if status != 200:
            raise RuntimeError(f"GET /workers: {status} {body}")
        return {w["url"]: w for w in body["workers"]}

    def fleet_version(self) -> str | None:
        status, body = self.admin("GET", "/fleet/versions")
        return body.get("weight_version") if status == 200 and isinstance(body, dict) else None


def _routable(view: dict[str, Any]) -> bool:
    """What ``latest-only`` routing asks of a worker: healthy, enabled, not pending (GET /workers names why)."""
    return view["health"] == "healthy" and not view["disabled"] and not view.get("pending")


def operator(bench: Bench, trainer: Trainer, into: dict[str, Any]) -> None:
    """After a failed sync: resolve the journal entry it left (the operator vouching for the fleet as it is)
    and continue generation (the trainer's call: a failed sync leaves it paused)."""
    _, journal = bench.admin("GET", "/weight_update_journal")
    if isinstance(journal, dict) and journal.get("pending"):
        into["resolve_status"] = bench.admin("POST", "/weight_update_journal/resolve", {"acknowledge": True})[0]
    try:
        trainer.client.continue_generation()
    except Exception as exc:  # a dead worker fails it; the others are continued
        into["continue_error"] = str(exc)[:160]


def leave_stale_group(bench: Bench, trainer: Trainer, into: dict[str, Any]) -> None:
    """The workers leave a group the router still records although the trainer left it.

    The client's own clean-up after the failed sync (``/destroy_weights_update_group``) was refused while
    the journal entry was pending, so the survivors still hold the old group and would refuse the next
    sync's group init of the same name, while the restarted worker waited out its join. Sent once the
    router sees the restarted process (sent to the dead one, it fails and fences again)."""
    from router.contract.weight_sync import DEFAULT_GROUP_NAME

    if trainer.client.get_world_size().group(DEFAULT_GROUP_NAME) is None:
        return
    try:
        trainer.client.destroy_weights_update_group()
        into["stale_group_left"] = True
    except Exception as exc:
        into["stale_group_left"] = str(exc)[:160]
        after: dict[str, Any] = {}
        operator(bench, trainer, after)
        into["after_stale_group_leave"] = after


def until(cond: Callable[[], bool], bound_s: float, what: str, every_s: float = 0.05) -> float:
    """Poll ``cond`` until it holds; the seconds it took. Raises TimeoutError past ``bound_s``."""
    start = time.monotonic()
    while time.monotonic() - start < bound_s:
        if cond():
            return time.monotonic() - start
        time.sleep(every_s)
    raise TimeoutError(f"{what}: not within {bound_s:g} s")


def kill_group(proc: ManagedProcess) -> None:
    """SIGKILL the process group without waiting for it (the trainer's broadcast goes on at once)."""
    if proc.proc is not None:
        try:
            os.killpg(proc.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _received(worker: Worker) -> bool:
    """The worker's receive loop has every bucket (``/health``'s ``receive``)."""
    try:
        status, body = http_json("GET", worker.url + "/health", timeout=2)
    except OSError:
        return False
    return status == 200 and isinstance(body, dict) and body.get("receive") in ("staged", "done")


class Trainer:
    """Rank 0 of the weight-update group, syncing through the router (``RouterClient.sync_weights``)."""

    def __init__(self, bench: Bench, bucket_bytes: int, timeout_s: float):
        import torch

        from router.trainer import BucketPlan, GroupSpec, RouterClient, TrainerWeightSender
        from worker.model.checkpoint import read_checkpoint

        self.torch = torch
        self.client = RouterClient(bench.router_url, admin_key=KEY)
        self.tensors = {n: t.clone() for n, t in read_checkpoint(bench.boot, torch.float32)}
        self.plan = BucketPlan.from_named_tensors(self.tensors, budget_bytes=bucket_bytes)
        self.timeout_s = timeout_s
        port = free_port()
        self.sender = TrainerWeightSender(master_port=port, world_size=len(bench.workers) + 1, timeout_s=timeout_s)
        self.group = GroupSpec(
            master_address="127.0.0.1",
            master_port=port,
            join=self._join,
            leave=self.sender.close,
            timeout_s=timeout_s,
        )
        self.step = 0

    def _join(self, world_size: int) -> None:
        self.sender.join(cancel=self.group.cancel, world_size=world_size)

    def sync(self, before_bucket: Callable[[int], None] = lambda i: None) -> dict[str, Any]:
        """One sync of new weights; ``before_bucket(i)`` runs before bucket ``i`` is sent (``i == n``: after
        the last, before complete). Returns what happened; never raises a :class:`SyncError`."""
        from router.trainer import BucketPlan, SyncError, sent_checksum

        self.step += 1
        with self.torch.no_grad():
            for t in self.tensors.values():
                t.add_(0.001)
        expected = sent_checksum(self.tensors.items())
        n = len(self.plan.buckets)

        def broadcast(i: int) -> None:
            before_bucket(i)
            self.sender.send(BucketPlan((self.plan.buckets[i],), self.plan.budget_bytes), self.tensors)
            if i == n - 1:
                before_bucket(n)

        version = f"step-{self.step}"
        start = time.monotonic()
        try:
            report = self.client.sync_weights(
                buckets=self.plan.metadata(),
                broadcast=broadcast,
                group=self.group,
                weight_version=version,
                expected_checksum=expected,
                timeout_s=self.timeout_s,
            )
        except SyncError as exc:
            failed = {"ok": False, "stage": exc.stage, "error": str(exc)[:300], "recovery": exc.recovery}
            return {**self._ended(version, start), **failed}
        return {
            **self._ended(version, start),
            "ok": True,
            "stages": report.stage_seconds,
            "group_rebuilt": report.group_rebuilt,
            "matches_expected": report.matches_expected,
        }

    @staticmethod
    def _ended(version: str, start: float) -> dict[str, Any]:
        """When a sync returned, and how long it took (one clock read for both)."""
        returned = time.monotonic()
        return {"version": version, "returned": returned, "seconds": returned - start}

    def close(self) -> None:
        self.sender.close()


def faulted_round(bench: Bench, trainer: Trainer, victim: Worker, point: str, rejoin_bound_s: float) -> dict[str, Any]:
    n = len(trainer.plan.buckets)
    kill_before = n // 2 if point == "transfer" else n
    killed: dict[str, float] = {}

    def before_bucket(i: int) -> None:
        if i == kill_before and not killed:
            if point == "complete":
                # gloo relays a broadcast through receivers: the trainer's last send returning does not mean
                # every worker has the last bucket. Wait (bounded) until every receive loop is finished.
                until(lambda: all(_received(w) for w in bench.workers), 10, "every worker received every bucket")
            kill_group(victim.proc)
            killed["at"] = time.monotonic()

    old_version = bench.fleet_version()
    ranks = {w.url: w.rank_offset for w in trainer.client.get_world_size().workers}
    result = trainer.sync(before_bucket)
    if "at" not in killed:
        raise RuntimeError(f"the sync ended before the kill point ({point}): {result}")
    resolve_s = result["returned"] - killed["at"]
    if victim.proc.proc is not None:
        victim.proc.proc.wait(timeout=10)

    # What the fault left: who holds what, who is fenced, what the journal holds.
    views = bench.views()
    fleet = bench.fleet_version()
    survivors = [v for url, v in views.items() if url != victim.url]
    _, journal = bench.admin("GET", "/weight_update_journal")
    pending = (journal or {}).get("pending") or {}
    outcome = {
        "sync_ok": result["ok"],
        "failed_stage": result.get("stage"),
        "sync_error": result.get("error"),
        "fleet_version": fleet,
        "committed_on_survivors": fleet == result["version"]
        and all(v.get("weight_version") == result["version"] for v in survivors),
        "survivors_routable": sum(_routable(v) for v in survivors),
        "fenced": sorted(url.rsplit(":", 1)[1] for url, v in views.items() if v["disabled"]),
        "victim_fenced": views[victim.url]["disabled"],
        "journal": pending.get("state"),
        "client_recovery": {k: v[:100] for k, v in (result.get("recovery") or {}).items()},
    }

    # The operator vouches for the fleet as it is (the journal names the victim, and the survivors when the
    # update left them partial), and the trainer continues generation, which a failed sync leaves paused.
    operator(bench, trainer, outcome)

    # (b) the killed worker again, on its port, from its boot checkpoint.
    restarted = time.monotonic()
    old_instance = views[victim.url].get("instance_id")
    victim.proc = bench.launch_worker(victim.port)
    marks: dict[str, float] = {}
    retries: list[dict[str, Any]] = []

    def serving() -> bool:
        if "listening" not in marks:
            try:
                if http_json("GET", victim.url + "/health", timeout=1)[0] == 200:
                    marks["listening"] = time.monotonic()
            except OSError:
                pass
        view = bench.views().get(victim.url)
        if view is None:
            return False
        if "seen" not in marks and view["health"] == "healthy" and view.get("instance_id") != old_instance:
            marks["seen"] = time.monotonic()
        fleet_now = bench.fleet_version()
        if not _routable(view) or view.get("weight_version") != fleet_now:
            return False
        try:
            status, body = http_json("GET", victim.url + "/get_weight_version", headers=HEADERS, timeout=2)
        except OSError:
            return False
        return status == 200 and isinstance(body, dict) and body.get("weight_version") == fleet_now

    def recovered() -> bool:
        if serving():
            return True
        if "seen" not in marks:
            return False
        if "left" not in marks:
            leave_stale_group(bench, trainer, outcome)
            marks["left"] = time.monotonic()
        # No worker holds the fleet's weights whole (a streaming update broke off on every survivor): no
        # catch-up can serve them, so the trainer syncs again, once the router sees the new process.
        holders = [v for url, v in bench.views().items() if url != victim.url and _routable(v)]
        if not holders and len(retries) < 3:
            again = trainer.sync()
            retries.append({k: again.get(k) for k in ("ok", "seconds", "stage", "error")})
            if not again["ok"]:
                operator(bench, trainer, {})
        return False

    try:
        rejoin_s: float | None = until(recovered, bench.left(rejoin_bound_s), "restarted worker serving", 0.1)
    except TimeoutError:
        rejoin_s = None
        outcome["victim_view"] = bench.views().get(victim.url)
    seen_s = marks["seen"] - restarted if "seen" in marks else None
    listening_s = marks["listening"] - restarted if "listening" in marks else None

    # The whole fleet back on the trainer's weights (the group rebuilt for the new process).
    after = trainer.sync()
    return {
        "kill_at": point,
        "victim": victim.port,
        "victim_rank": ranks.get(victim.url),
        "old_version": old_version,
        "resolve_s": round(resolve_s, 3),
        "sync_failed_after_s": round(result["seconds"], 3),
        **outcome,
        "rejoin_s": None if rejoin_s is None else round(rejoin_s, 3),
        "rejoin_listening_s": None if listening_s is None else round(listening_s, 3),
        "rejoin_seen_by_router_s": None if seen_s is None else round(seen_s, 3),
        "rejoin_by": ("the trainer's next sync" if retries else "the router's catch-up") if rejoin_s else None,
        "trainer_retries": retries,
        "next_sync": {
            "ok": after["ok"],
            "seconds": round(after["seconds"], 3),
            "group_rebuilt": after.get("group_rebuilt"),
            "matches_expected": after.get("matches_expected"),
            "error": after.get("error"),
        },
    }


def _p50_max(values: list[float]) -> tuple[float, float]:
    return statistics.median(values), max(values)


def summary(rows: list[dict[str, Any]], sync_s: float) -> tuple[str, bool]:
    resolve_target = max(RESOLVE_FLOOR_S, 2 * sync_s)
    lines = [
        f"fault-free sync (median): {sync_s:.3f} s -> resolve target max({RESOLVE_FLOOR_S:g} s, 2 x sync) = "
        f"{resolve_target:.3f} s; rejoin target {REJOIN_TARGET_S:g} s",
        "| kill at | faults | (a) resolve p50 / max (s) | met | (b) rejoin p50 / max (s) | met | outcome |",
        "|---|---|---|---|---|---|---|",
    ]
    all_met = True
    for point in sorted({r["kill_at"] for r in rows}, key=KILL_POINTS.index):
        mine = [r for r in rows if r["kill_at"] == point]
        resolve = [r["resolve_s"] for r in mine]
        rejoin = [r["rejoin_s"] for r in mine if r["rejoin_s"] is not None]
        r50, rmax = _p50_max(resolve)
        resolve_met = rmax <= resolve_target
        if len(rejoin) == len(mine):
            j50, jmax = _p50_max(rejoin)
            rejoin_met = jmax <= REJOIN_TARGET_S
            rejoin_cell = f"{j50:.2f} / {jmax:.2f}"
        else:
            rejoin_met, rejoin_cell = False, f"{len(mine) - len(rejoin)} of {len(mine)} never served"
        all_met = all_met and resolve_met and rejoin_met
        committed = sum(r["committed_on_survivors"] for r in mine)
        outcome = f"{committed} of {len(mine)} committed on the survivors, the victim fenced in " + str(
            sum(r["victim_fenced"] for r in mine)
        )
        lines.append(
            f"| {point} | {len(mine)} | {r50:.2f} / {rmax:.2f} | {'yes' if resolve_met else 'NO'} | {rejoin_cell} | "
            f"{'yes' if rejoin_met else 'NO'} | {outcome} |"
        )
    return "\n".join(lines), all_met


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="rounds; each kills once per --kill-at point")
    p.add_argument("--kill-at", default=",".join(KILL_POINTS), help="comma-separated: transfer, complete")
    p.add_argument("--reference-syncs", type=int, default=3, help="fault-free syncs whose median is the sync time")
    p.add_argument("--bucket-kib", type=int, default=64, help="bucket budget (the tiny checkpoint in several buckets)")
    p.add_argument("--sync-timeout-s", type=float, default=60.0, help="the sync's timeout_s (receive window, group)")
    p.add_argument("--health-check-interval-s", type=float, default=1.0, help="the router's probe interval")
    p.add_argument("--rejoin-bound-s", type=float, default=120.0, help="give up on one restarted worker after this")
    p.add_argument("--budget-s", type=float, default=900.0, help="the whole run's bound")
    args = p.parse_args()
    points = [x.strip() for x in args.kill_at.split(",") if x.strip()]
    if not points or any(x not in KILL_POINTS for x in points):
        p.error(f"--kill-at takes {', '.join(KILL_POINTS)}")
    logging.getLogger("router.trainer").setLevel(logging.ERROR)  # a failed sync's warning: the row says it
    print(machine_line(), flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        from worker.model.tiny import write_tiny_checkpoint

        root = Path(tmp)
        bench = Bench(root, write_tiny_checkpoint(root / "boot"), time.monotonic() + args.budget_s,
                      args.health_check_interval_s)  # fmt: skip
        trainer: Trainer | None = None
        sync_s = float("nan")
        try:
            started = time.monotonic()
            bench.start_fleet(args.workers)
            print(f"# {args.workers} workers and the router ready in {time.monotonic() - started:.1f} s", flush=True)
            trainer = Trainer(bench, args.bucket_kib * 1024, args.sync_timeout_s)
            first = trainer.sync()
            if not first["ok"]:
                raise RuntimeError(f"the first sync failed: {first}")
            reference = []
            for _ in range(args.reference_syncs):
                done = trainer.sync()
                if not done["ok"]:
                    raise RuntimeError(f"a fault-free sync failed: {done}")
                reference.append(done["seconds"])
            sync_s = statistics.median(reference)
            print(
                f"# {len(trainer.plan.buckets)} buckets; group init + first sync {first['seconds']:.3f} s; "
                f"fault-free syncs {[round(s, 3) for s in reference]} s",
                flush=True,
            )
            k = 0
            for r in range(args.rounds):
                for point in points:
                    victim = bench.workers[k % len(bench.workers)]
                    k += 1
                    row = {"round": r + 1, **faulted_round(bench, trainer, victim, point, args.rejoin_bound_s)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        except OutOfTime as exc:
            print(f"# stopped: {exc}", flush=True)
        finally:
            if trainer is not None:
                trainer.close()
            bench.stop()
    if not rows:
        print("# no fault was measured")
        return 1
    table, met = summary(rows, sync_s)
    print(machine_line())
    print(table)
    print(f"# targets {'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
