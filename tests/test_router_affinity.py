"""Session affinity through a real router in front of three real workers: the turns of a session
land on one worker (``X-Omni-Worker`` says which), a session leaves a disabled worker and does not
come back to it, data-plane processes agree without sharing a table, and it is off by default."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Any

import pytest

from router.gateway.fleet.registry import Worker
from router.gateway.routing.affinity import SessionAffinity
from tests._router_fixtures import Fleet, start_router, workers
from tests.procs import free_port, http_json

#: ``round_robin`` spreads requests without a key over every worker, so a pin is visible as the lack of it.
AFFINITY = ["--session-affinity", "--policy", "round_robin"]


@pytest.fixture(scope="module")
def fleet(worker_fleet) -> Fleet:
    return worker_fleet(3)


def generate(url: str, headers: dict[str, str] | None = None, **body: Any) -> str:
    """POST /generate through the router; the id of the worker that served it."""
    payload = {"text": "hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}, **body}
    req = urllib.request.Request(
        url + "/generate",
        data=json.dumps(payload).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200
            json.loads(resp.read())
            worker = resp.headers.get("X-Omni-Worker")
    except urllib.error.HTTPError as err:
        raise AssertionError(f"{err.code}: {err.read()!r}") from None
    assert worker
    return worker


def metric(url: str, name: str) -> float:
    status, text = http_json("GET", url + "/metrics")
    assert status == 200
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def set_disabled(url: str, worker_id: str, disabled: bool) -> None:
    status, body = http_json("PUT", f"{url}/workers/{worker_id}", {"disabled": disabled})
    assert status == 200 and body["disabled"] is disabled, body


@pytest.fixture
def router(fleet: Fleet):
    proc, url = start_router(fleet.urls, extra_args=AFFINITY)
    yield url
    proc.stop()


def test_turns_of_a_session_land_on_one_worker(router: str) -> None:
    url = router
    by_header = {f"sid-{i}": {generate(url, {"X-Session-Id": f"sid-{i}"}) for _ in range(4)} for i in range(4)}
    assert all(len(served) == 1 for served in by_header.values()), by_header
    smg = {generate(url, {"X-SMG-Routing-Key": "smg-conversation"}) for _ in range(3)}
    assert len(smg) == 1
    # Without a header the caller's rid names the session: every turn and retry of ``conv`` shares it.
    lineage = {generate(url, rid=rid) for rid in ("conv_t1", "conv_t2", "conv_t2_r1", "conv_r3_t3")}
    assert len(lineage) == 1
    # Requests without a key follow the policy: round robin reaches every worker.
    assert len({generate(url) for _ in range(3)}) == 3
    assert metric(url, "omni_router_affinity_pinned_sessions") == 6
    assert metric(url, "omni_router_affinity_new_pins_total") == 6
    assert metric(url, "omni_router_affinity_hits_total") == 4 * 3 + 2 + 3


def test_a_session_leaves_a_disabled_worker_and_does_not_bounce_back(router: str) -> None:
    url = router
    session = {"X-Session-Id": "rollout-7"}
    pinned = generate(url, session)
    set_disabled(url, pinned, True)
    try:
        moved = generate(url, session)
        assert moved != pinned
        assert generate(url, session) == moved
    finally:
        set_disabled(url, pinned, False)
    assert {generate(url, session) for _ in range(3)} == {moved}
    assert metric(url, 'omni_router_affinity_reassignments_total{reason="not_eligible"}') == 1


def keys_ranked_first_on_distinct_workers(worker_ids: list[str]) -> dict[str, str]:
    """One session key per worker, each ranked first on its own worker: the load bound never diverts
    them, so every process places them alike whatever order it sees them in."""
    workers = [Worker(id=wid, url=f"http://127.0.0.1/{wid}") for wid in worker_ids]
    unbounded = SessionAffinity(ttl_s=60.0, load_factor=1e9, max_sessions=1000)
    first: dict[str, str] = {}
    for i in range(1000):
        worker = unbounded.choose(f"s{i}", workers).id
        if worker not in first.values():
            first[f"s{i}"] = worker
        if len(first) == len(workers):
            return first
    raise AssertionError("no keys found")


def test_data_plane_processes_agree_without_sharing_a_table(fleet: Fleet) -> None:
    """Each request is a new connection, which the kernel spreads over the processes."""
    proc, url = start_router(
        fleet.urls, port=free_port(), extra_args=[*AFFINITY, "--data-plane-processes", "2"], wait_healthy=3
    )
    try:
        expected = keys_ranked_first_on_distinct_workers([w["id"] for w in workers(url)])
        served = {key: {generate(url, {"X-Session-Id": key}) for _ in range(6)} for key in expected}
        assert served == {key: {worker} for key, worker in expected.items()}
    finally:
        proc.stop()


def test_affinity_is_off_by_default(fleet: Fleet) -> None:
    proc, url = start_router(fleet.urls, extra_args=["--policy", "round_robin"])
    try:
        assert len({generate(url, {"X-Session-Id": "same"}) for _ in range(3)}) == 3
        assert metric(url, "omni_router_affinity_pinned_sessions") == 0
    finally:
        proc.stop()
