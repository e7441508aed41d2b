"""Kubernetes service discovery against a local stand-in API server.

The API server is a stand-in (``tests._k8s_standin``: the pod list and watch
protocol, on loopback); everything else is real: the router process with
``--service-discovery k8s`` and its lightkube client (credentials from
``KUBECONFIG``), and two omni-workers listening on 127.0.0.2 and 127.0.0.3, the
"pod IPs". Covered: Ready pods are routed, NotReady and terminating ones leave,
a pod deleted while the watch was down is gone after the re-list, the router
keeps serving while the API server is away, a pod discovered after the fleet's
first weight update is pending, and a pod that appears while an update holds
the admin lock is registered when the update ends.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from aiohttp import web

from router.gateway import keys
from router.gateway.app import create_app
from router.gateway.config import RouterConfig
from router.gateway.fleet.registry import worker_id_for
from tests._k8s_standin import StandInApiServer
from tests._polling import until
from tests._router_fixtures import ADMIN_KEY, auth, generate_via, start_router, wait_for, workers
from tests._weight_sync_fixtures import WORKER_ARGS
from tests.procs import ManagedProcess, http_json

NS = "workers"
LABELS = {"app": "omni-worker"}
#: Bound on any discovery change reaching the router (events are pushed; re-lists back off from 0.5 s).
SETTLE_S = 30


@pytest.fixture(scope="module")
def pod_workers(worker_fleet, checkpoints) -> list[str]:
    args = ["--admin-api-key", ADMIN_KEY, *WORKER_ARGS]
    return worker_fleet(2, extra_args=args, hosts=["127.0.0.2", "127.0.0.3"], model=checkpoints["llama"]).urls


def as_pod(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    return {"ip": parts.hostname, "port": parts.port}


@pytest.fixture
def api(tmp_path: Path) -> Iterator[StandInApiServer]:
    with StandInApiServer() as srv:
        yield srv


def client_env(api: StandInApiServer, tmp_path: Path) -> dict[str, str]:
    """How an operator points the router at a cluster from a laptop: a kubeconfig (its context names the namespace)."""
    no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1"]))
    return {"KUBECONFIG": str(api.write_kubeconfig(tmp_path, namespace=NS)), "NO_PROXY": no_proxy}


@pytest.fixture
def router(api: StandInApiServer, tmp_path: Path) -> Iterator[tuple[ManagedProcess, str]]:
    # The pending rule itself: no catch-up from a peer (tests/test_router_catch_up.py covers that).
    proc, url = start_router(
        [],
        admin_key=ADMIN_KEY,
        state_dir=tmp_path / "state",
        extra_args=[
            "--service-discovery",
            "k8s",
            "--selector",
            "app=omni-worker",
            "--policy",
            "round_robin",
            "--sync-joiners",
            "off",
        ],
        env=client_env(api, tmp_path),
    )
    try:
        yield proc, url
    finally:
        proc.stop()


def discovered(url: str) -> dict[str, dict[str, Any]]:
    """Discovered workers by pod name."""
    return {w["pod"].split("/", 1)[1]: w for w in workers(url, ADMIN_KEY) if w["source"] == "discovery"}


def wait_pods(url: str, proc: ManagedProcess, names: set[str], *, healthy: bool = True) -> None:
    def done() -> bool:
        now = discovered(url)
        return set(now) == names and (not healthy or all(w["health"] == "healthy" for w in now.values()))

    wait_for(done, SETTLE_S, proc, f"discovered pods == {sorted(names)}")


def served(url: str, n: int) -> set[str]:
    out = set()
    for _ in range(n):
        status, body, worker = generate_via(url)
        assert status == 200, body
        out.add(str(worker))
    return out


def both_pods_ready(api: StandInApiServer, router: tuple[ManagedProcess, str], pod_workers: list[str]) -> None:
    """worker-a and worker-b, Ready, and registered and healthy in the router."""
    for name, url in zip(("worker-a", "worker-b"), pod_workers, strict=True):
        api.add_pod(name, namespace=NS, labels=LABELS, **as_pod(url))
    wait_pods(router[1], router[0], {"worker-a", "worker-b"})


def discovery_health(url: str) -> dict[str, Any]:
    return http_json("GET", url + "/health", timeout=10)[1]["discovery"]


def test_ready_pods_are_routed_and_notready_or_terminating_ones_leave(api, router, pod_workers) -> None:
    proc, url = router
    a, b = pod_workers
    api.add_pod("worker-a", namespace=NS, labels=LABELS, **as_pod(a))
    api.add_pod("worker-b", namespace=NS, labels=LABELS, ready=False, **as_pod(b))
    api.add_pod("other", namespace=NS, labels={"app": "something-else"}, ip="127.0.0.4", port=9)
    api.add_pod("elsewhere", namespace="default", labels=LABELS, ip="127.0.0.5", port=9)
    wait_pods(url, proc, {"worker-a"})
    assert discovered(url)["worker-a"]["url"] == a

    api.set_ready("worker-b", True, namespace=NS)
    wait_pods(url, proc, {"worker-a", "worker-b"})
    ids = {name: w["id"] for name, w in discovered(url).items()}
    assert served(url, 6) == set(ids.values())
    status, world = http_json("GET", url + "/get_world_size", headers=auth(), timeout=30)
    assert status == 200 and world["world_size"] == 2

    api.set_ready("worker-a", False, namespace=NS)  # its readiness probe fails: out
    wait_pods(url, proc, {"worker-b"})
    assert served(url, 4) == {ids["worker-b"]}
    assert http_json("GET", url + "/get_world_size", headers=auth(), timeout=30)[1]["world_size"] == 1

    api.set_ready("worker-a", True, namespace=NS)
    wait_pods(url, proc, {"worker-a", "worker-b"})
    api.mark_terminating("worker-b", namespace=NS)  # deletion started: out at once, even while still Ready
    wait_pods(url, proc, {"worker-a"})
    assert served(url, 4) == {ids["worker-a"]}
    assert discovery_health(url)["connected"] is True


def test_a_pod_deleted_while_the_watch_is_down_is_gone_after_the_relist(api, router, pod_workers) -> None:
    proc, url = router
    both_pods_ready(api, router, pod_workers)
    lists = api.list_count

    # The API server goes away; meanwhile a pod is deleted and the history that held its DELETED event is
    # compacted, so no watch can replay it: only a list can tell.
    api.suspend()
    api.delete_pod("worker-b", namespace=NS)
    api.compact()
    api.resume()
    wait_pods(url, proc, {"worker-a"})
    assert api.list_count > lists

    # And while watching normally, a cut stream is followed by a list too, not a blind resume.
    lists = api.list_count
    api.drop_watches()
    api.wait_until(lambda: api.list_count > lists, timeout=SETTLE_S, what="a re-list after the cut watch")


def test_the_router_keeps_serving_while_the_api_server_is_away(api, router, pod_workers) -> None:
    proc, url = router
    both_pods_ready(api, router, pod_workers)
    ids = {w["id"] for w in discovered(url).values()}

    api.suspend()
    wait_for(lambda: discovery_health(url)["connected"] is False, SETTLE_S, proc, "discovery to notice the outage")
    assert set(discovered(url)) == {"worker-a", "worker-b"}
    assert served(url, 6) == ids
    assert discovery_health(url)["last_error"]

    api.resume()
    wait_for(lambda: discovery_health(url)["connected"] is True, SETTLE_S, proc, "discovery to reconnect")
    assert served(url, 4) == ids


def test_a_pod_discovered_after_the_first_weight_update_is_pending(api, router, pod_workers) -> None:
    proc, url = router
    a, b = pod_workers
    api.add_pod("worker-a", namespace=NS, labels=LABELS, **as_pod(a))
    wait_pods(url, proc, {"worker-a"})
    status, body = http_json("POST", url + "/update_weight_version", {"new_version": "v1"}, headers=auth(), timeout=60)
    assert status == 200, body

    api.add_pod("worker-b", namespace=NS, labels=LABELS, **as_pod(b))
    wait_pods(url, proc, {"worker-a", "worker-b"})
    late = discovered(url)["worker-b"]
    assert late["pending"] and "joined or restarted" in late["pending"], late
    assert served(url, 6) == {discovered(url)["worker-a"]["id"]}


@pytest.fixture
def start_in_process(
    api: StandInApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aiohttp_client: Any
) -> Callable[..., Awaitable[web.Application]]:
    """A router app in this process with discovery on the stand-in API server; ``settings`` add to its config."""
    for name, value in client_env(api, tmp_path).items():
        monkeypatch.setenv(name, value)

    async def start(**settings: Any) -> web.Application:
        config = RouterConfig(
            admin_api_key=ADMIN_KEY, service_discovery="k8s", selector=LABELS, health_check_interval_s=0.5, **settings
        )
        app = create_app(config)
        await aiohttp_client(app)
        return app

    return start


async def test_a_pod_that_appears_during_an_update_is_registered_when_it_ends(
    api: StandInApiServer, pod_workers: list[str], start_in_process: Callable[..., Awaitable[web.Application]]
) -> None:
    a, b = pod_workers
    api.add_pod("worker-a", namespace=NS, labels=LABELS, **as_pod(a))
    # A short lock wait: the discovery loop's attempts at the lock end (and are counted) while it is held.
    app = await start_in_process(admin_lock_timeout_s=0.2)
    registry, gate, metrics = app[keys.REGISTRY], app[keys.GATE], app[keys.METRICS]

    def lock_refusals() -> float:
        labels = {"operation": "service_discovery", "acquired": "false"}
        return metrics.registry.get_sample_value("omni_router_update_lock_wait_seconds_count", labels) or 0.0

    async def registered(n: int) -> None:
        await until(lambda: len(registry) == n, SETTLE_S, f"{n} registered worker(s)")

    await registered(1)
    await gate.acquire("prepare_weights_update")  # an update holds the lock
    try:
        api.add_pod("worker-b", namespace=NS, labels=LABELS, **as_pod(b))
        status = app[keys.DISCOVERY_STATUS]
        await until(lambda: status.candidates == 2, SETTLE_S, "the watch to deliver the new pod")
        refused = lock_refusals()
        await until(lambda: lock_refusals() > refused, SETTLE_S, "discovery to try for the lock and wait it out")
        assert [w.url for w in registry] == [a]  # ... and the registry waits for the lock
    finally:
        gate.release()
    await registered(2)
    assert [w.url for w in registry] == [a, b]


async def test_a_departed_worker_leaves_the_registry_only_after_the_fence_barrier(
    api: StandInApiServer, pod_workers: list[str], start_in_process: Callable[..., Awaitable[web.Application]]
) -> None:
    a, b = pod_workers
    api.add_pod("worker-a", namespace=NS, labels=LABELS, **as_pod(a))
    api.add_pod("worker-b", namespace=NS, labels=LABELS, **as_pod(b))
    app = await start_in_process()
    registry = app[keys.REGISTRY]
    await until(lambda: len(registry) == 2, SETTLE_S, "both pods registered")

    # The barrier of a router with data planes, held open: it records what the fleet looked like when asked.
    asked: list[tuple[str, bool]] = []
    answer = asyncio.Event()

    class HeldBarrier:
        async def confirm(self, why: str) -> None:
            leaving = registry.find(worker_id_for(b))
            asked.append((why, leaving is not None and leaving.departed is not None))
            await answer.wait()

    app[keys.DISCOVERY].barrier = HeldBarrier()
    api.delete_pod("worker-b", namespace=NS)
    await until(lambda: bool(asked), SETTLE_S, "the departure to reach the barrier")
    why, departed_when_asked = asked[0]
    assert departed_when_asked and "left with their pods" in why
    await asyncio.sleep(0.5)
    assert [w.url for w in registry] == [a, b]  # not removed while a data plane may still route to it
    answer.set()
    await until(lambda: [w.url for w in registry] == [a], SETTLE_S, "the departed worker removed")
