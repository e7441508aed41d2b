"""Admin broadcast through a real router to two real workers that share its admin
key: auth, the update lock, fencing and fail-closed bookkeeping, rank checks."""

from __future__ import annotations

import threading
import time

import pytest

from tests._router_fixtures import ADMIN_KEY, Fleet, auth, by_url, generate_via, start_router, wait_for, workers
from tests.procs import free_port, http_json

#: The rendezvous a group init asks the workers for: a worker contacted waits this long for a trainer.
RENDEZVOUS_S = 60
#: Far below RENDEZVOUS_S and far above the milliseconds a refusal at the router takes.
REFUSED_WITHIN_S = 20


@pytest.fixture(scope="module")
def fleet(worker_fleet) -> Fleet:
    return worker_fleet(2, extra_args=["--admin-api-key", ADMIN_KEY], seeds=(0, 1))


@pytest.fixture
def router(fleet: Fleet, tmp_path):
    proc, url = start_router(
        fleet.urls, admin_key=ADMIN_KEY, state_dir=tmp_path / "state", extra_args=["--admin-lock-timeout-s", "1"]
    )
    yield url, proc
    proc.stop()


def post(url: str, path: str, body=None, key: str | None = ADMIN_KEY, timeout: float = 120):
    return http_json("POST", url + path, {} if body is None else body, headers=auth(key), timeout=timeout)


def test_the_key_reaches_workers(router, fleet):
    """Every route's 401 without the key is checked in-process (test_router_policy); here the
    workers demand the same key, so a broadcast succeeds only if the router forwarded it."""
    url, _ = router
    status, body = post(url, "/pause_generation", {"mode": "retract"})
    assert status == 200, body
    assert [r["status_code"] for r in body["results"]] == [200, 200]
    status, body = post(url, "/continue_generation")
    assert status == 200, body
    # Caller mistakes are 400 at the router, before any worker is touched.
    status, body = post(url, "/pause_generation", {"mode": "sideways"})
    assert status == 400 and "mode" in body["error"]["message"]
    assert all(not w["disabled"] for w in workers(url, ADMIN_KEY))


def test_update_from_disk_moves_the_whole_fleet(router, fleet):
    url = router[0]
    model, (other,) = fleet.model, fleet.others
    status, before, _ = generate_via(url, "abc", 8)
    assert status == 200
    status, body = post(url, "/update_weights_from_disk", {"model_path": str(other), "weight_version": "v1"})
    assert status == 200, body
    assert body["worker_count"] == 2 and all(r["success"] for r in body["results"])
    assert {w["weight_version"] for w in workers(url, ADMIN_KEY)} == {"v1"}
    assert all(not w["disabled"] for w in workers(url, ADMIN_KEY))
    status, info = http_json("GET", url + "/model_info", headers=auth())
    assert status == 200 and info["weight_version"] == "v1"
    status, after, _ = generate_via(url, "abc", 8)
    assert after["meta_info"]["weight_version"] == "v1" and after["output_ids"] != before["output_ids"]
    status, body = post(url, "/update_weights_from_disk", {"model_path": str(model), "weight_version": "default"})
    assert status == 200, body


def test_a_refusal_by_every_worker_is_their_4xx_and_fences_nothing(router, fleet):
    """A caller's mistake that only the workers can see (a path that does not exist on them) changes
    nothing: the router answers with the workers' own status and message, fences no one, journals
    nothing. (Failing closed when a worker's weights may differ is tested with unreachable
    workers in-process, test_router_policy, and with killed processes, test_router_failures.)"""
    url, _ = router
    sums = {u: http_json("POST", u + "/weights_checker", {}, headers=auth())[1]["per_gpu_checksum"] for u in fleet.urls}
    for bad in ("/nonexistent/checkpoint", "/etc", "/proc/self"):
        status, body = post(url, "/update_weights_from_disk", {"model_path": bad})
        assert status == 400, body
        assert body["error"]["message"] == body["message"] and "model_path" in body["message"]
        assert [(r["success"], r["status_code"], r["body"]["weights"]) for r in body["results"]] == [
            (False, 400, "intact")
        ] * 2
        assert not any(w["disabled"] for w in workers(url, ADMIN_KEY))
        assert http_json("GET", url + "/weight_update_journal", headers=auth())[1]["pending"] is None
    status, body = post(url, "/destroy_weights_update_group", {"group_name": "never-made"})
    assert status == 400 and "does not exist" in body["error"]["message"]
    assert generate_via(url)[0] == 200
    assert post(url, "/pause_generation", {"mode": "retract"})[0] == 200  # the next update proceeds at once
    assert post(url, "/continue_generation")[0] == 200
    assert {
        u: http_json("POST", u + "/weights_checker", {}, headers=auth())[1]["per_gpu_checksum"] for u in fleet.urls
    } == sums


