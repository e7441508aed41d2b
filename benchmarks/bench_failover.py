"""Failover time of a replicated router (``omni-router --leader-election --state-store k8s``).

    .venv/bin/python -m benchmarks.bench_failover                       # 5 rounds each, lease 3 / 2 / 0.5 s
    .venv/bin/python -m benchmarks.bench_failover --rounds 3 --lease-duration-s 15 --renew-deadline-s 10 \\
        --retry-period-s 2                                              # the router's defaults

The Kubernetes API server here is a STAND-IN (``tests._k8s_standin``: Leases and ConfigMaps with
resourceVersion compare-and-swap, over plain HTTP on 127.0.0.1), not a real one: its answers take
about a millisecond, where a real API server's take a few. Everything else is real: two
``omni-router`` processes, each with its own kubeconfig and ``POD_NAME``, and their lightkube
clients. No worker is needed (the admin call measured is ``GET /workers``).

Each round stops the leader, then asks the standby ``GET /workers`` every 10 ms and records the time
from the stop to its first 200: the standby has taken the Lease, read the journal, the fleet's weights
and the groups from their ConfigMaps, and opened its gate. Two ways to stop it:

- ``kill``: SIGKILL (a node lost): nobody releases the Lease, so the standby waits out a whole lease
  duration from when it last saw it renewed; expect about duration + up to one retry period;
- ``term``: SIGTERM (a rollout, a drain): the leader drains (nothing in flight here), releases the
  Lease, and the standby takes it at its next try; expect about one retry period.

With ``--data-plane-processes N`` (N > 1) each replica runs a control process and N data planes,
and two more ways are measured:

- ``control``: SIGKILL of the leader's control process alone; its data planes lose their link and
  exit by themselves, and the Lease is not released: like ``kill``;
- ``plane``: SIGKILL of one of the leader's data planes; no failover: printed are the calls that
  failed (out of those sent every 10 ms) and how long until the control process had started it
  again and it answered.

The stopped replica is started again as a standby, and the next round stops the other one. Printed:
every round, the median and the maximum per way, and the lease settings. Every process started here
listens on 127.0.0.1 and is stopped at the end; every wait is bounded.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from demo.launch import ManagedProcess, cli, free_port, http_json
from tests._k8s_standin import StandInApiServer

ADMIN_KEY = "bench-failover-admin-key"
NAMESPACE = "omni"


class Replica:
    """One ``omni-router`` replica: a fixed port, its own kubeconfig (token) and pod name."""

    def __init__(self, name: str, api: StandInApiServer, root: Path, lease: list[str], data_planes: int = 1):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        kubeconfig = api.write_kubeconfig(root / f"kubeconfig-{name}", namespace=NAMESPACE, token=f"token-{name}")
        no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1"]))
        self.env = {"KUBECONFIG": str(kubeconfig), "NO_PROXY": no_proxy, "POD_NAME": name}
        self.argv = [
            cli("omni-router"),
            *("--host", "127.0.0.1", "--port", str(self.port), "--admin-api-key", ADMIN_KEY),
            *("--data-plane-processes", str(data_planes), "--state-store", "k8s", "--leader-election", *lease),
        ]
        self.proc: ManagedProcess | None = None

    def start(self) -> None:
        self.proc = ManagedProcess(f"bench-{self.name}", self.argv, env=self.env).start()
        self.proc.wait_http_ready(self.url + "/liveness", timeout=60)

    def role(self) -> str | None:
        try:
            _, body = http_json("GET", self.url + "/leader", timeout=2)
        except OSError:
            return None
        return body.get("role") if isinstance(body, dict) else None

    def accepts_admin(self) -> bool:
        try:
            status, _ = http_json(
                "GET", self.url + "/workers", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=2
            )
        except OSError:
            return False
        return status == 200

    def data_planes(self) -> set[int]:
        """The control process's children that run: its data planes."""
        assert self.proc is not None and self.proc.proc is not None
        pids: set[int] = set()
        for task in Path(f"/proc/{self.proc.proc.pid}/task").iterdir():
            pids.update(int(p) for p in (task / "children").read_text().split())
        return {pid for pid in pids if _running(pid)}

    def stop(self, how: str) -> None:
        assert self.proc is not None and self.proc.proc is not None
        if how == "kill":  # the whole pod: every process
            self.proc.kill()
        elif how == "control":  # the control process alone: its data planes notice and leave
            os.kill(self.proc.proc.pid, signal.SIGKILL)
            self.proc.proc.wait(timeout=60)
        else:  # SIGTERM to the container's first process, as Kubernetes sends it
            os.kill(self.proc.proc.pid, signal.SIGTERM)
            self.proc.proc.wait(timeout=60)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise TimeoutError(f"{what} not within {timeout_s}s")


