"""Fuzz every route of a live router and a live worker from their own ``/openapi.json``.

Real processes: one worker behind a router, a second worker fuzzed directly (so a
case that relabels or pauses it cannot starve the router's run). Each operation gets
schemathesis cases (valid and schema-breaking) and structural garbage; every case must
answer within the hang bound, never 500, 5xx only where a worker really failed or the
route is documented as not implemented, and a 4xx must carry ``error.message``.

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
from tests.procs import http_json

pytestmark = pytest.mark.timeout(900)

#: Cases per operation and generation mode: enough to reach every field, small enough for CI.
EXAMPLES = 10
#: Cases per fenced route and generation mode while the router's worker holds partial weights.
PARTIAL_EXAMPLES = 3
#: Routes that answer 501 by design (none today: ``/update_weights_from_tensor`` answers 4xx/200).
NOT_IMPLEMENTED: tuple[str, ...] = ()


@pytest.fixture(scope="module")
def servers(worker_fleet, checkpoints, tmp_path_factory):
    fleet = worker_fleet(2, extra_args=["--admin-api-key", ADMIN_KEY], model=checkpoints["llama"])
    behind, direct = fleet.urls
    router, url = start_router([behind], admin_key=ADMIN_KEY, state_dir=tmp_path_factory.mktemp("fuzz-state"))
    yield {
        "router": url,
        "behind": behind,
        "worker": direct,
        "model": str(checkpoints["llama"]),
        "procs": [router, *fleet.procs],
    }
    router.stop()


def _doc(url: str) -> dict[str, Any]:
    status, doc = http_json("GET", url + "/openapi.json", timeout=10)  # open: no key
    assert status == 200 and doc["openapi"].startswith("3.1"), doc
    return doc


def _allowed_5xx(path: str, *, via_router: bool) -> Any:
    def allowed(status: int, body: Any) -> bool:
        if status == 501:
            return path in NOT_IMPLEMENTED
        if not (isinstance(body, dict) and ("error" in body or "results" in body or "message" in body)):
            return False  # a 5xx must say why
        if via_router and status == 502:
            # The router blames a worker only with that worker's answer (or its silence) attached.
            return isinstance(body.get("results"), list)
        return status in (502, 503, 504)

    return allowed


def _fence_state(url: str) -> tuple[Any, ...]:
    fleet = workers(url, ADMIN_KEY)
    journal = http_json("GET", url + "/weight_update_journal", headers=auth(), timeout=10)[1]
    return (
        sorted(w["id"] for w in fleet if w["disabled"]),
        sorted(w["id"] for w in fleet if w.get("pending")),
        journal["pending"] is not None,
    )


def _restore_router(url: str, keep: set[str], behind: str, model: str) -> None:
    """Undo what a successful or failed case left: extra workers, fences, a paused or released worker."""
    for w in workers(url, ADMIN_KEY):
        if w["id"] not in keep:
            http_json("DELETE", f"{url}/workers/{w['id']}", headers=auth(), timeout=10)
        elif w["disabled"]:
            http_json("PUT", f"{url}/workers/{w['id']}", {"disabled": False}, headers=auth(), timeout=10)
    http_json("POST", url + "/weight_update_journal/resolve", {"acknowledge": True}, headers=auth(), timeout=10)
    _restore_worker(url)
    if _weights_partial(behind):  # through the router, so its record of the fleet's weights follows
        http_json("POST", url + "/update_weights_from_disk", {"model_path": model}, headers=auth(), timeout=60)


def _restore_worker(url: str, model: str | None = None) -> None:
    for path in (
        "/finish_weight_update",
        "/destroy_weights_update_group",
        "/resume_memory_occupation",
        "/continue_generation",
    ):
        http_json("POST", url + path, {}, headers=auth(), timeout=30)
    if model is not None and _weights_partial(url):
        http_json("POST", url + "/update_weights_from_disk", {"model_path": model}, headers=auth(), timeout=60)


def _weights_partial(worker_url: str) -> bool:
    """Weights released without a copy (``keep_weights: false``) come back partial: reload them."""
    return http_json("GET", worker_url + "/health", timeout=10)[1].get("weight_state") == "partial"


def _partial_weights(url: str, behind: str) -> None:
    """Through the router: release the weights without a copy and resume them. The worker's weights are
    partial (it serves nothing) until updates rewrite every tensor; the router holds it pending."""
    for path, body in (
        ("/release_memory_occupation", {"tags": ["weights"], "keep_weights": False}),
        ("/resume_memory_occupation", {"tags": ["weights"]}),
    ):
        status, answer = http_json("POST", url + path, body, headers=auth(), timeout=30)
        assert status == 200, (path, status, answer)
    assert _weights_partial(behind)


def _run_fuzz(base: str, *, via_router: bool, restore: Any, check_fences: bool) -> _fuzz.Tally:
    doc = _doc(base)
    rng = random.Random(0)
    tally = _fuzz.Tally()
    headers = {**auth(), "Content-Type": "application/json"}
    baseline = _fence_state(base) if check_fences else None

    def execute(label: str, method: str, url: str, data: bytes | None, detail: str, path: str) -> None:
        try:
            answer = _fuzz.send(method, url, data=data, headers=headers)
        except TimeoutError:
            # A hang: name the case, so a failure says which request never got its answer.
            raise AssertionError(f"no answer within {_fuzz.HANG_S + 30:.0f}s: {label} {detail[:500]}") from None
        tally.record(label, answer, detail, allowed_5xx=_allowed_5xx(path, via_router=via_router))
        if check_fences and 400 <= answer.status < 500:
            after = _fence_state(base)
            if after != baseline:
                tally.problems.append(f"a refusal changed the fleet: {label} {detail[:200]}: {baseline} -> {after}")
        if check_fences or answer.status >= 500 or (answer.status < 400 and method != "GET"):
            restore()

    for op in _fuzz.operations(doc):
        path, method = op.path, op.method.upper()
        label = f"{method} {path}"
        doc_op = doc["paths"][path][op.method.lower()]
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            def run_case(case: Any, tag: str = f"{label} [{mode.value}]", path: str = path) -> None:
                m, url, data, detail = _fuzz.case_request(case, base, rng)
                execute(tag, m, url, data, detail, path)

            _fuzz.run_generated(op, mode, EXAMPLES, run_case)
        if method in ("POST", "PUT") and "{" not in path:
            for what, raw in _fuzz.garbage_bodies(doc, doc_op):
                execute(f"{label} [garbage]", method, base + path, raw, what, path)
    return tally


def _processes_alive(servers) -> None:
    for proc in servers["procs"]:
        assert proc.alive, proc.log_text()


def test_fuzz_every_router_route(servers):
    url = servers["router"]
    keep = {w["id"] for w in workers(url, ADMIN_KEY)}

    def restore() -> None:
        _restore_router(url, keep, servers["behind"], servers["model"])

    tally = _run_fuzz(url, via_router=True, restore=restore, check_fences=True)
    print(f"router fuzz: {tally.summary()}")
    assert not tally.problems, "\n".join(tally.problems[:40])
    assert tally.cases >= 300, tally.summary()
    _processes_alive(servers)
    # The fleet is whole and serves afterwards.
    restore()
    assert all(not w["disabled"] and not w.get("pending") for w in workers(url, ADMIN_KEY))


def test_fuzz_fenced_routes_on_partial_weights(servers):
    url, behind = servers["router"], servers["behind"]
    keep = {w["id"] for w in workers(url, ADMIN_KEY)}
    fenced = {path for path, op in OPERATIONS.items() if op.fenced}
    rng = random.Random(1)
    tally = _fuzz.Tally()
    headers = {**auth(), "Content-Type": "application/json"}
    _partial_weights(url, behind)
    baseline = _fence_state(url)
    assert baseline == ([], sorted(keep), False), baseline  # pending (partial weights), not fenced

    def execute(label: str, case: Any) -> None:
        method, case_url, data, detail = _fuzz.case_request(case, url, rng)
        try:
            answer = _fuzz.send(method, case_url, data=data, headers=headers)
        except TimeoutError:
            raise AssertionError(f"no answer within {_fuzz.HANG_S + 30:.0f}s: {label} {detail[:500]}") from None
        tally.record(label, answer, detail, allowed_5xx=_allowed_5xx(case.operation.path, via_router=True))
        after = _fence_state(url)
        if 400 <= answer.status < 500 and after != baseline:
            tally.problems.append(f"a refusal changed the fleet: {label} {detail[:200]}: {baseline} -> {after}")
        pending = set(after[1])
        if _weights_partial(behind) and not keep <= pending:
            tally.problems.append(f"a worker with partial weights is routable after {label} {detail[:200]}: {after}")
        if not 400 <= answer.status < 500 or after != baseline:
            _restore_router(url, keep, behind, servers["model"])
            _partial_weights(url, behind)
            again = _fence_state(url)
            if again != baseline:
                tally.problems.append(f"the harness could not restore partial weights after {label}: {again}")

    for op in _fuzz.operations(_doc(url)):
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
    _restore_router(url, keep, behind, servers["model"])
    assert all(not w["disabled"] and not w.get("pending") for w in workers(url, ADMIN_KEY))


def test_fuzz_every_worker_route(servers):
    url = servers["worker"]
    tally = _run_fuzz(url, via_router=False, restore=lambda: _restore_worker(url, servers["model"]), check_fences=False)
    print(f"worker fuzz: {tally.summary()}")
    assert not tally.problems, "\n".join(tally.problems[:40])
    assert tally.cases >= 300, tally.summary()
    _processes_alive(servers)
    status, body = http_json("GET", url + "/health", timeout=10)
    assert status == 200 and body["weight_state"] == "serving", body