def test_wrong_world_size_is_400_before_any_worker_is_contacted(router):
    url, _ = router
    status, body = http_json("GET", url + "/get_world_size", headers=auth())
    assert status == 200 and body["world_size"] == 2
    assert [w["rank_offset"] for w in body["workers"]] == [1, 2]
    start = time.monotonic()
    init = {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2, "timeout_s": RENDEZVOUS_S}
    status, body = post(url, "/init_weights_update_group", init)
    assert status == 400 and body["expected_world_size"] == 3
    assert "world_size must be 3" in body["error"]["message"]
    # Not a speed check: a router that contacted the workers would answer only after their
    # RENDEZVOUS_S wait for a trainer that never comes.
    assert time.monotonic() - start < REFUSED_WITHIN_S
    assert http_json("GET", url + "/weight_update_journal", headers=auth())[1]["pending"] is None
    assert all(not w["disabled"] for w in workers(url, ADMIN_KEY))


def test_update_lock_contention_registry_409_and_failed_init_fences(router, fleet):
    url, proc = router
    # A group init whose trainer never shows up holds the update lock until the workers give up.
    init = {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": 3, "timeout_s": 6}
    answer: dict = {}
    thread = threading.Thread(
        target=lambda: answer.update(r=post(url, "/init_weights_update_group", init, timeout=120))
    )
    thread.start()
    try:
        wait_for(lambda: all(w["disabled"] for w in workers(url, ADMIN_KEY)), 10, proc, "targets disabled")
        # Another update cannot get the lock: 503 at the (1 s) lock timeout, while the init still
        # holds the lock (a pause queued behind the init would be answered only once it ended).
        status, body = post(url, "/pause_generation", {"mode": "retract"})
        assert status == 503 and "lock not acquired within 1s" in body["error"]["message"]
        assert thread.is_alive() and "r" not in answer
        # The registry is frozen while the update runs.
        some = workers(url, ADMIN_KEY)[0]
        assert post(url, "/workers", {"url": f"http://127.0.0.1:{free_port()}"})[0] == 409
        assert http_json("PUT", f"{url}/workers/{some['id']}", {"disabled": False}, headers=auth())[0] == 409
        assert http_json("DELETE", f"{url}/workers/{some['id']}", headers=auth())[0] == 409
        # No generation reaches a worker that is in the update.
        status, body, worker = generate_via(url)
        assert status == 503 and worker is None
    finally:
        thread.join(60)
    status, body = answer["r"]
    assert status == 502, body
    assert len(body["results"]) == 2 and not any(r["success"] for r in body["results"])
    assert sorted(r["rank_offset"] for r in body["ranks"]) == [1, 2]
    # Failed init: workers stay disabled until an operator re-enables them, one by one.
    assert all(w["disabled"] for w in workers(url, ADMIN_KEY))
    for w in workers(url, ADMIN_KEY):
        assert http_json("PUT", f"{url}/workers/{w['id']}", {"disabled": False}, headers=auth())[0] == 200
    assert http_json("GET", url + "/weight_update_journal", headers=auth())[1]["pending"] is None
    assert generate_via(url)[0] == 200
    assert {w["health"] for w in by_url(url, ADMIN_KEY).values()} == {"healthy"}
    assert all(p.alive for p in fleet.procs)  # the fleet itself is untouched
