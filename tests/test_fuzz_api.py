"""Fuzz every route of a live router from its own ``/openapi.json``; the worker's routes, fuzzed
directly, are in tests/test_fuzz_worker_api.py (its own file, so the two runs share the xdist workers).

Real processes: one worker behind a router. Each operation gets schemathesis cases (valid and
schema-breaking) and structural garbage; every case must answer within the hang bound, never 500,
5xx only where a worker really failed or the route is documented as not implemented, and a 4xx
must carry ``error.message``.

Fences: after every refused (4xx) call through the router, no worker is disabled that
was not before, no worker is pending, and the update journal is empty: a caller's
mistake changes nothing. The fenced routes are fuzzed once more while the router's
worker holds partial weights (released without a copy, then resumed): a refusal then
changes nothing either (the worker stays pending, unfenced), and a worker whose weights
are partial is never routable.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from schemathesis import GenerationMode

from router.gateway.admin.operations import OPERATIONS
from tests import _fuzz
from tests._router_fixtures import ADMIN_KEY, auth, start_router, workers

pytestmark = [pytest.mark.timeout(900), pytest.mark.schedule_weight(40)]

#: Cases per fenced route and generation mode while the router's worker holds partial weights.
PARTIAL_EXAMPLES = 3


@pytest.fixture(scope="module")
def servers(worker_fleet, checkpoints, tmp_path_factory):
    fleet = worker_fleet(1, extra_args=["--admin-api-key", ADMIN_KEY], model=checkpoints["llama"])
    (behind,) = fleet.urls
    router, url = start_router([behind], admin_key=ADMIN_KEY, state_dir=tmp_path_factory.mktemp("fuzz-state"))
    yield {"router": url, "behind": behind, "model": str(checkpoints["llama"]), "procs": [router, *fleet.procs]}
    router.stop()


class _Fleet:
    """The router's fleet as the checks read it and the harness restores it, over kept-alive connections.

    ``settled`` is what :meth:`state` read right after the last restore. A case that leaves
    :meth:`state` as it was then changed nothing that a restore undoes (which workers there are
    and which are disabled or pending, the journal, and the worker's pause, sleep, memory, weights
    and open updates), so restoring again would do nothing: it is skipped. A weight-update group
    is the one thing a restore undoes that no route shows; only a join that succeeded makes one,
    and every case that succeeded is restored."""

    def __init__(self, client: _fuzz.Client, url: str, behind: str, model: str, keep: set[str]) -> None:
        self.client, self.url, self.behind, self.model, self.keep = client, url, behind, model, keep
        self.settled: tuple[Any, ...] | None = None

    def call(self, method: str, url: str, body: Any = None, timeout: float = 10) -> tuple[int, Any]:
        return self.client.call(method, url, body, headers=auth(), timeout=timeout)

    def workers(self) -> list[dict[str, Any]]:
        status, body = self.call("GET", self.url + "/workers")
        assert status == 200, body
        return body["workers"]

    def state(self) -> tuple[Any, ...]:
        """``(fence, everything else a restore acts on)``: ``fence`` is :func:`_fence`'s tuple."""
        fleet = self.workers()
        journal = self.call("GET", self.url + "/weight_update_journal")[1]
        health = self.call("GET", self.behind + "/health")[1]
        sleeping = self.call("GET", self.behind + "/is_sleeping")[1]
        records = sorted((w["id"], w["url"], w.get("paused"), w.get("asleep"), w.get("weight_version")) for w in fleet)
        # The journal's storage health is left out: no case changes it and restores do not act on it.
        return _fence(fleet, journal), (records, journal["pending"], health, sleeping)

    def fence_state(self) -> tuple[Any, ...]:
        return _fence(self.workers(), self.call("GET", self.url + "/weight_update_journal")[1])

    def weights_partial(self) -> bool:
        """Weights released without a copy (``keep_weights: false``) come back partial: reload them."""
        return self.call("GET", self.behind + "/health")[1].get("weight_state") == "partial"

    def restore(self) -> None:
        """Undo what a successful or failed case left: extra workers, fences, a paused or released worker."""
        for w in self.workers():
            if w["id"] not in self.keep:
                self.call("DELETE", f"{self.url}/workers/{w['id']}")
            elif w["disabled"]:
                self.call("PUT", f"{self.url}/workers/{w['id']}", {"disabled": False})
        self.call("POST", self.url + "/weight_update_journal/resolve", {"acknowledge": True})
        _fuzz.restore_worker(self.client, self.url)
        if self.weights_partial():  # through the router, so its record of the fleet's weights follows
            self.call("POST", self.url + "/update_weights_from_disk", {"model_path": self.model}, timeout=60)
        self.settled = self.state()

    def partial_weights(self) -> None:
        """Through the router: release the weights without a copy and resume them. The worker's weights are
        partial (it serves nothing) until updates rewrite every tensor; the router holds it pending."""
        for path, body in (
            ("/release_memory_occupation", {"tags": ["weights"], "keep_weights": False}),
            ("/resume_memory_occupation", {"tags": ["weights"]}),
        ):
            status, answer = self.call("POST", self.url + path, body, timeout=30)
            assert status == 200, (path, status, answer)
        assert self.weights_partial()


