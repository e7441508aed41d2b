"""smg's RL control API (``/v1/rl/*``) and targeted admin calls (``?workers=`` / ``?selector=``).

In-process (pytest-aiohttp, workers on loopback addresses nothing listens on): the selector
grammar, smg's error codes, refusals that change nothing, a targeted fenced update that fails
closed on its target only. With two real workers: the worker rows, a targeted update from disk
that leaves the other worker on its previous version, a pause by selector, 207 on failure.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from router.contract.fleet import JournalView, WorkerList
from router.contract.rl import RlFanoutResponse, RlWorkersResponse
from router.gateway import keys
from router.gateway.admin.selectors import SelectorError, parse_selector
from router.gateway.app import create_app
from router.gateway.config import RouterConfig
from tests._router_fixtures import ADMIN_KEY, Fleet, auth, start_router, wait_for, workers
from tests.procs import http_json

KEY = "rl-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
UNREACHABLE = ["http://127.0.0.2:9", "http://127.0.0.3:9"]
FACTS = {"engine": "sglang", "role": None, "model": "m", "tp_size": "1", "control": "active", "weight_version": "42"}


@pytest.mark.parametrize(
    ("text", "matches"),
    [
        ("engine=sglang", True),
        ("engine==sglang", True),
        ("engine in (sglang,vllm)", True),
        ("engine in ( vllm , trtllm )", False),
        ("engine notin (vllm)", True),
        ("role!=reward", True),  # a fact the worker lacks: != matches, as in Kubernetes
        ("role=policy", False),
        ("model=m, tp_size=1", True),
        ("model=m,tp_size=2", False),
        ("control=active", True),
        ("weight_version!=42", False),
    ],
)
def test_selector_grammar_matches(text: str, matches: bool) -> None:
    assert parse_selector(text).matches(FACTS) is matches


@pytest.mark.parametrize(
    "text", ["", "  ", "colour=red", "engine", "engine=", "engine in (a,)", "engine in ((a))", "a=b)", "engine=a=b"]
)
def test_selector_grammar_refuses(text: str) -> None:
    with pytest.raises(SelectorError):
        parse_selector(text)


@pytest.fixture
async def client(aiohttp_client: Any, tmp_path: Path) -> TestClient:
    config = RouterConfig(
        worker_urls=UNREACHABLE,
        worker_engine="omni",  # unreachable, so never detected: registered as the omni-workers they stand for
        admin_api_key=KEY,
        state_dir=tmp_path / "state",
        admin_lock_timeout_s=0.3,
        connect_timeout_s=2.0,
        health_check_timeout_s=2.0,
        health_check_interval_s=3600.0,
    )
    return await aiohttp_client(create_app(config))


async def call(client: TestClient, method: str, path: str, body: Any = None, *, auth: bool = True) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    async with client.request(method, path, data=data, headers=AUTH if auth else {}) as resp:
        return resp.status, json.loads(await resp.text())


async def fleet_state(client: TestClient) -> tuple[list[bool], Any]:
    listed = WorkerList.model_validate((await call(client, "GET", "/workers"))[1]).workers
    journal = JournalView.model_validate((await call(client, "GET", "/weight_update_journal"))[1])
    return [w.disabled for w in listed], journal.pending


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/rl/workers"),
        ("GET", "/v1/rl/workers/x"),
        ("POST", "/v1/rl/workers/x/engine/pause_generation"),
        ("POST", "/v1/rl/engine/pause_generation?selector=engine%3Dsglang"),
    ],
)
async def test_every_rl_route_needs_the_admin_key(client: TestClient, method: str, path: str) -> None:
    status, body = await call(client, method, path, {}, auth=False)
    assert status == 401 and body["error"]["message"]


async def test_the_worker_rows_say_what_the_router_knows(client: TestClient) -> None:
    status, body = await call(client, "GET", "/v1/rl/workers")
    assert status == 200, body
    answer = RlWorkersResponse.model_validate(body)
    assert answer.protocol_version == 1 and answer.total == 2
    row = answer.workers[0]
    assert (row.engine, row.url, row.base_url, row.connection_mode, row.dp_ranks) == (
        "sglang",
        UNREACHABLE[0],
        UNREACHABLE[0],
        "http",
        1,
    )
    assert row.model_id == "unknown" and row.role is None and row.health == "not_ready"
    assert row.labels["omni.disabled"] == "false" and "abort" in row.capabilities.pause_modes
    status, one = await call(client, "GET", f"/v1/rl/workers/{row.id}")
    assert status == 200 and one["id"] == row.id


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code"),
    [
        ("POST", "/v1/rl/engine/pause_generation", {}, 400, "selector_required"),
        ("POST", "/v1/rl/engine/pause_generation?selector=colour%3Dred", {}, 400, "invalid_selector"),
        (
            "POST",
            "/v1/rl/engine/pause_generation?selector=engine%3Dsglang&selector=role%3Dx",
            {},
            400,
            "invalid_selector",
        ),
        ("POST", "/v1/rl/engine/pause_generation?selector=engine%3Dvllm", {}, 400, "no_workers_match"),
        ("POST", "/v1/rl/engine/pause_generation?selector=role%3Dreward", {}, 400, "no_workers_match"),
        ("POST", "/v1/rl/engine/no_such_route?selector=engine%3Dsglang", {}, 400, "invalid_engine_path"),
        ("GET", "/v1/rl/engine/pause_generation?selector=engine%3Dsglang", None, 400, "invalid_engine_path"),
        ("POST", "/v1/rl/engine/init_weights_update_group?selector=engine%3Dsglang", {}, 400, "invalid_engine_path"),
        ("POST", "/v1/rl/engine/pause_generation?selector=engine%3Dsglang", {"mode": "sideways"}, 400, "invalid_body"),
        ("POST", "/v1/rl/engine/pause_generation?selector=engine%3Dsglang", [1], 400, "invalid_body"),
        ("GET", "/v1/rl/workers/w-nosuchworker", None, 404, "worker_not_found"),
        ("POST", "/v1/rl/workers/w-nosuchworker/engine/pause_generation", {}, 404, "worker_not_found"),
    ],
)
async def test_refusals_carry_smgs_codes_and_change_nothing(
    client: TestClient, method: str, path: str, body: Any, status: int, code: str
) -> None:
    got, answer = await call(client, method, path, body)
    assert got == status, answer
    assert answer["error"]["type"] == code and answer["code"] == code and answer["error"]["message"]
    assert await fleet_state(client) == ([False, False], None)
    assert not client.app[keys.GATE].is_busy


async def test_the_routers_own_routes_refuse_unknown_or_misplaced_targets(client: TestClient) -> None:
    status, body = await call(client, "POST", "/pause_generation?workers=w-nosuchworker", {})
    assert status == 404 and body["code"] == "worker_not_found"
    status, body = await call(client, "POST", "/update_weights_from_disk?selector=model%3Dnone", {"model_path": "/m"})
    assert status == 400 and body["code"] == "no_workers_match"
    # A two-phase prepare spans the whole fleet: no target set on it.
    status, body = await call(client, "POST", "/prepare_weights_update?workers=x", {"group_name": "g"})
    assert status == 400 and "spans the whole fleet" in body["error"]["message"]
    assert await fleet_state(client) == ([False, False], None)


async def test_a_targeted_update_fences_and_journals_its_target_only(client: TestClient) -> None:
    first, second = WorkerList.model_validate((await call(client, "GET", "/workers"))[1]).workers
    status, body = await call(client, "POST", f"/pause_generation?workers={first.id}", {"mode": "retract"})
    assert status == 502 and body["worker_count"] == 1 and body["results"][0]["worker"] == first.id
    disabled, pending = await fleet_state(client)
    assert disabled == [True, False] and [t.id for t in pending.targets] == [first.id]
    assert second.id not in body["message"]


async def test_a_fanout_that_fails_answers_207_and_names_the_fenced(client: TestClient) -> None:
    status, body = await call(client, "POST", "/v1/rl/engine/pause_generation?selector=engine%3Dsglang", {})
    assert status == 207, body
    answer = RlFanoutResponse.model_validate(body)
    assert answer.total == 2 and answer.succeeded == 0 and not answer.results
    assert {f.error for f in answer.failed} == {"upstream_unreachable"}
    assert sorted(answer.fenced) == sorted(w.id for w in client.app[keys.REGISTRY])
    # smg's client resumes after any failure: the router serializes it, and the fenced stay fenced.
    status, body = await call(client, "POST", "/v1/rl/engine/continue_generation?selector=engine%3Dsglang", {})
    assert status == 207 and len(body["failed"]) == 2
    assert (await fleet_state(client))[0] == [True, True]


# -- two real workers


@pytest.fixture(scope="module")
def fleet(worker_fleet: Any) -> Fleet:
    return worker_fleet(2, extra_args=["--admin-api-key", ADMIN_KEY], seeds=(0, 1))


@pytest.fixture
def router(fleet: Fleet, tmp_path: Path) -> Any:
    proc, url = start_router(fleet.urls, admin_key=ADMIN_KEY, state_dir=tmp_path / "state")
    yield url
    proc.stop()


def rl(url: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    return http_json(method, url + path, body, headers=auth(), timeout=120)


def version_on(worker_url: str) -> str:
    status, info = http_json("GET", worker_url + "/model_info", headers=auth(), timeout=10)
    assert status == 200, info
    return str(info["weight_version"])


def test_a_targeted_update_leaves_the_other_worker_on_its_version(router: str, fleet: Fleet) -> None:
    (other,) = fleet.others
    ids = {w["url"]: w["id"] for w in workers(router, ADMIN_KEY)}
    first, second = fleet.urls
    status, body = rl(
        router,
        "POST",
        f"/update_weights_from_disk?workers={ids[first]}",
        {"model_path": str(other), "weight_version": "v1"},
    )
    assert status == 200, body
    assert [r["worker"] for r in body["results"]] == [ids[first]]
    assert (version_on(first), version_on(second)) == ("v1", "default")
    assert all(not w["disabled"] for w in workers(router, ADMIN_KEY))
    # The selector sees each worker's version: only the one left behind matches.
    status, rows = rl(router, "GET", "/v1/rl/workers")
    assert {w["url"]: w["weight_version"] for w in rows["workers"]} == {first: "v1", second: "default"}
    status, body = rl(
        router,
        "POST",
        "/v1/rl/engine/update_weights_from_disk?selector=weight_version%21%3Dv1",
        {"model_path": str(other), "weight_version": "v1"},
    )
    assert status == 200 and list(body["results"]) == [ids[second]] and body["succeeded"] == 1, body
    assert version_on(second) == "v1"
    status, body = rl(
        router, "POST", "/update_weights_from_disk", {"model_path": str(fleet.model), "weight_version": "default"}
    )
    assert status == 200, body


def _served_by(router: str, policy: str) -> tuple[str, str]:
    """One generation through the router under ``X-Version-Policy: policy``: (worker id, weight version)."""
    body = json.dumps({"text": "abc", "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}).encode()
    headers = {"Content-Type": "application/json", "X-Version-Policy": policy}
    req = urllib.request.Request(router + "/generate", data=body, method="POST", headers=headers)
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.headers["X-Omni-Worker"], json.loads(resp.read())["meta_info"]["weight_version"]


def test_a_rolling_update_keeps_the_other_worker_generating_on_the_previous_version(router: str, fleet: Fleet) -> None:
    (other,) = fleet.others
    ids = {w["url"]: w["id"] for w in workers(router, ADMIN_KEY)}
    first, second = fleet.urls
    status, body = rl(
        router, "POST", "/update_weights_from_disk", {"model_path": str(fleet.model), "weight_version": "v0"}
    )
    assert status == 200, body
    status, body = rl(
        router, "POST", f"/update_weights_from_disk?workers={first}", {"model_path": str(other), "weight_version": "v1"}
    )
    assert status == 200 and [r["worker"] for r in body["results"]] == [ids[first]], body
    # The newest version only: the updated worker. One version of staleness allowed: both, each on its own.
    assert {_served_by(router, "latest-only") for _ in range(4)} == {(ids[first], "v1")}
    seen: set[tuple[str, str]] = set()

    def both_served() -> bool:
        seen.add(_served_by(router, "max-staleness:1"))
        return len(seen) == 2

    wait_for(both_served, 30, what="both workers serving")
    assert seen == {(ids[first], "v1"), (ids[second], "v0")}
    status, body = rl(
        router, "POST", "/update_weights_from_disk", {"model_path": str(fleet.model), "weight_version": "default"}
    )
    assert status == 200, body


def test_pause_by_selector_and_207_on_a_refused_refit(router: str, fleet: Fleet) -> None:
    status, body = rl(router, "POST", "/v1/rl/engine/pause_generation?selector=engine%3Dsglang", {"mode": "retract"})
    assert status == 200 and body["total"] == 2 and body["succeeded"] == 2, body
    status, paused = rl(router, "GET", "/v1/rl/engine/is_paused?selector=control%3Dpaused")
    assert status == 200 and len(paused["results"]) == 2, paused
    assert all(r["body"]["is_paused"] for r in paused["results"].values())
    status, body = rl(
        router,
        "POST",
        "/v1/rl/engine/update_weights_from_disk?selector=engine%3Dsglang",
        {"model_path": "/nonexistent"},
    )
    assert status == 207 and body["succeeded"] == 0, body
    assert {(f["error"], f["status"]) for f in body["failed"]} == {("upstream_error", 400)}
    # Every worker refused before touching its weights: nothing is fenced.
    assert body["fenced"] == [] and all(not w["disabled"] for w in workers(router, ADMIN_KEY))
    status, body = rl(router, "POST", "/v1/rl/engine/continue_generation?selector=control%3Dpaused", {})
    assert status == 200 and body["succeeded"] == 2, body
    (first, _) = fleet.urls
    wid = next(w["id"] for w in workers(router, ADMIN_KEY) if w["url"] == first)
    status, one = rl(router, "GET", f"/v1/rl/workers/{wid}/engine/get_weight_version")
    assert status == 200 and one["worker_id"] == wid and one["body"]["weight_version"], one
