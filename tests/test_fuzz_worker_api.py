"""Fuzz every route of a live worker, directly, from its own ``/openapi.json``.

The router's routes are fuzzed in tests/test_fuzz_api.py, against a worker of its own: a case here
that relabels, pauses or releases this worker cannot starve the router's run, and the two files
run side by side on the two xdist workers. Each operation gets schemathesis cases (valid and
schema-breaking) and structural garbage; every case must answer within the hang bound, never
500, 5xx only where the worker really failed or the route is documented as not implemented, and
a 4xx must carry ``error.message``. A case that succeeded or failed is undone before the next.
"""

from __future__ import annotations

import pytest

from tests import _fuzz
from tests._router_fixtures import ADMIN_KEY
from tests.procs import http_json

pytestmark = [pytest.mark.timeout(900), pytest.mark.schedule_weight(30)]


@pytest.fixture(scope="module")
def server(worker_fleet, checkpoints):
    fleet = worker_fleet(1, extra_args=["--admin-api-key", ADMIN_KEY], model=checkpoints["llama"])
    return {"worker": fleet.urls[0], "model": str(checkpoints["llama"]), "procs": fleet.procs}


@pytest.fixture
def client():
    client = _fuzz.Client()
    yield client
    client.close()


def test_fuzz_every_worker_route(server, client):
    url = server["worker"]
    tally = _fuzz.run_fuzz(client, url, restore=lambda: _fuzz.restore_worker(client, url, server["model"]), fleet=None)
    print(f"worker fuzz: {tally.summary()}")
    assert not tally.problems, "\n".join(tally.problems[:40])
    assert tally.cases >= 300, tally.summary()
    for proc in server["procs"]:
        assert proc.alive, proc.log_text()
    status, body = http_json("GET", url + "/health", timeout=10)
    assert status == 200 and body["weight_state"] == "serving", body
