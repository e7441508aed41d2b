"""Where an admin operation spent its time: the answer's ``timings`` and ``Server-Timing``, the log line,
the per-phase histogram and ``GET /fleet/status``'s last update (in-process, scripted loopback workers).

The stand-in workers answer after a fixed delay, so the phases can be checked against what the router
could not have done faster: the fan-out and the slowest worker take at least that delay, and the total
holds every phase that runs one after another.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from router.contract.generate import INSTANCE_HEADER
from router.gateway import keys
from router.gateway.admin.timings import PHASES
from router.gateway.app import create_app
from router.gateway.config import RouterConfig
from tests._polling import until

#: What each stand-in worker takes to answer an admin call.
WORKER_S = 0.05


def standin(name: str, delays: dict[str, float]) -> web.Application:
    """A healthy worker whose admin calls answer after ``delays[path]`` (``WORKER_S`` by default)."""
    version = {"weight_version": "v0"}

    async def health(_: web.Request) -> web.Response:
        body = {"status": "ok", "weight_version": version["weight_version"], "weight_state": "serving"}
        return web.json_response(body | {"instance_id": f"{name}-boot"})

    async def model_info(_: web.Request) -> web.Response:
        body = {"model_path": "standin", "weight_version": version["weight_version"], "tp_size": 1}
        return web.json_response(body | {"instance_id": f"{name}-boot"})

    async def admin(request: web.Request) -> web.Response:
        await asyncio.sleep(delays.get(request.path, WORKER_S))
        if request.path == "/update_weights_from_disk":
            version["weight_version"] = (await request.json()).get("weight_version") or "v1"
        return web.json_response({"success": True, "message": "ok"}, headers={INSTANCE_HEADER: f"{name}-boot"})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/model_info", model_info)
    for path in ("/pause_generation", "/continue_generation", "/flush_cache", "/update_weights_from_disk"):
        app.router.add_post(path, admin)
    return app


@pytest.fixture
async def router(aiohttp_client, tmp_path: Path) -> AsyncIterator[TestClient]:
    delays = [{}, {"/update_weights_from_disk": 3 * WORKER_S}]  # the second worker is the slowest
    servers = [TestServer(standin(f"w{i}", d), host="127.0.0.1") for i, d in enumerate(delays)]
    for server in servers:
        await server.start_server()
    config = RouterConfig(
        worker_urls=[f"http://127.0.0.1:{s.port}" for s in servers],
        worker_engine="omni",
        state_dir=tmp_path / "state",
        health_check_interval_s=3600.0,
    )
    client = await aiohttp_client(create_app(config))
    registry = client.app[keys.REGISTRY]
    await until(lambda: len(registry.routable()) == 2, 4, "the first probes to find both workers")
    yield client
    for server in servers:
        await server.close()


def server_timing(header: str) -> dict[str, float]:
    """``name;dur=ms, ...`` → ``{name: ms}``."""
    pairs = (re.fullmatch(r"\s*([a-z_]+);dur=([0-9.e+-]+)\s*", part) for part in header.split(","))
    return {m.group(1): float(m.group(2)) for m in pairs if m is not None}


async def test_an_update_answers_its_phases_and_status_shows_them(router: TestClient, caplog) -> None:
    caplog.set_level(logging.INFO, logger="router.gateway.admin.locked")
    body = {"model_path": "/models/next", "weight_version": "v7"}
    async with router.post("/update_weights_from_disk", json=body) as resp:
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
        header = resp.headers["Server-Timing"]
    timings = answer["timings"]
    # A fenced weight change runs every phase; they are listed in the order they run.
    assert list(timings) == list(PHASES)
    assert server_timing(header) == pytest.approx(timings, abs=1e-3)
    slowest = max(r["elapsed_ms"] for r in answer["results"])
    assert timings["slowest_worker"] == pytest.approx(slowest, abs=1e-3)
    assert timings["slowest_worker"] >= 3 * WORKER_S * 1000 * 0.9  # the slow worker's own delay
    assert timings["fan_out"] >= timings["slowest_worker"] - 1.0
    in_turn = ("lock_wait", "fence_barrier", "fan_out", "settle", "verification")
    assert timings["total"] >= sum(timings[p] for p in in_turn) - 1.0
    assert all(ms >= 0 for ms in timings.values())
    # The log line says the same phases.
    (line,) = [r.getMessage() for r in caplog.records if "update_weights_from_disk: success in" in r.getMessage()]
    assert all(f"{phase}=" in line for phase in PHASES)
    # The histogram has one observation per phase (the total is the operation's duration histogram).
    metrics = router.app[keys.METRICS]
    samples = {
        s.labels["phase"]: s.value
        for family in metrics.admin_phases.collect()
        for s in family.samples
        if s.name.endswith("_count") and s.labels["operation"] == "update_weights_from_disk"
    }
    assert samples == {phase: 1.0 for phase in PHASES if phase != "total"}
    # GET /fleet/status keeps the last weight change and its phases.
    async with router.get("/fleet/status") as resp:
        status = await resp.json()
    last = status["last_update"]
    assert last["operation"] == "update_weights_from_disk" and last["outcome"] == "success"
    assert last["timings"] == timings and last["operation_id"] in line


async def test_an_operation_that_changes_no_weights_answers_only_the_phases_it_ran(router: TestClient) -> None:
    async with router.post("/flush_cache", json={}) as resp:
        assert resp.status == 200
        timings = (await resp.json())["timings"]
        assert server_timing(resp.headers["Server-Timing"]) == pytest.approx(timings, abs=1e-3)
    # Not serialized, not fenced, no weights to verify: no lock wait, no fence, no verification.
    assert set(timings) == {"fan_out", "slowest_worker", "total"}
    async with router.post("/pause_generation", json={"mode": "in_place"}) as resp:
        assert resp.status == 200
        timings = (await resp.json())["timings"]
    assert {"lock_wait", "fence_barrier", "journal_write", "fan_out", "settle"} <= set(timings)
    assert "verification" not in timings
    async with router.get("/fleet/status") as resp:
        assert (await resp.json())["last_update"] is None  # neither changed the fleet's weights
