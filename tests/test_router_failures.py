"""Crashes during an update: the router dies (SIGKILL) mid-broadcast and comes
back with the same state dir; a worker dies mid-broadcast. Either way the
targets stay out of routing until an operator resolves it."""

from __future__ import annotations

import threading

import pytest

from tests._router_fixtures import ADMIN_KEY, Fleet, auth, by_url, generate_via, start_router, wait_for, workers
from tests.procs import free_port, http_json


@pytest.fixture(scope="module")
def trio(worker_fleet) -> Fleet:
    return worker_fleet(3, extra_args=["--admin-api-key", ADMIN_KEY])


def hanging_init(router_url: str, answer: dict, timeout_s: float = 3.0) -> threading.Thread:
    """A group init nobody completes: the workers wait ``timeout_s`` for a trainer that never comes.

    The tests kill a process right after the router fenced the targets, long before that wait ends (it
    starts as the router forwards the init, after the fence); the survivor's 400 at its end ends the call.

    Each init names a group of its own: a worker still joining an earlier test's group would
    refuse the same name at once, before any join, and a refusal fences nothing."""
    port = free_port()
    body = {"master_address": "127.0.0.1", "master_port": port, "world_size": 3, "timeout_s": timeout_s,
            "group_name": f"hanging-{port}"}  # fmt: skip

    def call() -> None:
        try:
            answer["r"] = http_json(
                "POST", router_url + "/init_weights_update_group", body, headers=auth(), timeout=120
            )
        except OSError as exc:  # the router was killed under us
            answer["error"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


def test_router_killed_mid_update_restarts_with_targets_disabled(trio, tmp_path):
    urls = trio.urls[:2]
    state = tmp_path / "state"
    proc, url = start_router(urls, admin_key=ADMIN_KEY, state_dir=state)
    port = int(url.rsplit(":", 1)[1])
    answer: dict = {}
    thread = hanging_init(url, answer)

    def mid_update() -> bool:
        # The fence shows in the registry before its journal entry is on disk; until both hold nothing is
        # sent, and a router killed then rightly comes back with nothing fenced. Killed once the entry is
        # written (atomically: the file exists whole or not at all), the update may have reached the workers.
        return (state / "update_journal.json").exists() and all(w["disabled"] for w in workers(url, ADMIN_KEY))

    try:
        wait_for(mid_update, 10, proc, "targets disabled and the update journaled")
        proc.kill()  # SIGKILL: no cleanup runs
    finally:
        thread.join(30)
    assert "error" in answer
    proc, url = start_router(urls, admin_key=ADMIN_KEY, state_dir=state, port=port)
    try:
        # Healthy, yet disabled: their weights are uncertain after the interrupted update.
        fleet = workers(url, ADMIN_KEY)
        assert [(w["health"], w["disabled"]) for w in fleet] == [("healthy", True), ("healthy", True)]
        status, journal = http_json("GET", url + "/weight_update_journal", headers=auth())
        pending = journal["pending"]
        assert pending["state"] == "failed" and pending["path"] == "/init_weights_update_group"
        assert "router stopped" in pending["reason"]
        assert generate_via(url)[0] == 503
        status, body = http_json("POST", url + "/pause_generation", {"mode": "retract"}, headers=auth())
        assert status == 409
        # The operator vouches for the fleet.
        status, body = http_json("POST", url + "/weight_update_journal/resolve", {"acknowledge": True}, headers=auth())
        assert status == 200 and body["resolved"]
        assert not any(w["disabled"] for w in workers(url, ADMIN_KEY))
        assert generate_via(url)[0] == 200
        assert not (state / "update_journal.json").exists()
    finally:
        proc.stop()


def test_worker_killed_mid_broadcast_is_502_with_every_result_and_fenced(trio, tmp_path):
    survivor_url, (victim, victim_url) = trio.urls[1], (trio.procs[2], trio.urls[2])
    proc, url = start_router(
        [survivor_url, victim_url],
        admin_key=ADMIN_KEY,
        state_dir=tmp_path / "state",
        extra_args=["--health-failure-threshold", "1", "--health-dead-threshold", "2"],
    )
    try:
        answer: dict = {}
        thread = hanging_init(url, answer)
        wait_for(lambda: all(w["disabled"] for w in workers(url, ADMIN_KEY)), 10, proc, "targets disabled")
        ids = {u: w["id"] for u, w in by_url(url, ADMIN_KEY).items()}
        victim.kill()
        # While the broadcast runs, nothing is routed to either target.
        assert generate_via(url)[0] == 503
        thread.join(60)
        status, body = answer["r"]
        assert status == 502, body
        results = {r["worker"]: r for r in body["results"]}
        assert set(results) == {ids[survivor_url], ids[victim_url]}
        assert results[ids[victim_url]]["error"] and results[ids[victim_url]]["status_code"] is None
        assert (
            results[ids[survivor_url]]["status_code"] == 400 and results[ids[survivor_url]]["body"]["success"] is False
        )
        assert all(r["elapsed_ms"] > 0 for r in body["results"])  # each result reports its own duration
        # Fail closed: both stay disabled; the dead one is eventually marked dead.
        wait_for(lambda: by_url(url, ADMIN_KEY)[victim_url]["health"] == "dead", 20, proc, "victim dead")
        assert all(w["disabled"] for w in workers(url, ADMIN_KEY))
        # The operator re-enables the survivor only; traffic goes there and never to the dead worker.
        assert http_json("PUT", f"{url}/workers/{ids[survivor_url]}", {"disabled": False}, headers=auth())[0] == 200
        for _ in range(4):
            status, _, served = generate_via(url)
            assert status == 200 and served == ids[survivor_url]
        # Broadcasts skip the dead worker.
        status, body = http_json("GET", url + "/model_info", headers=auth())
        assert status == 200 and body["worker_count"] == 1
    finally:
        proc.stop()
