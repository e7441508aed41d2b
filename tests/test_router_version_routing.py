"""Weight-version policies through a real router in front of two real workers: a rolling update leaves
one worker a version behind, and each policy decides whether it serves; answers say which version
served them; a worker whose weights the router never recorded serves under no policy.

The rolling update takes the second worker out of the registry (``DELETE /workers/{id}``), updates
the rest through the router, and registers it again: it comes back on the version it held."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests._router_fixtures import ADMIN_KEY, Fleet, auth, by_url, escaped, start_router, wait_for
from tests.procs import ManagedProcess, http_json

GENERATE = {"text": "hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
SERVED_BY = "X-Omni-Worker"


@pytest.fixture(scope="module")
def fleet(worker_fleet) -> Fleet:
    return worker_fleet(2)


@pytest.fixture
def router(fleet: Fleet) -> Iterator[tuple[ManagedProcess, str]]:
    # round_robin: consecutive requests alternate between the eligible workers, so a few show them all.
    # The policy and pending rules themselves: no catch-up from a peer (tests/test_router_catch_up.py covers that).
    proc, url = start_router(
        fleet.urls, admin_key=ADMIN_KEY, extra_args=["--policy", "round_robin", "--sync-joiners", "off"]
    )
    yield proc, url
    proc.stop()


def call(
    url: str, path: str, body: Any = GENERATE, headers: dict[str, str] | None = None
) -> tuple[int, Any, dict[str, str]]:
    """POST a JSON body; (status, parsed body or text, response headers)."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    for key, value in (headers or {}).items():
        req.add_header(key, value)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, data, got = resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        status, data, got = err.code, err.read(), dict(err.headers)
    text = data.decode()
    try:
        return status, json.loads(text), got
    except ValueError:
        return status, text, got


def served_under(url: str, policy: str | None, n: int = 4) -> set[str]:
    """The workers that served ``n`` generations asked with ``policy`` (every answer must be a 200)."""
    headers = {} if policy is None else {"X-Version-Policy": policy}
    ids = set()
    for _ in range(n):
        status, body, got = call(url, "/generate", headers=headers)
        assert status == 200, body
        ids.add(got[SERVED_BY])
    return ids


def admin(url: str, path: str, body: Any, method: str = "POST") -> Any:
    status, answer = http_json(method, url + path, body, headers=auth(), timeout=60)
    assert status in (200, 201), answer
    return answer


def worker_row(url: str, worker_url: str) -> dict[str, Any]:
    return by_url(url, ADMIN_KEY)[worker_url]


def roll_all_but(url: str, proc: ManagedProcess, left_behind: str, version: str, model: Any) -> None:
    """Update every worker but ``left_behind`` to ``version`` through the router (an update from disk: a relabel
    alone names the same weights anew), then register it again."""
    admin(url, f"/workers/{escaped(left_behind)}", None, "DELETE")
    admin(url, "/update_weights_from_disk", {"model_path": str(model), "weight_version": version})
    admin(url, "/workers", {"url": left_behind})
    wait_for(lambda: worker_row(url, left_behind)["health"] == "healthy", 30, proc, "the worker back and probed")


def test_each_policy_decides_whether_the_worker_left_behind_serves(router, fleet: Fleet) -> None:
    proc, url = router
    current, behind = fleet.urls
    admin(url, "/update_weight_version", {"new_version": "v1"})
    roll_all_but(url, proc, behind, "v2", fleet.model)
    rows = by_url(url, ADMIN_KEY)
    ids = {u: rows[u]["id"] for u in fleet.urls}
    assert rows[behind]["staleness"] == 1 and rows[current]["staleness"] == 0, rows
    assert rows[behind]["pending"] and "behind" in rows[behind]["pending"]
    assert rows[behind]["fleet_sequence"] == rows[current]["fleet_sequence"] - 1

    assert served_under(url, None) == {ids[current]}
    assert served_under(url, "latest-only") == {ids[current]}
    assert served_under(url, "max-staleness:1") == set(ids.values())
    assert served_under(url, "min-version:v1") == set(ids.values())
    assert served_under(url, "min-version:v2") == {ids[current]}
    headers = {"x-smg-version-policy": "any"}  # SGLang Model Gateway's spelling of the header
    assert {call(url, "/generate", headers=headers)[2][SERVED_BY] for _ in range(4)} == set(ids.values())

    roll_all_but(url, proc, behind, "v3", fleet.model)
    assert worker_row(url, behind)["staleness"] == 2
    assert served_under(url, "max-staleness:1") == {ids[current]}
    assert served_under(url, "max-staleness:2") == set(ids.values())

    status, history = http_json("GET", url + "/fleet/versions", headers=auth(), timeout=10)
    assert status == 200, history
    assert [e["weight_version"] for e in history["history"]][-3:] == ["v1", "v2", "v3"]
    assert history["workers"][ids[behind]]["staleness"] == 2


