"""SGLang 0.5.23's begin/end_weight_update bracket: accepted (miles sends it), never required (slime)."""

from __future__ import annotations

import pytest

from tests._router_fixtures import start_router, workers
from tests.procs import http_json


def _post(url, path, body=None):
    return http_json("POST", url + path, body if body is not None else {})


@pytest.fixture(scope="module")
def fleet(worker_fleet) -> list[str]:
    return worker_fleet(2).urls


def test_bracket_on_one_worker(fleet):
    url = fleet[0]
    status, body = _post(url, "/begin_weight_update", {"selector": "all"})
    assert status == 200 and body["success"] is True
    status, body = _post(url, "/begin_weight_update", {"selector": "all"})
    assert status == 400 and "already open" in body["message"] and "already open" in body["error"]["message"]
    assert _post(url, "/end_weight_update")[0] == 200
    status, body = _post(url, "/end_weight_update")
    assert status == 200 and "no weight-update bracket was open" in body["message"]
    # Caller mistakes are 400 and open nothing.
    assert _post(url, "/begin_weight_update", {"selector": "sideways"})[0] == 400
    status, body = _post(url, "/begin_weight_update", {"selector": "draft"})
    assert status == 400 and "no draft model" in body["message"]
    assert _post(url, "/begin_weight_update", {"selector": "target"})[0] == 200
    assert _post(url, "/end_weight_update")[0] == 200


def test_bracket_through_the_router_reaches_every_worker_and_fences_nothing(fleet, tmp_path):
    proc, url = start_router(fleet, state_dir=tmp_path / "state")
    try:
        status, body = _post(url, "/begin_weight_update", {"selector": "all"})
        assert status == 200 and body["worker_count"] == 2, body
        status, body = _post(url, "/begin_weight_update", {})
        # Every worker refused before touching anything: their 4xx, and nothing fenced.
        assert status == 400 and [("already open" in r["body"]["message"]) for r in body["results"]] == [True, True]
        # The bracket changes no weights, so a refused begin takes no worker out of routing.
        assert not any(w["disabled"] for w in workers(url))
        assert _post(url, "/end_weight_update")[0] == 200
        assert _post(url, "/begin_weight_update", {"selector": "bogus"})[0] == 400  # checked at the router
        assert http_json("GET", url + "/weight_update_journal")[1]["pending"] is None
    finally:
        proc.stop()
