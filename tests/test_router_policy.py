"""Router policy that needs no real worker, run in-process (pytest-aiohttp).

The router app is built with ``create_app`` and driven through ``aiohttp_client``.
Its two registered workers are loopback addresses where nothing listens
(127.0.0.2 and 127.0.0.3), so every call the router makes to them is refused at
once: enough to check auth, input validation, the update lock, the registry,
rank planning and fail-closed fencing without starting a process. End-to-end
behaviour with real workers is in the other ``test_router_*`` modules.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from router.contract.fleet import JournalView, WorkerList
from router.contract.fleet_answers import FleetAnswer
from router.gateway import keys
from router.gateway.admin.operations import OPERATIONS
from router.gateway.app import create_app
from router.gateway.config import RouterConfig

KEY = "policy-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: Nothing listens on the discard port of these loopback addresses.
UNREACHABLE = ["http://127.0.0.2:9", "http://127.0.0.3:9"]
REGISTRY_ROUTES = [
    ("GET", "/workers"),
    ("POST", "/workers"),
    ("GET", "/workers/x"),
    ("PUT", "/workers/x"),
    ("DELETE", "/workers/x"),
    ("POST", "/add_worker"),
    ("POST", "/remove_worker"),
    ("GET", "/list_workers"),
    ("GET", "/get_world_size"),
    ("GET", "/weight_update_journal"),
    ("POST", "/weight_update_journal/resolve"),
]
ADMIN_ROUTES = sorted({(m, p) for p, op in OPERATIONS.items() for m in op.endpoint.methods} | set(REGISTRY_ROUTES))


@pytest.fixture
async def client(aiohttp_client: Any, tmp_path: Path) -> TestClient:
    config = RouterConfig(
        worker_urls=UNREACHABLE,
        admin_api_key=KEY,
        state_dir=tmp_path / "state",
        admin_lock_timeout_s=0.3,
        connect_timeout_s=2.0,
        health_check_interval_s=3600.0,  # one probe at start-up; the tests drive everything else
    )
    return await aiohttp_client(create_app(config))


async def call(client: TestClient, method: str, path: str, body: Any = None, *, auth: bool = True) -> tuple[int, Any]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    async with client.request(method, path, data=data, headers=AUTH if auth else {}) as resp:
        text = await resp.text()
        return resp.status, json.loads(text) if text.startswith(("{", "[")) else text


async def fleet_state(client: TestClient) -> tuple[list[bool], Any]:
    """Each worker's ``disabled`` flag and the journal's pending entry."""
    workers = WorkerList.model_validate((await call(client, "GET", "/workers"))[1]).workers
    journal = JournalView.model_validate((await call(client, "GET", "/weight_update_journal"))[1])
    return [w.disabled for w in workers], journal.pending


async def test_every_admin_route_needs_the_key(client: TestClient) -> None:
    for method, path in ADMIN_ROUTES:
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}):
            async with client.request(method, path, data=b"{}", headers=headers) as resp:
                body = await resp.json()
                assert resp.status == 401, (method, path, headers, body)
                assert "Bearer" in body["error"]["message"] and resp.headers["WWW-Authenticate"] == "Bearer"
    for path in ("/health", "/liveness", "/metrics"):
        assert (await call(client, "GET", path, auth=False))[0] == 200
    status, body = await call(client, "GET", "/readiness", auth=False)
    assert status == 503 and body["status"] == "not_ready"  # nothing is routable


BAD_BODIES: list[tuple[str, Any, str]] = [
    ("/pause_generation", {"mode": "sideways"}, "mode"),
    ("/pause_generation", {"mode": 1}, "mode"),
    ("/update_weights_from_disk", {}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "/m", "abort_all_requests": "maybe"}, "abort_all_requests"),
    (
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": 1, "world_size": "three"},
        "world_size",
    ),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2.5}, "world_size"),
    (
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": 70000, "world_size": 3},
        "master_port",
    ),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "world_size": True}, "world_size"),
    (
        "/prepare_weights_update",
        {"num_buckets": 1, "group_name": "g", "buckets": [{"names": ["a"], "dtypes": [], "shapes": [[1]]}]},
        "equal lengths",
    ),
    (
        "/prepare_weights_update",
        {"num_buckets": 2, "group_name": "g", "buckets": [{"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]}]},
        "num_buckets",
    ),
    (
        "/prepare_weights_update",
        {
            "num_buckets": 1,
            "group_name": "g",
            "load_format": "flattened_bucket",
            "buckets": [{"names": ["a", "b"], "dtypes": ["bfloat16", "float32"], "shapes": [[3], [1]]}],
        },
        "unaligned",
    ),
    ("/complete_weights_update", {}, "group_name"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float33"], "shapes": [[1]]}, "dtype"),
    ("/weights_checker", {"action": "scramble"}, "action"),
    ("/flush_cache", {"timeout": -1}, "timeout"),
    ("/release_memory_occupation", {"tags": ["gpu"]}, "tags"),
    ("/update_weight_version", {}, "new_version"),
    ("/abort_request", {"rid": 5}, "rid"),
    (
        "/init_weight_transfer_engine",
        {"init_info": {"nccl_unique_id_b64": "bm90LTEyOC1ieXRlcw==", "rank_offset": 1, "world_size": 3}},
        "128 bytes",
    ),
    (
        "/init_weight_transfer_engine",
        {"init_info": {"nccl_unique_id_b64": "a-b_", "master_port": 1, "rank_offset": 1, "world_size": 3}},
        "not both",
    ),
    ("/pause_generation", b"{not json", "malformed JSON"),
    ("/pause_generation", b"[1, 2]", "JSON object"),
]


@pytest.mark.parametrize(
    ("path", "body", "names"), BAD_BODIES, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(BAD_BODIES)]
)
async def test_caller_mistakes_are_400_before_any_worker_is_touched(
    client: TestClient, path: str, body: Any, names: str
) -> None:
    status, answer = await call(client, "POST", path, body)
    assert status == 400, answer
    assert names in answer["error"]["message"]
    # A worker contacted at all would have answered this with a 502 (nothing listens there).
    assert await fleet_state(client) == ([False, False], None)
    assert not client.app[keys.GATE].is_busy


async def test_unreachable_targets_fail_a_fenced_update_closed_until_resolved(
    client: TestClient, tmp_path: Path
) -> None:
    status, body = await call(client, "POST", "/pause_generation", {"mode": "retract"})
    assert status == 502, body
    answer = FleetAnswer.model_validate(body)
    assert answer.worker_count == 2 and answer.failed_workers() == [r.worker for r in answer.results]
    assert all(r.status_code is None and r.error for r in answer.results)
    assert "stay disabled (fail closed)" in answer.message
    disabled, pending = await fleet_state(client)
    assert disabled == [True, True] and pending.state == "failed" and pending.path == "/pause_generation"
    assert json.loads((tmp_path / "state" / "update_journal.json").read_text())["state"] == "failed"
    # Every later update is refused while the failure is unresolved; plain reads still broadcast.
    status, body = await call(client, "POST", "/update_weights_from_disk", {"model_path": "/m"})
    assert (
        status == 409
        and "did not finish cleanly" in body["error"]["message"]
        and body["journal"]["path"] == "/pause_generation"
    )
    assert (await call(client, "POST", "/weight_update_journal/resolve", {"acknowledge": False}))[0] == 409
    status, body = await call(client, "POST", "/weight_update_journal/resolve", {"acknowledge": True})
    assert status == 200 and body["resolved"] and len(body["workers"]) == 2
    assert await fleet_state(client) == ([False, False], None)
    assert not (tmp_path / "state" / "update_journal.json").exists()


async def test_a_failed_plain_broadcast_fences_nothing(client: TestClient) -> None:
    status, body = await call(client, "POST", "/flush_cache", {})
    assert status == 502 and len(body["results"]) == 2
    assert await fleet_state(client) == ([False, False], None)


async def test_the_update_lock_answers_503_and_freezes_the_registry(client: TestClient) -> None:
    gate = client.app[keys.GATE]
    await gate.acquire("a test update")
    try:
        status, body = await call(client, "POST", "/pause_generation", {"mode": "retract"})
        assert status == 503 and "held by a test update" in body["error"]["message"]
        worker = WorkerList.model_validate((await call(client, "GET", "/workers"))[1]).workers[0]
        for method, path, payload in (
            ("POST", "/workers", {"url": "http://127.0.0.4:9"}),
            ("PUT", f"/workers/{worker.id}", {"disabled": True}),
            ("DELETE", f"/workers/{worker.id}", None),
            ("POST", "/weight_update_journal/resolve", {"acknowledge": True}),
        ):
            status, body = await call(client, method, path, payload)
            assert status == 409 and "a test update" in body["error"]["message"], (method, path, body)
        assert await fleet_state(client) == ([False, False], None)
    finally:
        gate.release()
    assert (await call(client, "PUT", f"/workers/{worker.id}", {"disabled": True}))[0] == 200


async def test_an_operation_that_cannot_start_releases_the_lock(client: TestClient) -> None:
    registry = client.app[keys.REGISTRY]
    for worker in list(registry):
        registry.remove(worker.id)
    status, body = await call(client, "POST", "/pause_generation", {"mode": "retract"})
    assert status == 503 and "no live workers" in body["error"]["message"]
    assert not client.app[keys.GATE].is_busy and await fleet_state(client) == ([], None)
    metrics = (await call(client, "GET", "/metrics"))[1]
    assert 'omni_router_admin_operations_total{operation="pause_generation",outcome="error"} 1.0' in metrics


async def test_world_size_is_planned_from_tp_sizes_and_checked_before_any_join(client: TestClient) -> None:
    registry = client.app[keys.REGISTRY]
    first, second = list(registry)
    status, body = await call(client, "GET", "/get_world_size")
    assert status == 503 and "tp_size not yet known" in body["error"]["message"]  # nobody answered /model_info
    first.tp_size, second.tp_size = 1, 2
    status, body = await call(client, "GET", "/get_world_size")
    assert status == 200 and body["world_size"] == 3
    assert [(w["worker"], w["rank_offset"], w["tp_size"]) for w in body["workers"]] == [
        (first.id, 1, 1),
        (second.id, 2, 2),
    ]
    init = {"master_address": "127.0.0.1", "master_port": 29500, "world_size": 3}
    status, body = await call(client, "POST", "/init_weights_update_group", init)
    assert status == 400 and body["expected_world_size"] == 4 and "world_size must be 4" in body["error"]["message"]
    # A caller's own rank_offset shifts the plan: ranks 2 (tp 1) and 3-4 (tp 2), so world_size 5.
    status, body = await call(client, "POST", "/init_weights_update_group", {**init, "world_size": 4, "rank_offset": 2})
    assert status == 400 and body["expected_world_size"] == 5
    assert await fleet_state(client) == ([False, False], None)


async def test_registry_crud_and_legacy_routes(client: TestClient) -> None:
    first, second = WorkerList.model_validate((await call(client, "GET", "/workers"))[1]).workers
    escaped = first.url.replace(":", "%3A").replace("/", "%2F")
    assert (await call(client, "GET", f"/workers/{escaped}"))[1]["id"] == first.id
    assert (await call(client, "GET", "/workers/w-nope"))[0] == 404
    assert (await call(client, "POST", "/workers", {"url": first.url + "/"}))[0] == 409  # the same worker
    long_label = "http://" + "a" * 64 + ".localhost:1"  # a DNS label is at most 63 bytes
    for bad in ("ftp://127.0.0.4:1", "http://127.0.0.4:1/path", "http://user:pw@127.0.0.4:1", long_label):
        status, body = await call(client, "POST", "/workers", {"url": bad})
        assert status == 400 and "invalid worker url" in body["error"]["message"], bad
    assert len(WorkerList.model_validate((await call(client, "GET", "/workers"))[1]).workers) == 2
    assert (await call(client, "PUT", f"/workers/{first.id}", {"disabled": "maybe"}))[0] == 400
    status, body = await call(client, "DELETE", f"/workers/{first.id}")
    assert status == 200 and body["removed"]["id"] == first.id
    status, body = await call(client, "POST", "/workers", {"url": first.url, "disabled": True})
    assert status == 201 and body["id"] == first.id and body["disabled"] is True and body["health"] == "unhealthy"
    status, body = await call(client, "POST", f"/remove_worker?url={second.url}")
    assert status == 200 and body["success"]
    assert (await call(client, "GET", "/list_workers"))[1]["urls"] == [first.url]
    status, body = await call(client, "POST", f"/add_worker?url={second.url}")
    assert status == 200 and body["worker"]["id"] == second.id


async def test_generate_with_nothing_routable_is_503_at_once(client: TestClient) -> None:
    # Not a speed check: nothing becomes routable here, so a router that held the request for a
    # worker would never answer, and the bound ends the test instead.
    async with asyncio.timeout(20):
        status, body = await call(client, "POST", "/generate", {"text": "hi"}, auth=False)
    assert status == 503 and "no routable worker: 2 registered, 0 healthy" in body["error"]["message"]
