"""A soak: steady generation through a replicated router while faults and admin calls land at random.

    .venv/bin/python -m benchmarks.soak                      # 30 minutes
    .venv/bin/python -m benchmarks.soak --minutes 3          # the short form CI runs (make soak-short)

Real parts: three ``omni-worker`` processes on a tiny checkpoint, two ``omni-router`` replicas
(``--leader-election --state-store k8s``, two data planes each) and their lightkube clients. The
Kubernetes API server is the project's STAND-IN (``tests._k8s_standin``: Leases and ConfigMaps with
compare-and-swap on 127.0.0.1). The client plays the Service in front of the replicas: it sends to
the replica it believes leads and, when an answer proves nothing ran there (a standby's 503, a
refused or reset connection, a 502/503 from the router), sends the request again, to the other
replica after a standby's answer, within :data:`REQUEST_BUDGET_S`.

After a fault-free warm-up (its p99 is the reference), one action every ``--action-every-s``, drawn
with a seeded random generator: SIGSTOP a worker for 2–6 s (SIGCONT from a timer, so admin calls
overlap the stall), SIGKILL a worker and start it again 2 s later on its port, update the fleet from
disk to a new ``weight_version``, pause (retract) and continue generation, flush the cache, SIGKILL
the leader (every process of its pod) and start it again as the standby, and SIGKILL a worker in the
middle of an update from disk (once the router fenced it for the update) and start it again at once on
its port. After an admin call the soak acts as the operator: a failed update left in the journal is
resolved (counted).

Counted, and the run fails (exit 1) unless the first three are 0 (and see the last):

- requests lost: a request with no 200 within its budget;
- versions served that the policy forbids: the router's default policy serves only the fleet's
  latest weights, so a request sent after an update answered must carry that update's label or a
  later one;
- workers left paused, fenced or pending without a reason in ``GET /workers`` once the fleet settles;
- requests slower than twice the warm-up's p99 (reported, with the p50 and p99 of the whole run);
- for each kill mid-update, the seconds from the kill until the update answered (target: max(5 s,
  2 x the run's median fault-free update)) and from the restart until the worker serves the fleet's
  weights (routed by the router, its ``weight_version`` the fleet's; target: 30 s). Reported against
  the targets; the run fails on an update with no answer within :data:`RESOLVE_BOUND_S` or a restarted
  worker not serving within :data:`REJOIN_BOUND_S`.

Every process listens on 127.0.0.1 and is stopped at the end; every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from demo.launch import ManagedProcess, cli, free_port, http_json
from tests._k8s_standin import StandInApiServer
from tests._router_fixtures import make_tiny_checkpoint

ADMIN_KEY = "soak-admin-key"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
NAMESPACE = "omni"
#: A request is lost when it has no 200 within this many seconds of its first send.
REQUEST_BUDGET_S = 60.0
#: Lease 3 s, renew deadline 2 s, retry period 0.5 s: a failover within seconds.
LEASE = ["--leader-lease-duration-s", "3", "--leader-renew-deadline-s", "2", "--leader-retry-period-s", "0.5"]
ACTIONS = ("stall", "kill_worker", "update", "pause", "flush", "kill_leader", "kill_mid_update")
#: llm-d's target for an engine back in service after a restart (the restarted worker serving the fleet's weights).
REJOIN_TARGET_S = 30.0
#: An update resolves within max(RESOLVE_FLOOR_S, 2 x the median fault-free update of the run).
RESOLVE_FLOOR_S = 5.0
#: Past these a kill mid-update counts as a hang (the update) or a worker that never rejoined (the restart).
RESOLVE_BOUND_S = 120.0
REJOIN_BOUND_S = 90.0


@dataclass
class Record:
    sent: float
    latency: float
    ok: bool
    version: str | None
    attempts: int
    served_by: str = ""
    """Which replica, worker and process answered, and the version the router stamped (for a report)."""


@dataclass
class Fleet:
    root: Path
    api: StandInApiServer
    boot: Path
    other: Path
    workers: list[tuple[ManagedProcess, str]] = field(default_factory=list)
    routers: list[tuple[ManagedProcess, str, list[str]]] = field(default_factory=list)

    def launch_worker(self, port: int) -> tuple[ManagedProcess, str]:
        argv = [cli("omni-worker"), "--model-path", str(self.boot), "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--admin-api-key", ADMIN_KEY, "--num-threads", "1"]
        return ManagedProcess(f"soak-worker-{port}", argv).start(), f"http://127.0.0.1:{port}"

    def start_worker(self, port: int) -> tuple[ManagedProcess, str]:
        proc, url = self.launch_worker(port)
        proc.wait_http_ready(url + "/health", timeout=120)
        return proc, url

    def start_router(self, name: str, port: int) -> tuple[ManagedProcess, str, list[str]]:
        kubeconfig = self.api.write_kubeconfig(self.root / f"kc-{name}", namespace=NAMESPACE, token=f"token-{name}")
        no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1"]))
        env = {"KUBECONFIG": str(kubeconfig), "NO_PROXY": no_proxy, "POD_NAME": name}
        argv = [cli("omni-router"), "--host", "127.0.0.1", "--port", str(port), "--admin-api-key", ADMIN_KEY]
        argv += ["--worker-urls", *(url for _, url in self.workers), "--health-check-interval-s", "0.5"]
        argv += ["--data-plane-processes", "2", "--state-store", "k8s", "--leader-election", *LEASE]
        proc = ManagedProcess(f"soak-{name}", argv, env=env).start()
        url = f"http://127.0.0.1:{port}"
        proc.wait_http_ready(url + "/liveness", timeout=60)
        return proc, url, [name]

    def leader(self) -> int | None:
        for i, (_, url, _) in enumerate(self.routers):
            try:
                if http_json("GET", url + "/leader", timeout=5)[0] == 200:
                    return i
            except OSError:
                continue
        return None


class Service:
    """The Kubernetes Service in front of the replicas, as a client sees it (see the module docstring)."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self.current = 0
        self._lock = threading.Lock()

    def generate(self) -> Record:
        sent = time.monotonic()
        body = json.dumps({"text": "soak", "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}).encode()
        attempts = 0
        while time.monotonic() - sent < REQUEST_BUDGET_S:
            attempts += 1
            with self._lock:
                index = self.current
            req = urllib.request.Request(
                self.urls[index] + "/generate", data=body, headers={"Content-Type": "application/json"}
            )
            standby = False
            try:
                with urllib.request.urlopen(req, timeout=REQUEST_BUDGET_S) as resp:
                    answer = json.loads(resp.read())
                    version = answer.get("meta_info", {}).get("weight_version")
                    served = (
                        f"router {index}, worker {resp.headers.get('X-Omni-Worker')} "
                        f"(process {resp.headers.get('X-Omni-Instance')}), stamped {resp.headers.get('X-Weight-Version')}"
                    )
                    return Record(sent, time.monotonic() - sent, True, version, attempts, served)
            except urllib.error.HTTPError as err:
                err.read()
                if err.code < 500:  # the router refused the request itself: sending it again changes nothing
                    return Record(sent, time.monotonic() - sent, False, None, attempts)
                standby = err.headers.get("X-Omni-Router-Role") == "standby"
            except OSError:
                standby = True  # refused or reset: that replica is gone; the other may lead
            if standby:
                with self._lock:
                    if self.current == index:
                        self.current = 1 - index
            time.sleep(0.1)
        return Record(sent, time.monotonic() - sent, False, None, attempts)


@dataclass
class Recovery:
    """One worker SIGKILLed in the middle of a fleet update, then started again on its port."""

    resolve_s: float | None
    """From the kill until the update answered (``None``: no answer within :data:`RESOLVE_BOUND_S`)."""
    status: int
    """The update's answer: 502 when the kill failed the victim's part, 200 when it came too late to."""
    rejoin_s: float | None
    """From the restart until the router routes to it and it reports the fleet's weight_version
    (``None``: not within :data:`REJOIN_BOUND_S`)."""


@dataclass
class Chaos:
    fleet: Fleet
    rng: random.Random
    versions: list[tuple[float, str]] = field(default_factory=list)
    """(when the update answered, the fleet's label after it), in order; labels are ``v<step>``."""
    counts: dict[str, int] = field(default_factory=dict)
    resolved: int = 0
    timers: list[threading.Timer] = field(default_factory=list)
    update_s: list[float] = field(default_factory=list)
    """Seconds of each update that answered 200 without a fault: the reference of the resolve target."""
    recoveries: list[Recovery] = field(default_factory=list)
    answered: float = 0.0
    """When the last update answered."""

    def admin(self, method: str, path: str, body: Any = None, timeout: float = 120) -> tuple[int, Any]:
        index = self.fleet.leader()
        if index is None:
            return 503, None
        try:
            return http_json(method, self.fleet.routers[index][1] + path, body, headers=AUTH, timeout=timeout)
        except OSError as exc:
            return 599, repr(exc)

    def act(self, action: str, step: int) -> None:
        self.counts[action] = self.counts.get(action, 0) + 1
        workers = self.fleet.workers
        if action == "stall":
            proc = self.rng.choice(workers)[0]
            if proc.alive and proc.proc is not None:
                os.kill(proc.proc.pid, signal.SIGSTOP)
                timer = threading.Timer(self.rng.uniform(2, 6), _cont, args=(proc,))
                timer.start()
                self.timers.append(timer)
        elif action == "kill_worker":
            i = self.rng.randrange(len(workers))
            proc, url = workers[i]
            _cont(proc)  # a stopped process dies on SIGKILL too; its timer finds it gone
            proc.kill()
            time.sleep(2)
            workers[i] = self.fleet.start_worker(int(url.rsplit(":", 1)[1]))
        elif action == "update":
            started = time.monotonic()
            if self.update(step) == 200:
                self.update_s.append(self.answered - started)
        elif action == "kill_mid_update":
            self.kill_mid_update(step)
        elif action == "pause":
            self.admin("POST", "/pause_generation", {"mode": "retract"})
            time.sleep(self.rng.uniform(0.2, 1.0))
            self.admin("POST", "/continue_generation", {})
            self._after_admin()
        elif action == "flush":
            self.admin("POST", "/flush_cache", {})
            self._after_admin()
        elif action == "kill_leader":
            index = self.fleet.leader()
            if index is not None:
                proc, url, (name,) = self.fleet.routers[index]
                proc.kill()
                self.fleet.routers[index] = self.fleet.start_router(name, int(url.rsplit(":", 1)[1]))

    def update(self, step: int, during: Any = None) -> int:
        """Update the fleet from disk to ``v<step>`` (``during()`` runs while the call is in flight); its status."""
        label = f"v{step}"
        model = self.fleet.other if self.rng.random() < 0.5 else self.fleet.boot
        body = {"model_path": str(model), "weight_version": label}
        if during is None:
            status, _ = self.admin("POST", "/update_weights_from_disk", body)
        else:
            answer: dict[str, int] = {}
            call = threading.Thread(
                target=lambda: answer.update(status=self.admin("POST", "/update_weights_from_disk", body)[0]),
                daemon=True,
            )
            call.start()
            during()
            call.join(RESOLVE_BOUND_S)
            status = answer.get("status", 0)
        answered = self.answered = time.monotonic()
        self._after_admin()
        # A partly failed update moves the fleet too (its holders): the label is read, not assumed; the
        # read is tried again (a busy leader may not answer the soak's own /leader probe at once).
        for _ in range(10):
            got, fleet = self.admin("GET", "/fleet/versions")
            if got == 200 and isinstance(fleet, dict):
                now = fleet.get("weight_version") or ""
                if not self.versions or self.versions[-1][1] != now:
                    self.versions.append((answered, now))
                return status
            time.sleep(1)
        if status == 200:  # the fleet took it whole
            self.versions.append((answered, label))
        return status

    def kill_mid_update(self, step: int) -> None:
        """SIGKILL a worker once the router has fenced it for an update from disk; time the update's answer
        from the kill, then start the worker again and time it until it serves the fleet's weights."""
        workers = self.fleet.workers
        i = self.rng.randrange(len(workers))
        proc, url = workers[i]
        killed: dict[str, float] = {}

        def kill_once_fenced() -> None:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not killed:
                status, body = self.admin("GET", "/workers", timeout=5)
                mine = [w for w in body["workers"] if w["url"] == url] if status == 200 else []
                if mine and mine[0]["disabled"]:
                    break
                time.sleep(0.01)
            killed["at"] = time.monotonic()  # before the kill: proc.kill() returns once the process is reaped
            _cont(proc)
            proc.kill()

        status = self.update(step, during=kill_once_fenced)
        # No answer, or none but the client's own timeout (599), is an update that hung.
        resolve_s = max(0.0, self.answered - killed["at"]) if status not in (0, 599) else None
        restarted = time.monotonic()
        workers[i] = self.fleet.launch_worker(int(url.rsplit(":", 1)[1]))
        rejoin_s: float | None = None
        while time.monotonic() - restarted < REJOIN_BOUND_S:
            if self._serves_fleet_weights(url):
                rejoin_s = time.monotonic() - restarted
                break
            time.sleep(0.2)
        self.recoveries.append(Recovery(resolve_s, status, rejoin_s))

    def _serves_fleet_weights(self, url: str) -> bool:
        """The router routes to the worker at ``url`` and the worker reports the fleet's weight_version."""
        got, fleet = self.admin("GET", "/fleet/versions", timeout=5)
        status, body = self.admin("GET", "/workers", timeout=5)
        if got != 200 or status != 200 or not isinstance(fleet, dict) or not isinstance(body, dict):
            return False
        mine = [w for w in body["workers"] if w["url"] == url]
        if not mine or out_of_rotation(mine[0]) or mine[0].get("weight_version") != fleet.get("weight_version"):
            return False
        try:
            own, version = http_json("GET", url + "/get_weight_version", headers=AUTH, timeout=5)
        except OSError:
            return False
        return own == 200 and isinstance(version, dict) and version.get("weight_version") == fleet["weight_version"]

    def _after_admin(self) -> None:
        """The operator: a failed update left in the journal is resolved (the fleet is vouched for as it is)."""
        status, journal = self.admin("GET", "/weight_update_journal")
        pending = status == 200 and isinstance(journal, dict) and journal.get("pending")
        if pending and self.admin("POST", "/weight_update_journal/resolve", {"acknowledge": True})[0] == 200:
            self.resolved += 1


def _cont(proc: ManagedProcess) -> None:
    if proc.alive and proc.proc is not None:
        try:
            os.kill(proc.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def step_of(label: str | None) -> int:
    """The soak's labels are ``v<step>``; the boot weights (``default``) come before every one."""
    return int(label[1:]) if label and label.startswith("v") and label[1:].isdigit() else 0


def out_of_rotation(worker: dict[str, Any]) -> bool:
    return bool(worker["disabled"] or worker["health"] != "healthy" or worker.get("pending") or worker.get("paused"))


def unexplained(workers: list[dict[str, Any]], journal: dict[str, Any]) -> list[str]:
    """Workers out of rotation with no reason in ``GET /workers`` (or, for a fenced one, in the journal)."""
    named = {t["id"] for t in (journal.get("pending") or {}).get("targets", [])}
    out = []
    for w in workers:
        reason = w.get("pending") or w.get("departed") or w.get("catch_up") or w["health"] != "healthy"
        if w["disabled"] and w["id"] in named:
            reason = True
        if out_of_rotation(w) and not reason:
            out.append(f"{w['id']} (disabled={w['disabled']}, paused={w.get('paused')})")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="length of the faulted phase")
    p.add_argument("--warmup-s", type=float, default=20.0, help="fault-free phase whose p99 is the reference")
    p.add_argument("--rate", type=float, default=8.0, help="generate requests per second, steady")
    p.add_argument("--action-every-s", type=float, default=6.0, help="mean seconds between actions")
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    rng = random.Random(args.seed)
    records: list[Record] = []
    with StandInApiServer() as api, tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        root = Path(tmp)
        fleet = Fleet(root, api, make_tiny_checkpoint(root / "boot", 0), make_tiny_checkpoint(root / "other", 1))
        chaos = Chaos(fleet, rng)
        pool = ThreadPoolExecutor(max_workers=32)
        try:
            fleet.workers = [fleet.start_worker(free_port()) for _ in range(3)]
            ports = [free_port(), free_port()]
            fleet.routers.append(fleet.start_router("router-a", ports[0]))
            _wait(lambda: fleet.leader() == 0, 30, "router-a leading")
            fleet.routers.append(fleet.start_router("router-b", ports[1]))
            service = Service([url for _, url, _ in fleet.routers])
            _wait(lambda: service.generate().ok, 60, "a first generation")
            started = time.monotonic()
            warm_until = started + args.warmup_s
            end = warm_until + 60 * args.minutes
            futures: list[Future[Record]] = []
            sender = threading.Thread(target=_send_steadily, args=(pool, service, args.rate, end, futures), daemon=True)
            print(f"soak: {args.minutes:g} min of faults after {args.warmup_s:g} s warm-up, {args.rate:g} req/s")
            sender.start()
            time.sleep(args.warmup_s)
            step = 0
            while time.monotonic() < end:
                step += 1
                action = rng.choice(ACTIONS)
                chaos.act(action, step)
                print(f"  {time.monotonic() - started:7.1f}s {action}", flush=True)
                time.sleep(min(max(0.0, end - time.monotonic()), rng.expovariate(1 / args.action_every_s)))
            sender.join(10)
            records = [f.result(timeout=REQUEST_BUDGET_S + 10) for f in futures]
            for timer in chaos.timers:
                timer.join(10)
            settled = _settle(chaos)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            for proc, _ in fleet.workers:
                _cont(proc)
                proc.stop()
            for proc, _, _ in fleet.routers:
                proc.stop()
    return report(records, chaos, settled, warm_until)


def _send_steadily(
    pool: ThreadPoolExecutor, service: Service, rate: float, end: float, futures: list[Future[Record]]
) -> None:
    """One request every 1/rate seconds until ``end``, whatever the answers take (they run in the pool)."""
    next_send = time.monotonic()
    while next_send < end:
        futures.append(pool.submit(service.generate))
        next_send += 1 / rate
        time.sleep(max(0.0, next_send - time.monotonic()))


def _wait(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{what} not within {timeout_s}s")


def _settle(chaos: Chaos, timeout_s: float = 90.0) -> tuple[list[str], list[str]]:
    """Wait (bounded) for every worker to be back in rotation: (those still out, those out without a reason)."""
    deadline = time.monotonic() + timeout_s
    out: list[str] = ["(no leader answered)"]
    left: list[str] = []
    while time.monotonic() < deadline:
        status, body = chaos.admin("GET", "/workers")
        _, journal = chaos.admin("GET", "/weight_update_journal")
        if status == 200 and isinstance(body, dict):
            workers = body["workers"]
            out = [w["id"] for w in workers if out_of_rotation(w)]
            left = unexplained(workers, journal if isinstance(journal, dict) else {})
            if not out:
                return [], []
        time.sleep(1)
    return out, left


def report(records: list[Record], chaos: Chaos, settled: tuple[list[str], list[str]], warm_until: float) -> int:
    still_out, unexplained_workers = settled
    lost = [r for r in records if not r.ok]
    forbidden: list[str] = []
    for r in records:
        if not r.ok:
            continue
        latest = max((step_of(label) for answered, label in chaos.versions if answered < r.sent), default=0)
        if step_of(r.version) < latest:
            forbidden.append(
                f"sent at {r.sent - warm_until:+.1f}s served {r.version} after v{latest} answered; {r.served_by}"
            )
    warm = [r.latency for r in records if r.ok and r.sent < warm_until]
    reference = statistics.quantiles(warm, n=100)[98] if len(warm) >= 20 else float("nan")
    faulted = [r for r in records if r.ok and r.sent >= warm_until]
    slow = sum(r.latency > 2 * reference for r in faulted)
    latencies = sorted(r.latency for r in records if r.ok)
    p50 = statistics.median(latencies) if latencies else float("nan")
    p99 = statistics.quantiles(latencies, n=100)[98] if len(latencies) >= 20 else float("nan")
    print(f"actions: {json.dumps(chaos.counts, sort_keys=True)}; journal entries resolved: {chaos.resolved}")
    print(f"requests: {len(records)} sent, {len(lost)} lost, {sum(r.attempts > 1 for r in records)} sent again")
    print(f"latency: p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms; warm-up p99 {reference * 1000:.0f} ms")
    print(f"slower than 2x the warm-up p99: {slow} of {len(faulted)} ({100 * slow / max(1, len(faulted)):.1f} %)")
    print(
        f"versions served that the policy forbids: {len(forbidden)} {forbidden[:10]}; fleet versions: {chaos.versions}"
    )
    print(f"workers out of rotation once settled: {still_out}; without a reason: {unexplained_workers}")
    hung, never = recovery_report(chaos)
    return 1 if lost or forbidden or unexplained_workers or hung or never else 0


def _p50_max(values: list[float]) -> str:
    return f"p50 {statistics.median(values):.3f} s, max {max(values):.3f} s" if values else "none"


def recovery_report(chaos: Chaos) -> tuple[int, int]:
    """The kills mid-update against their targets: the update resolved within max(5 s, 2 x the run's median
    fault-free update) of the kill, the restarted worker serving the fleet's weights within 30 s. Returns
    the counts that fail the run: updates with no answer within RESOLVE_BOUND_S, restarted workers not
    serving within REJOIN_BOUND_S (a target missed by less is reported, not failed: this is a loaded
    2-core machine running faults at random)."""
    rec = chaos.recoveries
    reference = statistics.median(chaos.update_s) if chaos.update_s else 0.0
    resolve_target = max(RESOLVE_FLOOR_S, 2 * reference)
    resolved = [r.resolve_s for r in rec if r.resolve_s is not None]
    rejoined = [r.rejoin_s for r in rec if r.rejoin_s is not None]
    hung, never = len(rec) - len(resolved), len(rec) - len(rejoined)
    late = sum(x > resolve_target for x in resolved)
    slow = sum(x > REJOIN_TARGET_S for x in rejoined)
    failed_part = sum(r.status not in (0, 200, 599) for r in rec)
    print(
        f"kills mid-update: {len(rec)} ({failed_part} failed the victim's part of the update); fault-free update "
        f"median {reference:.2f} s over {len(chaos.update_s)}"
    )
    print(
        f"  update answered after the kill: {_p50_max(resolved)}; target {resolve_target:.1f} s: "
        f"{'met' if not late and not hung else f'{late + hung} over'}; no answer within {RESOLVE_BOUND_S:g} s: {hung}"
    )
    print(
        f"  restarted worker serving the fleet's weights: {_p50_max(rejoined)}; target {REJOIN_TARGET_S:g} s: "
        f"{'met' if not slow and not never else f'{slow + never} over'}; never within {REJOIN_BOUND_S:g} s: {never}"
    )
    return hung, never


if __name__ == "__main__":
    raise SystemExit(main())