def _fence(fleet: list[dict[str, Any]], journal: dict[str, Any]) -> tuple[Any, ...]:
    """Disabled workers, pending workers, and whether the journal holds an update."""
    return (
        sorted(w["id"] for w in fleet if w["disabled"]),
        sorted(w["id"] for w in fleet if w.get("pending")),
        journal["pending"] is not None,
    )


def _processes_alive(servers) -> None:
    for proc in servers["procs"]:
        assert proc.alive, proc.log_text()


@pytest.fixture
def client():
    client = _fuzz.Client()
    yield client
    client.close()


def _router_fleet(servers, client: _fuzz.Client) -> _Fleet:
    url = servers["router"]
    keep = {w["id"] for w in workers(url, ADMIN_KEY)}
    return _Fleet(client, url, servers["behind"], servers["model"], keep)


def test_fuzz_every_router_route(servers, client):
    fleet = _router_fleet(servers, client)
    fleet.settled = fleet.state()
    tally = _fuzz.run_fuzz(client, fleet.url, restore=fleet.restore, fleet=fleet)
    print(f"router fuzz: {tally.summary()}")
    assert not tally.problems, "\n".join(tally.problems[:40])
    assert tally.cases >= 300, tally.summary()
    _processes_alive(servers)
    # The fleet is whole and serves afterwards.
    fleet.restore()
    assert all(not w["disabled"] and not w.get("pending") for w in workers(fleet.url, ADMIN_KEY))


def test_fuzz_fenced_routes_on_partial_weights(servers, client):
    fleet = _router_fleet(servers, client)
    url, keep = fleet.url, fleet.keep
    fenced = {path for path, op in OPERATIONS.items() if op.fenced}
    rng = random.Random(1)
    tally = _fuzz.Tally()
    headers = {**auth(), "Content-Type": "application/json"}
    fleet.partial_weights()
    baseline = fleet.fence_state()
    assert baseline == ([], sorted(keep), False), baseline  # pending (partial weights), not fenced

    def execute(label: str, case: Any) -> None:
        method, case_url, data, detail = _fuzz.case_request(case, url, rng)
        try:
            answer = client.send(method, case_url, data=data, headers=headers)
        except TimeoutError:
            raise AssertionError(f"no answer within {_fuzz.HANG_S + 30:.0f}s: {label} {detail[:500]}") from None
        tally.record(label, answer, detail, allowed_5xx=_fuzz.allowed_5xx(case.operation.path, via_router=True))
        after = fleet.fence_state()
        if 400 <= answer.status < 500 and after != baseline:
            tally.problems.append(f"a refusal changed the fleet: {label} {detail[:200]}: {baseline} -> {after}")
        pending = set(after[1])
        if fleet.weights_partial() and not keep <= pending:
            tally.problems.append(f"a worker with partial weights is routable after {label} {detail[:200]}: {after}")
        if not 400 <= answer.status < 500 or after != baseline:
            fleet.restore()
            fleet.partial_weights()
            again = fleet.fence_state()
            if again != baseline:
                tally.problems.append(f"the harness could not restore partial weights after {label}: {again}")

    for op in _fuzz.operations(_fuzz.openapi_doc(url)):
        if op.path not in fenced or op.method.upper() != "POST":
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            tag = f"POST {op.path} [{mode.value}, partial weights]"
            _fuzz.run_generated(op, mode, PARTIAL_EXAMPLES, lambda case, tag=tag: execute(tag, case))
    print(f"router fuzz on partial weights: {tally.summary()}")
    assert not tally.problems, "\n".join(tally.problems[:40])
    assert tally.cases >= 2 * len(fenced), tally.summary()
    _processes_alive(servers)
    # Reloaded through the router, the fleet is whole and serves again.
    fleet.restore()
    assert all(not w["disabled"] and not w.get("pending") for w in workers(url, ADMIN_KEY))