def test_no_eligible_worker_is_a_503_that_says_why_and_a_bad_policy_a_400(router, fleet: Fleet) -> None:
    proc, url = router
    current, behind = fleet.urls
    admin(url, "/update_weight_version", {"new_version": "v1"})
    roll_all_but(url, proc, behind, "v2", fleet.model)
    admin(url, f"/workers/{escaped(current)}", {"disabled": True}, "PUT")

    status, body, headers = call(url, "/generate", headers={"X-Version-Policy": "max-staleness:0"})
    assert status == 503 and headers.get("Retry-After"), body
    message = body["error"]["message"]
    assert "max-staleness:0" in message and "'v1'" in message and "stale" in message, body
    assert body["version_policy"] == "max-staleness:0" and body["workers"], body
    status, body, headers = call(url, "/generate")  # latest-only
    assert status == 503 and headers.get("Retry-After") and "no routable worker" in body["error"]["message"]
    assert served_under(url, "max-staleness:1") == {worker_row(url, behind)["id"]}

    before = by_url(url, ADMIN_KEY)
    for bad in ("sometimes", "max-staleness:-1", "min-version:not-a-recorded-version"):
        status, body, _ = call(url, "/generate", headers={"X-Version-Policy": bad})
        assert status == 400 and "X-Version-Policy" in body["error"]["message"], (bad, body)
    assert by_url(url, ADMIN_KEY) == before

    status, text = http_json("GET", url + "/metrics", timeout=10)
    assert status == 200
    assert 'omni_router_version_policy_refusals_total{policy="max-staleness"} 1.0' in text, text
    assert 'omni_router_candidates_filtered_total{reason="fenced"}' in text
    assert 'omni_router_candidates_filtered_total{reason="stale"}' in text


def test_weights_changed_behind_the_router_or_a_restart_serve_under_no_policy(router, fleet: Fleet) -> None:
    proc, url = router
    first, second = fleet.urls
    admin(url, "/update_weight_version", {"new_version": "v1"})
    ids = {u: w["id"] for u, w in by_url(url, ADMIN_KEY).items()}

    status, body = http_json("POST", second + "/update_weight_version", {"new_version": "rogue"}, timeout=30)
    assert status == 200, body
    wait_for(lambda: worker_row(url, second)["weight_version"] == "rogue", 30, proc, "the router to see the change")
    assert worker_row(url, second)["fleet_sequence"] is None
    for policy in ("latest-only", "max-staleness:5", "min-version:v1", "any"):
        assert served_under(url, policy) == {ids[first]}, policy

    restarted = fleet.procs[0]
    restarted.kill()
    restarted.start().wait_http_ready(first + "/health", timeout=120)

    def back_unrecorded() -> bool:
        row = worker_row(url, first)
        return row["health"] == "healthy" and row["fleet_sequence"] is None

    wait_for(back_unrecorded, 30, proc, "the router to see the restarted worker back, unrecorded")
    status, body, _ = call(url, "/generate", headers={"X-Version-Policy": "any"})
    assert status == 503 and "unrecorded weights" in body["error"]["message"], body
    # A new label vouches for no weights: both stay unrecorded after a relabel through the router.
    admin(url, "/update_weight_version", {"new_version": "v2"})
    assert all(worker_row(url, u)["fleet_sequence"] is None for u in fleet.urls)
    # Whole again: one update through the router brings both to a recorded version.
    admin(url, "/update_weights_from_disk", {"model_path": str(fleet.model), "weight_version": "v3"})
    assert served_under(url, "latest-only") == set(ids.values())


def test_answers_say_which_version_served_them(router, fleet: Fleet) -> None:
    _, url = router
    admin(url, "/update_weight_version", {"new_version": "v7"})
    status, body, headers = call(url, "/generate")
    assert status == 200 and body["meta_info"]["weight_version"] == "v7", body
    assert headers["X-Weight-Version"] == "v7" and headers["x-smg-weight-version"] == "v7"
    assert "X-Mixed-Weight-Versions" not in headers

    status, text, headers = call(url, "/generate", {**GENERATE, "stream": True})
    assert status == 200 and "data:" in text
    assert headers["X-Weight-Version"] == "v7" and headers["x-smg-weight-version"] == "v7"

    completion = {"model": "default", "prompt": "hello", "max_tokens": 2, "temperature": 0.0}
    status, body, headers = call(url, "/v1/completions", completion)
    assert status == 200, body
    assert headers["X-Weight-Version"] == "v7"


def test_the_routers_pause_and_continue_show_in_the_registry(router, fleet: Fleet) -> None:
    _, url = router
    admin(url, "/pause_generation", {"mode": "retract"})
    assert all(w["paused"] for w in by_url(url, ADMIN_KEY).values())
    admin(url, "/continue_generation", {})
    assert not any(w["paused"] for w in by_url(url, ADMIN_KEY).values())
    assert served_under(url, None) == {w["id"] for w in by_url(url, ADMIN_KEY).values()}


def test_data_planes_route_by_policy_and_their_counts_reach_the_metrics(fleet: Fleet) -> None:
    proc, url = start_router(
        fleet.urls,
        admin_key=ADMIN_KEY,
        # What is under test is routing by policy, not the fence's bound: on a machine loaded by the rest of the
        # suite a data plane has taken over the default 5 s to acknowledge a fence (tests/test_router_processes.py
        # tests that bound itself).
        extra_args=["--data-plane-processes", "2", "--policy", "round_robin", "--data-plane-ack-timeout-s", "20"],
    )
    try:
        current, behind = fleet.urls
        admin(url, "/update_weight_version", {"new_version": "v1"})
        roll_all_but(url, proc, behind, "v2", fleet.model)
        # The worker's probe found it healthy in the control process; the data planes learn it from the next
        # snapshot. An admin call answers only once every data plane applied the state as it is now.
        admin(url, "/flush_cache", {})
        ids = {u: w["id"] for u, w in by_url(url, ADMIN_KEY).items()}
        assert served_under(url, None, 6) == {ids[current]}
        assert served_under(url, "max-staleness:1", 6) == set(ids.values())
        status, text = http_json("GET", url + "/metrics", timeout=10)
        assert status == 200 and 'omni_router_candidates_filtered_total{reason="stale"}' in text, text
        assert f'omni_router_worker_staleness{{worker="{ids[behind]}"}} 1.0' in text
    finally:
        proc.stop()