def one_round(leader: Replica, standby: Replica, how: str, bound_s: float) -> float:
    """Stop ``leader``; seconds until ``standby`` accepts an admin call. Then ``leader`` comes back as a standby."""
    stopped = time.monotonic()
    leader.stop(how)
    wait_until(standby.accepts_admin, bound_s, f"{standby.name} accepting admin calls")
    took = time.monotonic() - stopped
    leader.start()
    wait_until(lambda: leader.role() == "standby", 30, f"{leader.name} standing by")
    return took


def plane_round(leader: Replica, bound_s: float) -> tuple[int, int, float]:
    """SIGKILL one of ``leader``'s data planes; (calls failed, calls sent, seconds until it was back)."""
    before = leader.data_planes()
    victim = min(before)
    sent = failed = 0
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    back: float | None = None
    while time.monotonic() - killed < bound_s:
        sent += 1
        failed += not leader.accepts_admin()
        now = leader.data_planes() - {victim}
        if back is None and len(now) == len(before):
            back = time.monotonic() - killed
        if back is not None and time.monotonic() - killed > back + 1:
            break  # a second of calls with every data plane back
        time.sleep(0.01)
    if back is None:
        raise TimeoutError(f"data plane {victim} not started again within {bound_s}s")
    return failed, sent, back


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="rounds per way of stopping the leader")
    p.add_argument("--lease-duration-s", type=float, default=3.0)
    p.add_argument("--renew-deadline-s", type=float, default=2.0)
    p.add_argument("--retry-period-s", type=float, default=0.5)
    p.add_argument("--data-plane-processes", type=int, default=1, help="per replica (2 or more: also control, plane)")
    p.add_argument("--ways", nargs="+", choices=("kill", "term", "control", "plane"), default=None)
    args = p.parse_args()
    if args.ways is None:
        args.ways = ["kill", "term"] + (["control", "plane"] if args.data_plane_processes > 1 else [])
    lease = [
        *("--leader-lease-duration-s", str(args.lease_duration_s)),
        *("--leader-renew-deadline-s", str(args.renew_deadline_s)),
        *("--leader-retry-period-s", str(args.retry_period_s)),
    ]
    bound_s = 3 * args.lease_duration_s + 30
    print(
        f"lease duration {args.lease_duration_s:g} s, renew deadline {args.renew_deadline_s:g} s, "
        f"retry period {args.retry_period_s:g} s; {args.data_plane_processes} data plane(s) per replica; "
        "stand-in API server on 127.0.0.1"
    )
    results: dict[str, list[float]] = {how: [] for how in args.ways}
    with StandInApiServer() as api, tempfile.TemporaryDirectory(prefix="bench-failover-") as tmp:
        replicas = [
            Replica(name, api, Path(tmp), lease, args.data_plane_processes) for name in ("router-a", "router-b")
        ]
        try:
            replicas[0].start()
            wait_until(lambda: replicas[0].role() == "leader", bound_s, "a first leader")
            replicas[1].start()
            wait_until(lambda: replicas[1].role() == "standby", 30, "a standby")
            for how in args.ways:
                for i in range(args.rounds):
                    leader, standby = (replicas[0], replicas[1]) if replicas[0].role() == "leader" else replicas[::-1]
                    if how == "plane":
                        failed, sent, back = plane_round(leader, bound_s)
                        results[how].append(back)
                        print(
                            f"plane round {i + 1}: a data plane of {leader.name} killed -> {failed} of {sent} "
                            f"admin calls failed; it was started again after {back:.2f} s"
                        )
                        continue
                    took = one_round(leader, standby, how, bound_s)
                    results[how].append(took)
                    print(
                        f"{how:>7} round {i + 1}: {leader.name} stopped -> {standby.name} accepts admin calls after {took:.2f} s"
                    )
        finally:
            for replica in replicas:
                replica.close()
    for how, times in results.items():
        if times:
            print(f"{how:>7}: median {statistics.median(times):.2f} s, max {max(times):.2f} s over {len(times)} rounds")


if __name__ == "__main__":
    main()
