"""Request routing and the worker registry, through a real router in front of
two real workers (no admin key here; auth is covered in test_router_admin)."""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest

from tests._router_fixtures import Fleet, by_url, escaped, generate_via, start_router, wait_for, workers
from tests.procs import free_port, http_json

#: Far above the moment a 503 takes; a router that held a request until a worker became routable
#: would hold it past this (nothing is re-enabled until it answers), and its caller's read times out.
ANSWERED_WITHIN_S = 20


@pytest.fixture(scope="module")
def fleet(worker_fleet) -> Fleet:
    return worker_fleet(2, extra_args=["--step-delay-ms", "20"])


@pytest.fixture
def router(fleet: Fleet):
    proc, url = start_router(fleet.urls, extra_args=["--policy", "round_robin"])
    yield url, proc
    proc.stop()


def test_generate_spreads_over_routable_workers_and_passes_body_through(router, fleet):
    url, _ = router
    served = set()
    for _ in range(4):
        status, body, worker = generate_via(url)
        assert status == 200, body
        assert body["meta_info"]["weight_version"] == "default"
        served.add(worker)
    assert served == {w["id"] for w in workers(url)}


def test_disabled_worker_gets_no_traffic_and_none_routable_is_503(router, fleet):
    url, _proc = router
    first, second = workers(url)
    status, body = http_json("PUT", f"{url}/workers/{first['id']}", {"disabled": True})
    assert status == 200 and body["disabled"] is True
    for _ in range(4):
        status, _, worker = generate_via(url)
        assert status == 200 and worker == second["id"]
    # Disabling by URL-escaped url works too; now nothing is routable: 503 at once, with the reason.
    status, _ = http_json("PUT", f"{url}/workers/{escaped(second['url'])}", {"disabled": True})
    assert status == 200
    status, body, worker = generate_via(url, timeout=ANSWERED_WITHIN_S)
    assert status == 503 and worker is None
    assert "no routable worker" in body["error"]["message"] and "2 disabled" in body["error"]["message"]
    status, body = http_json("GET", url + "/readiness")
    assert status == 503 and body["status"] == "not_ready"
    for w in (first, second):
        assert http_json("PUT", f"{url}/workers/{w['id']}", {"disabled": False})[0] == 200
    assert generate_via(url)[0] == 200
    assert http_json("GET", url + "/readiness")[0] == 200


def test_a_registered_worker_is_probed_at_once(router, fleet):
    """Registry CRUD and its refusals are checked in-process (test_router_policy); a real
    worker added at run time is healthy, with its tp_size, as soon as the call answers."""
    url, _ = router
    first, second = workers(url)
    status, body = http_json("DELETE", f"{url}/workers/{first['id']}")
    assert status == 200 and [w["id"] for w in workers(url)] == [second["id"]]
    status, body = http_json("POST", url + "/workers", {"url": first["url"]})
    assert status == 201 and body["id"] == first["id"] and body["health"] == "healthy" and body["tp_size"] == 1
    assert generate_via(url)[0] == 200


def test_dead_url_is_skipped_by_retry_and_marked_dead(fleet: Fleet):
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc, url = start_router(
        [closed, *fleet.urls],
        wait_healthy=2,
        extra_args=["--policy", "round_robin", "--health-failure-threshold", "1", "--health-dead-threshold", "2"],
    )
    try:
        wait_for(lambda: by_url(url)[closed]["health"] == "dead", 20, proc, "closed url dead")
        dead_id = by_url(url)[closed]["id"]
        for _ in range(6):
            status, body, worker = generate_via(url)
            assert status == 200 and worker != dead_id
        # A dead worker is no broadcast target either.
        status, body = http_json("POST", url + "/flush_cache", {})
        assert status == 200 and body["worker_count"] == 2
    finally:
        proc.stop()


def test_model_info_reports_common_version_or_409_when_mixed(router, fleet: Fleet):
    url, _ = router
    urls = fleet.urls
    status, body = http_json("GET", url + "/model_info")
    assert status == 200 and body["weight_version"] == "default" and body["worker_count"] == 2
    # One worker moves on behind the router's back: the fleet is mixed.
    assert (
        http_json("POST", urls[0] + "/update_weight_version", {"new_version": "v7", "abort_all_requests": False})[0]
        == 200
    )
    try:
        status, body = http_json("GET", url + "/model_info")
        assert status == 409
        assert "mixed worker weight_version" in body["error"]["message"]
        assert sorted(body["versions"].values()) == ["default", "v7"]
        assert http_json("GET", url + "/get_weight_version")[0] == 409
        assert sorted(w["weight_version"] for w in workers(url)) == ["default", "v7"]
    finally:
        assert (
            http_json(
                "POST", urls[0] + "/update_weight_version", {"new_version": "default", "abort_all_requests": False}
            )[0]
            == 200
        )
    assert http_json("GET", url + "/get_weight_version")[1]["weight_version"] == "default"


def test_weights_checker_reports_identical_fleet(router):
    url, _ = router
    status, body = http_json("POST", url + "/weights_checker", {"action": "checksum"})
    assert status == 200, body
    assert body["identical"] is True and len(set(body["worker_checksums"].values())) == 1
    assert all(r["success"] for r in body["results"])


def test_stream_and_client_disconnect_aborts_on_worker(router, fleet: Fleet):
    url, _ = router
    urls = fleet.urls
    # Streaming passes through as SSE.
    req = urllib.request.Request(
        url + "/generate",
        method="POST",
        headers={"Content-Type": "application/json"},
        data=json.dumps(
            {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
        ).encode(),
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        text = resp.read().decode()
    assert text.rstrip().endswith("data: [DONE]") and text.count("data: ") >= 2

    def total(counter: str) -> int:
        return sum(http_json("GET", u + "/server_info")[1]["internal_states"][0][counter] for u in urls)

    def aborted() -> int:
        return total("aborted_requests")

    before = aborted()
    # A long request (20 ms per step x 400 tokens) whose caller hangs up once it runs on a worker.
    body = json.dumps({"text": "long", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_for(lambda: total("num_running_reqs") == 1, 20, what="the request running on a worker")
    wait_for(lambda: aborted() > before, 15, what="request aborted on the worker")
    running = [http_json("GET", u + "/server_info")[1]["internal_states"][0]["num_running_reqs"] for u in urls]
    assert running == [0, 0]


def test_metrics_exposes_routing_and_fleet_series(router):
    url, _ = router
    generate_via(url)
    status, text = http_json("GET", url + "/metrics")
    assert status == 200
    for name in (
        "omni_router_requests_total",
        "omni_router_worker_health",
        "omni_router_worker_disabled",
        "omni_router_worker_inflight_requests",
        "omni_router_worker_weight_version_info",
    ):
        assert name in text
    assert 'route="/generate"' in text
