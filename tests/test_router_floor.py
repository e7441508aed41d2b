"""The healthy floor (``--min-routable-workers``) and the catch-up cap (``--max-rejoin-attempts``), in-process.

The router is built with ``create_app`` in front of scripted loopback stand-in workers (aiohttp servers on
127.0.0.1) that count the admin calls they receive. The floor: a weight sync below it is refused with 409
before the update lock, and afterwards nothing changed (no call reached a worker, no fence, no journal entry,
no lock held, no fleet version recorded); at or above it the sync runs. The cap: a worker process whose
catch-ups keep failing is retired after K of them, shows why in ``GET /workers``, ``GET /fleet/status`` and
the metrics, and a restart (a new instance id) counts from zero again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from router.contract.fleet import CatchUpStatus
from router.contract.fleet_status import FleetStatus
from router.contract.generate import INSTANCE_HEADER
from router.gateway import keys
from router.gateway.admin import floor
from router.gateway.admin import operations as ops
from router.gateway.admin.journal import UpdateJournal
from router.gateway.admin.locked import LockHold
from router.gateway.app import create_app
from router.gateway.catch_up import scan
from router.gateway.catch_up.joiners import JoinerSync
from router.gateway.config import RouterConfig
from router.gateway.fleet.registry import Worker, WorkerRegistry
from router.gateway.status.render import build_report, render_text
from tests._polling import until

PREPARE = {"num_buckets": 1, "group_name": "g", "buckets": [{"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]}]}


@dataclass
class StandIn:
    """One scripted worker: healthy, serving ``version`` from process ``instance``; counts the admin calls."""

    name: str
    version: str = "v0"
    instance: str = ""
    calls: list[str] = field(default_factory=list)
    peer_error: str = "the source's snapshot stream broke"

    def __post_init__(self) -> None:
        self.instance = f"{self.name}-boot"

    def app(self) -> web.Application:
        def facts() -> dict[str, Any]:
            return {"weight_version": self.version, "weight_state": "serving", "instance_id": self.instance}

        async def health(_: web.Request) -> web.Response:
            return web.json_response({"status": "ok", **facts()})

        async def model_info(_: web.Request) -> web.Response:
            return web.json_response({"model_path": "standin", "tp_size": 1, **facts()})

        async def admin(request: web.Request) -> web.Response:
            self.calls.append(request.path)
            if request.path == "/update_weights_from_disk":
                self.version = (await request.json()).get("weight_version") or "v1"
            if request.path == "/update_weights_from_peer":
                return web.json_response({"success": False, "message": self.peer_error})
            return web.json_response({"success": True, "message": "ok"}, headers={INSTANCE_HEADER: self.instance})

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/model_info", model_info)
        for path in (
            "/pause_generation",
            "/continue_generation",
            "/update_weights_from_disk",
            "/update_weights_from_peer",
        ):
            app.router.add_post(path, admin)
        return app


@dataclass
class Fleet:
    client: TestClient
    workers: list[StandIn]

    @property
    def registry(self) -> WorkerRegistry:
        return self.client.app[keys.REGISTRY]

    def worker(self, i: int) -> Worker:
        return list(self.registry)[i]

    def admin_calls(self) -> list[str]:
        return [path for w in self.workers for path in w.calls]

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        async with self.client.request(method, path, json=body) as resp:
            return resp.status, await resp.json()


Build = Callable[..., Awaitable[Fleet]]


@pytest.fixture
async def build(aiohttp_client: Any, tmp_path: Path) -> AsyncIterator[Build]:
    """``await build(n, **config)``: ``n`` stand-ins behind a router made with ``config``, all found healthy."""
    servers: list[TestServer] = []

    async def make(n: int, **config: Any) -> Fleet:
        workers = [StandIn(f"w{i}") for i in range(n)]
        for w in workers:
            server = TestServer(w.app(), host="127.0.0.1")
            await server.start_server()
            servers.append(server)
        settings = RouterConfig(
            worker_urls=[f"http://127.0.0.1:{s.port}" for s in servers],
            worker_engine="omni",
            state_dir=tmp_path / "state",
            health_check_interval_s=3600.0,  # one probe at start-up; the tests set health themselves
            admin_lock_timeout_s=1.0,
            **config,
        )
        client = await aiohttp_client(create_app(settings))
        fleet = Fleet(client, workers)
        await until(lambda: len(fleet.registry.routable()) == n, 5, "the first probes to find every worker")
        return fleet

    yield make
    for server in servers:
        await server.close()


async def assert_nothing_changed(fleet: Fleet, disabled: list[bool]) -> None:
    """No worker got a call, no fence or journal entry, the lock free, no fleet version recorded."""
    assert fleet.admin_calls() == []
    assert [w.disabled for w in fleet.registry] == disabled
    assert all(w.update_holds == 0 for w in fleet.registry)
    admin = fleet.client.app[keys.ADMIN]
    assert (
        admin.journal.pending is None and not (fleet.client.app[keys.CONFIG].state_dir / "update_journal.json").exists()
    )
    assert not admin.gate.is_busy and admin.gate.holder is None
    assert fleet.registry.fleet.record is None and admin.last_update is None
    status, journal = await fleet.call("GET", "/weight_update_journal")
    assert status == 200 and journal["pending"] is None


# -- the floor ---------------------------------------------------------------------------------------------------


async def test_a_sync_below_the_floor_is_refused_and_changes_nothing(build: Build) -> None:
    fleet = await build(4, min_routable_workers=3)
    dead, disabled = fleet.worker(2), fleet.worker(3)
    dead.health = "dead"
    status, _ = await fleet.call("PUT", f"/workers/{disabled.id}", {"disabled": True})
    assert status == 200
    update = {"model_path": "/models/next", "weight_version": "v1"}
    status, body = await fleet.call("POST", "/update_weights_from_disk", update)
    assert status == 409, body
    message = body["error"]["message"]
    assert message.startswith("2 of 4 workers can take /update_weights_from_disk; --min-routable-workers needs 3")
    assert f"{dead.id} (dead)" in message and f"{disabled.id} (disabled)" in message
    assert body["min_routable_workers"] == {
        "needed": 3,
        "able": 2,
        "registered": 4,
        "out": {dead.id: "dead", disabled.id: "disabled"},
    }
    # The start of a two-phase sync is refused the same way, before its group is even looked up.
    status, body = await fleet.call("POST", "/prepare_weights_update", PREPARE)
    assert status == 409 and "--min-routable-workers needs 3" in body["error"]["message"], body
    await assert_nothing_changed(fleet, [False, False, False, True])
    # What starts no sync is not held to the floor: a pause reaches the live workers (the dead one is no target).
    status, body = await fleet.call("POST", "/pause_generation", {"mode": "retract"})
    assert status == 200, body
    assert sorted(fleet.admin_calls()) == ["/pause_generation"] * 3
    assert (await fleet.call("POST", "/continue_generation", {}))[0] == 200

    # Back at the floor (the operator re-enables the worker): the same update goes through.
    assert (await fleet.call("PUT", f"/workers/{disabled.id}", {"disabled": False}))[0] == 200
    status, body = await fleet.call("POST", "/update_weights_from_disk", update)
    assert status == 200, body
    assert {r["worker"] for r in body["results"]} == {w.id for w in fleet.registry if w is not dead}
    assert {w.weight_version for w in fleet.registry if w is not dead} == {"v1"}
    assert fleet.client.app[keys.ADMIN].journal.pending is None


async def test_a_share_of_the_fleet_is_rounded_up(build: Build) -> None:
    """0.75 of 4 registered workers is 3: one dead worker leaves exactly 3, two leave too few."""
    fleet = await build(4, min_routable_workers=0.75)
    fleet.worker(0).health = "dead"
    status, body = await fleet.call("POST", "/update_weights_from_disk", {"model_path": "/m", "weight_version": "v1"})
    assert status == 200, body
    assert len(body["results"]) == 3
    fleet.worker(1).health = "unhealthy"
    calls = len(fleet.admin_calls())
    status, body = await fleet.call("POST", "/update_weights_from_disk", {"model_path": "/m", "weight_version": "v2"})
    assert status == 409, body
    assert body["error"]["message"].startswith(
        "2 of 4 workers can take /update_weights_from_disk; --min-routable-workers needs 3 "
        "(0.75 of 4 registered, rounded up)"
    )
    assert len(fleet.admin_calls()) == calls and fleet.client.app[keys.ADMIN].journal.pending is None


async def test_a_targeted_sync_counts_only_its_targets(build: Build) -> None:
    """Only the targets of ``?workers=`` hold the new version afterwards (the rest are one behind): they count."""
    fleet = await build(3, min_routable_workers=2)
    first, second = fleet.worker(0).id, fleet.worker(1).id
    update = {"model_path": "/m", "weight_version": "v1"}
    status, body = await fleet.call("POST", f"/update_weights_from_disk?workers={first}", update)
    assert status == 409, body
    assert body["error"]["message"].startswith(
        "1 of the 1 targeted workers can take /update_weights_from_disk (only its targets will hold the new "
        "weights); --min-routable-workers needs 2"
    )
    # The same selection through smg's RL API is the same targeted operation, refused the same way.
    status, body = await fleet.call("POST", f"/v1/rl/engine/update_weights_from_disk?selector=id%3D{first}", update)
    assert status == 409 and "--min-routable-workers needs 2" in body["error"]["message"], body
    await assert_nothing_changed(fleet, [False, False, False])
    status, body = await fleet.call("POST", f"/update_weights_from_disk?workers={first},{second}", update)
    assert status == 200, body
    assert sorted(r["worker"] for r in body["results"]) == sorted([first, second])


async def test_the_floor_is_read_again_once_the_lock_is_taken(build: Build) -> None:
    """A sync that passed the floor and then waited for the lock while the fleet thinned is refused under the lock,
    before its fence: nothing is sent, nothing fenced, the lock free again."""
    fleet = await build(3, min_routable_workers=3)
    admin = fleet.client.app[keys.ADMIN]
    held = await LockHold.take(admin.gate, "an operation ahead")
    update = asyncio.create_task(
        fleet.call("POST", "/update_weights_from_disk", {"model_path": "/m", "weight_version": "v1"})
    )
    await until(lambda: admin.gate.waiters > 0, 5, "the sync to wait for the lock")
    fleet.worker(1).health = "dead"  # meanwhile the fleet loses a worker
    held.release()
    status, body = await update
    assert status == 409, body
    assert body["error"]["message"].startswith("2 of 3 workers can take /update_weights_from_disk")
    await assert_nothing_changed(fleet, [False, False, False])


async def test_with_the_floor_off_nothing_is_refused(build: Build) -> None:
    fleet = await build(2)
    fleet.worker(1).health = "dead"
    status, body = await fleet.call("POST", "/update_weights_from_disk", {"model_path": "/m", "weight_version": "v1"})
    assert status == 200, body


async def test_which_calls_start_a_sync_and_who_counts() -> None:
    starts = {path for path, op in ops.OPERATIONS.items() if floor.starts_sync(op)}
    assert starts == {
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/collective_rpc",
        "/prepare_weights_update",
        "/start_weight_update",
    }
    assert not floor.starts_sync(ops.COLLECTIVE_RPC_READ)  # a method that only reads changes no weights
    assert [floor.needed(f, n) for f, n in ((0, 8), (3, 1), (0.75, 8), (0.1, 30), (0.5, 3), (0.75, 0))] == [
        0,
        3,
        6,
        3,
        2,
        0,
    ]
    registry, journal = WorkerRegistry(), UpdateJournal(None)
    held, disabled, copying = (registry.add(f"http://127.0.0.1:{port}") for port in (1, 2, 3))
    for w in registry:
        w.health = "healthy"
    # A worker fenced by an update in flight counts by the flag it had before (the update decides its fate).
    held.disabled, held.update_holds = True, 1
    disabled.disabled, disabled.update_holds = True, 1
    await journal.begin("/update_weights_from_disk", [(held.id, held.url, False), (disabled.id, disabled.url, True)])
    copying.catch_up = None
    assert floor.why_left_out(held, journal) is None
    assert floor.why_left_out(disabled, journal) == "disabled"
    copying.catch_up = CatchUpStatus(state="copying", source=held.id)
    assert floor.why_left_out(copying, journal) == "catch-up copying"
    # Kept fenced by that update's failure: left out, and said so.
    await journal.fail([held.id], "it did not answer")
    held.update_holds = 0
    assert floor.why_left_out(held, journal) == "fenced by an earlier failed update"


# -- the catch-up cap --------------------------------------------------------------------------------------------


async def scan_until(sync: JoinerSync, done: Callable[[], bool], what: str) -> None:
    """Run the catch-up scan until ``done`` holds (bounded)."""

    async def scanned() -> bool:
        await sync.scan()
        return done()

    await until(scanned, 10, what)


async def test_a_worker_that_keeps_failing_its_catch_up_is_retired_until_it_restarts(
    build: Build, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scan, "FIRST_BACKOFF_S", 0.01)  # the back-off's shape, not its seconds, is under test
    # The app's own scan loop is off (--sync-joiners off): this test drives one built the same way.
    fleet = await build(3, sync_joiners="off", max_rejoin_attempts=2)
    sync = JoinerSync.from_app(fleet.client.app)
    status, body = await fleet.call("POST", "/update_weights_from_disk", {"model_path": "/m", "weight_version": "v1"})
    assert status == 200, body
    # The third worker restarts on its boot weights: pending, a joiner whose every load from a peer fails.
    standin, joiner = fleet.workers[2], fleet.worker(2)
    standin.version, standin.instance = "v0", "w2-second"
    prober = fleet.client.app[keys.ADMIN].prober
    assert await prober.refresh_metadata(joiner) and sync.eligible(joiner)
    peer_loads = lambda: sum(path == "/update_weights_from_peer" for w in fleet.workers for path in w.calls)  # noqa: E731

    await scan_until(sync, lambda: joiner.catch_up is not None and joiner.catch_up.state == "retired", "retired")
    assert peer_loads() == 2
    record = joiner.catch_up
    assert record is not None and record.attempts == 2 and record.next_try_at is None
    error = f"/update_weights_from_peer failed: {standin.peer_error}"
    detail = f"retired after 2 failed catch-up attempts: {error}"
    assert record.detail == detail and record.last_error == error
    # Not tried again, whatever happens to it meanwhile short of a restart: unhealthy for a while, or held by an
    # update, it stays retired.
    for _ in range(5):
        await sync.scan()
    joiner.health = "unhealthy"
    await sync.scan()
    joiner.health = "healthy"
    for _ in range(5):
        await sync.scan()
    assert peer_loads() == 2 and joiner.catch_up == record

    # GET /workers, GET /fleet/status and omni-router status say why; the metric counts it.
    status, workers = await fleet.call("GET", "/workers")
    (shown,) = [w for w in workers["workers"] if w["id"] == joiner.id]
    assert shown["catch_up"]["state"] == "retired" and shown["catch_up"]["detail"] == detail
    assert shown["pending"] is not None
    status, answer = await fleet.call("GET", "/fleet/status")
    fleet_status = FleetStatus.model_validate(answer)
    (verdict,) = [w for w in fleet_status.workers if w.id == joiner.id]
    assert not verdict.routable and verdict.out_of_rotation is not None and detail in verdict.out_of_rotation
    text = render_text(build_report("http://router", fleet_status))
    assert f"retired from {record.source} (2 attempt(s))" in text and detail in text
    exposition = fleet.client.app[keys.METRICS].render().decode()
    assert "omni_router_retired_workers 1.0" in exposition
    # The floor does not count it either: the fleet of three has two workers able to take a sync.
    assert floor.why_left_out(joiner, fleet.client.app[keys.ADMIN].journal) == "catch-up retired"
    # Nor is it a target of a fleet-wide call (it would fail the fleet's update); a call that names it reaches it.
    before = list(standin.calls)
    status, body = await fleet.call("POST", "/update_weights_from_disk", {"model_path": "/m", "weight_version": "v2"})
    assert status == 200, body
    assert joiner.id not in {r["worker"] for r in body["results"]} and len(body["results"]) == 2
    assert standin.calls == before
    status, body = await fleet.call("POST", f"/pause_generation?workers={joiner.id}", {"mode": "retract"})
    assert status == 200 and [r["worker"] for r in body["results"]] == [joiner.id], body
    assert standin.calls == [*before, "/pause_generation"]

    # A new process of the worker counts from zero again.
    standin.instance = "w2-third"
    assert await prober.refresh_metadata(joiner)
    await scan_until(sync, lambda: peer_loads() == 3, "a catch-up of the new process")
    assert joiner.catch_up is not None and joiner.catch_up.state == "failed" and joiner.catch_up.attempts == 1
    assert "omni_router_retired_workers 0.0" in fleet.client.app[keys.METRICS].render().decode()


async def test_without_a_cap_a_worker_is_retried_as_before(build: Build, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scan, "FIRST_BACKOFF_S", 0.01)
    fleet = await build(2, sync_joiners="off")
    sync = JoinerSync.from_app(fleet.client.app)
    assert (await fleet.call("POST", "/update_weights_from_disk", {"model_path": "/m", "weight_version": "v1"}))[
        0
    ] == 200
    standin, joiner = fleet.workers[1], fleet.worker(1)
    standin.version, standin.instance = "v0", "w1-second"
    assert await fleet.client.app[keys.ADMIN].prober.refresh_metadata(joiner)
    await scan_until(sync, lambda: joiner.catch_up is not None and joiner.catch_up.attempts >= 4, "four failures")
    assert joiner.catch_up is not None and joiner.catch_up.state == "failed"
