"""``omni-router status`` against a real router in front of two real workers: the table and the JSON
document, an update's version, a disabled and a fenced worker, a refused key, an unreachable router,
and ``--watch``; ``GET /fleet/status`` (what the command reads) in-process, against the verdict of the
routes it combines; the verdict rules themselves on records built here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from router.contract.fleet import FleetVersions, JournalState, JournalTarget, JournalView, WorkerList, WorkerRecord
from router.contract.fleet_status import FleetStatus
from router.contract.web.auth import ADMIN_KEY_ENV
from router.contract.web.openapi import paths_with_access
from router.gateway import keys
from router.gateway.admin.fence import RESOLVE_HINT
from router.gateway.admin.journal import JOURNAL_FILE
from router.gateway.app import create_app, routes
from router.gateway.cli import main as router_main
from router.gateway.config import RouterConfig
from router.gateway.fleet.registry import worker_id_for
from router.gateway.status.command import CLEAR_SCREEN
from router.gateway.status.render import StatusReport
from router.gateway.status.verdict import ALL_ROUTABLE, NONE_ROUTABLE, SOME_OUT, exit_code, judge, summary
from tests._polling import until
from tests._router_fixtures import ADMIN_KEY, Fleet, auth, start_router, wait_for
from tests.procs import cli, free_port, http_json

#: A refusal or a refused connection is answered in milliseconds; far below this bound.
QUICK_S = 5.0


@pytest.fixture(scope="module")
def fleet(worker_fleet) -> Fleet:
    return worker_fleet(2, seeds=(0, 1))


@pytest.fixture
def router(fleet: Fleet, tmp_path):
    proc, url = start_router(fleet.urls, state_dir=tmp_path / "state")
    yield url
    proc.stop()


@pytest.fixture(autouse=True)
def no_key_in_env(monkeypatch):
    """The command reads the admin key from the environment: a key set where the suite runs must not leak in."""
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)


def status(capsys, *args: str) -> tuple[int, str, str]:
    """``omni-router status ARGS`` in this process, through the CLI's own dispatch."""
    code = router_main(["status", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def report_of(capsys, url: str, *args: str) -> StatusReport:
    code, out, err = status(capsys, "--url", url, "--json", *args)
    report = StatusReport.model_validate_json(out)
    assert report.exit_code == code, err
    return report


def script_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != ADMIN_KEY_ENV}


def test_a_routable_fleet_is_exit_0_in_the_table_and_in_json(router, fleet):
    """The installed console script, as an operator runs it."""
    done = subprocess.run(
        [cli("omni-router"), "status", "--url", router], capture_output=True, text=True, timeout=60, env=script_env()
    )
    assert done.returncode == ALL_ROUTABLE, done.stderr
    assert "2 worker(s), 2 routable" in done.stdout
    table = done.stdout.split("Journal:")[0]
    for url in fleet.urls:
        (row,) = [line for line in table.splitlines() if url in line]
        assert row.split()[3] == "healthy" and row.endswith("yes")
    assert "Journal: no unresolved update" in done.stdout
    done = subprocess.run(
        [cli("omni-router"), "status", "--url", router, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=script_env(),
    )
    assert done.returncode == ALL_ROUTABLE, done.stderr
    report = StatusReport.model_validate(json.loads(done.stdout))
    assert report.exit_code == ALL_ROUTABLE and report.leader is not None and report.leader.role == "single"
    assert [w.url for w in report.workers] == fleet.urls
    assert all(w.routable and w.out_of_rotation is None and w.health == "healthy" for w in report.workers)
    assert report.journal.pending is None and report.resolve_hint is None


def test_an_update_through_the_router_shows_its_version(router, fleet, capsys):
    (other,) = fleet.others
    body = {"model_path": str(other), "weight_version": "status-v1"}
    status_code, answer = http_json("POST", router + "/update_weights_from_disk", body, timeout=120)
    assert status_code == 200, answer
    report = report_of(capsys, router)
    assert report.exit_code == ALL_ROUTABLE
    assert {w.weight_version for w in report.workers} == {"status-v1"}
    versions = report.fleet_versions
    assert versions.weight_version == "status-v1"
    latest = versions.history[-1]
    assert (latest.weight_version, latest.source_path) == ("status-v1", str(other))
    assert latest.changed_at >= report.taken_at - 120
    code, out, _ = status(capsys, "--url", router)
    assert code == ALL_ROUTABLE
    assert "weight_version status-v1" in out
    (row,) = [line for line in out.split("Fleet versions:")[1].splitlines() if str(other) in line]
    assert row.split()[:2] == [str(latest.sequence), "status-v1"]
    # The update's phases, as its answer said them.
    last = report.last_update
    assert last is not None and last.operation == "update_weights_from_disk" and last.outcome == "success"
    assert last.timings == answer["timings"]
    head, phases = out.split("Last update: ")[1].splitlines()[:2]
    assert head.startswith("update_weights_from_disk success") and last.operation_id in head
    assert phases.strip().startswith("phases (ms): lock_wait ") and "verification" in phases and "total" in phases


def test_a_disabled_worker_is_exit_1_with_the_reason(router, capsys):
    workers = report_of(capsys, router).workers
    first, second = workers[0].id, workers[1].id
    status_code, _ = http_json("PUT", f"{router}/workers/{second}", {"disabled": True})
    assert status_code == 200
    code, out, _ = status(capsys, "--url", router)
    assert code == SOME_OUT
    (row,) = [line for line in out.splitlines() if line.strip().startswith(second)]
    assert row.split()[6] == "yes" and row.endswith("no: disabled by the operator's flag")
    report = report_of(capsys, router)
    assert [(w.id, w.routable) for w in report.workers] == [(first, True), (second, False)]
    assert http_json("PUT", f"{router}/workers/{first}", {"disabled": True})[0] == 200
    code, out, _ = status(capsys, "--url", router)
    assert code == NONE_ROUTABLE and "2 worker(s), 0 routable" in out


def test_a_fenced_worker_shows_the_journal_and_how_to_resolve(fleet, tmp_path, capsys):
    """A router that stopped during an update comes back with its targets fenced (the journal it left)."""
    state = tmp_path / "state"
    state.mkdir()
    fenced = worker_id_for(fleet.urls[1])
    entry = JournalState(
        state="in_flight",
        path="/update_weights_from_disk",
        started_at=time.time() - 90,
        targets=[JournalTarget(id=fenced, url=fleet.urls[1], previous_disabled=False)],
    )
    (state / JOURNAL_FILE).write_text(entry.model_dump_json())
    proc, url = start_router(fleet.urls, state_dir=state)
    try:
        code, out, _ = status(capsys, "--url", url)
        assert code == SOME_OUT
        (row,) = [line for line in out.splitlines() if line.strip().startswith(fenced)]
        assert row.split()[6] == "fenced" and "fenced by the failed update /update_weights_from_disk" in row
        assert "Journal: failed /update_weights_from_disk" in out and "(1m ago)" in out
        assert "router stopped during /update_weights_from_disk" in out
        assert f"resolve: {RESOLVE_HINT}" in out
        report = report_of(capsys, url)
        assert report.resolve_hint == RESOLVE_HINT
        assert report.journal.pending is not None and report.journal.pending.failed == [fenced]
        assert [w.fenced for w in report.workers] == [False, True]
        status_code, _ = http_json("POST", url + "/weight_update_journal/resolve", {"acknowledge": True})
        assert status_code == 200
        code, out, _ = status(capsys, "--url", url)
        assert code == ALL_ROUTABLE and "Journal: no unresolved update" in out
    finally:
        proc.stop()


def test_a_refused_or_missing_admin_key_is_exit_2_and_says_so(fleet, tmp_path, capsys, monkeypatch):
    proc, url = start_router(fleet.urls, admin_key=ADMIN_KEY, state_dir=tmp_path / "state")
    try:
        started = time.monotonic()
        code, out, err = status(capsys, "--url", url)
        assert code == NONE_ROUTABLE and out == ""
        assert f"the router requires an admin key: pass --admin-api-key or set {ADMIN_KEY_ENV}" in err
        code, out, err = status(capsys, "--url", url, "--admin-api-key", "not-the-key")
        assert code == NONE_ROUTABLE and out == ""
        assert "the admin key was refused" in err and "401" in err
        assert time.monotonic() - started < QUICK_S
        assert status(capsys, "--url", url, "--admin-key", ADMIN_KEY)[0] == ALL_ROUTABLE
        monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN_KEY)  # the router's own variable is the default
        assert status(capsys, "--url", url)[0] == ALL_ROUTABLE
        assert http_json("GET", url + "/workers", headers=auth())[0] == 200
    finally:
        proc.stop()


def test_watch_refreshes_in_place_until_ctrl_c(router):
    proc = subprocess.Popen(
        [cli("omni-router"), "status", "--url", router, "--watch", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=script_env(),
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        wait_for(lambda: sum(CLEAR_SCREEN in line for line in lines) >= 2, 30, what="two refreshes")
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(30)
        reader.join(10)
    assert code == ALL_ROUTABLE, proc.stderr.read() if proc.stderr else ""
    assert sum("2 worker(s), 2 routable" in line for line in lines) >= 2


def test_an_unreachable_router_is_exit_2_at_once(capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    code, out, err = status(capsys, "--url", url, "--timeout-s", "2")
    assert code == NONE_ROUTABLE and out == ""
    assert f"cannot reach the router at {url}" in err
    assert time.monotonic() - started < QUICK_S


#: Nothing listens on the discard port of these loopback addresses: the workers of the in-process router.
UNREACHABLE = ["http://127.0.0.2:9", "http://127.0.0.3:9", "http://127.0.0.4:9"]


async def test_fleet_status_needs_the_admin_key_and_is_the_verdict_of_the_routes_it_combines(
    aiohttp_client: Any, tmp_path: Path
) -> None:
    """One worker serving, one fenced by the journal a stopped update left, one pending (its weights partial)."""
    serving, fenced, pending = (worker_id_for(url) for url in UNREACHABLE)
    state = tmp_path / "state"
    state.mkdir()
    entry = JournalState(
        state="in_flight",
        path="/update_weights_from_disk",
        started_at=time.time() - 30,
        targets=[JournalTarget(id=fenced, url=UNREACHABLE[1], previous_disabled=False)],
    )
    (state / JOURNAL_FILE).write_text(entry.model_dump_json())
    config = RouterConfig(
        worker_urls=UNREACHABLE,
        admin_api_key=ADMIN_KEY,
        state_dir=state,
        connect_timeout_s=2.0,
        health_check_interval_s=3600.0,  # one probe round at start-up, then the fields set below hold
    )
    client = await aiohttp_client(create_app(config))
    registry = client.app[keys.REGISTRY]
    await until(lambda: all(w.consecutive_failures for w in registry), 10, "the start-up probe of every worker")
    for worker in registry:  # as a good probe of each would leave it
        worker.health = "healthy"
    registry.get(pending).weight_state = "partial"

    assert "/fleet/status" in paths_with_access(routes(), "admin")
    for headers in ({}, auth("not-the-key")):
        async with client.get("/fleet/status", headers=headers) as resp:
            assert resp.status == 401, await resp.text()

    async def read(path: str) -> Any:
        async with client.get(path, headers=auth()) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    before = time.time()
    answer = FleetStatus.model_validate(await read("/fleet/status"))
    records = WorkerList.model_validate(await read("/workers")).workers
    journal = JournalView.model_validate(await read("/weight_update_journal"))
    versions = FleetVersions.model_validate(await read("/fleet/versions"))
    expected = judge(records, journal.pending)
    assert answer.workers == expected
    assert (answer.journal, answer.versions) == (journal, versions)
    assert answer.exit_code == exit_code(expected) == SOME_OUT
    assert answer.summary == summary(expected) == f"3 worker(s), 1 routable; out of rotation: {fenced}, {pending}"
    assert answer.resolve_hint == RESOLVE_HINT and answer.leader.role == "single"
    assert before <= answer.read_at <= time.time()
    # What the verdict says of each, in the words `omni-router status` prints.
    assert [(w.id, w.routable, w.fenced, w.out_of_rotation) for w in answer.workers] == [
        (serving, True, False, None),
        (fenced, False, True, "fenced by the failed update /update_weights_from_disk"),
        (pending, False, False, "pending: its weights are partial"),
    ]


def record(wid: str, **fields) -> WorkerRecord:
    """A registry record as ``GET /workers`` has it (never asked: these tests read no router)."""
    given = {"health": "healthy", "disabled": False, "inflight": 0, **fields}
    return WorkerRecord.model_validate({"id": wid, "url": f"http://worker-{wid}:8000", **given})


def test_a_worker_the_router_paused_is_out_only_while_the_rest_runs():
    one_paused = judge([record("a", paused=True), record("b")], None)
    assert [s.routable for s in one_paused] == [False, True] and exit_code(one_paused) == SOME_OUT
    assert one_paused[0].out_of_rotation == "paused by the router while the rest of the fleet runs"
    all_paused = judge([record("a", paused=True), record("b", paused=True)], None)
    assert exit_code(all_paused) == ALL_ROUTABLE  # a trainer's pause: requests wait, as the router makes them
    # The only running worker is unhealthy: the paused one is what serves once the fleet continues.
    beside_a_dead_one = judge([record("a", paused=True), record("b", health="dead")], None)
    assert [s.routable for s in beside_a_dead_one] == [True, False]


def test_every_reason_is_said_and_no_worker_is_exit_2():
    journal = JournalState(
        state="in_flight",
        path="/update_weights_from_disk",
        started_at=0.0,
        targets=[JournalTarget(id="b", url="http://127.0.0.1:2", previous_disabled=False)],
    )
    statuses = judge(
        [
            record("a", disabled=True),
            record("b", disabled=True),
            record("c", health="unhealthy", engine_detail="no /health", pending="its weights are partial"),
            record("d", departed="its pod was deleted"),
        ],
        journal,
    )
    assert [s.out_of_rotation for s in statuses] == [
        "disabled by the operator's flag",
        "fenced by the running update /update_weights_from_disk",
        "unhealthy (no /health); pending: its weights are partial",
        "departed: its pod was deleted",
    ]
    assert [s.fenced for s in statuses] == [False, True, False, False]
    assert exit_code(statuses) == NONE_ROUTABLE
    assert summary(statuses) == "4 worker(s), 0 routable: no worker takes generation traffic"
    assert exit_code(judge([], None)) == NONE_ROUTABLE
    assert summary(judge([], None)) == "0 worker(s), 0 routable: none is registered"


def test_the_summary_names_the_workers_out_of_rotation_up_to_a_bound():
    assert (
        summary(judge([record("a"), record("b")], None))
        == "2 worker(s), 2 routable: every worker takes generation traffic"
    )
    many = judge([record("ok"), *(record(f"w{i}", health="dead") for i in range(7))], None)
    assert summary(many) == "8 worker(s), 1 routable; out of rotation: w0, w1, w2, w3, w4 and 2 more"


def test_bad_flags_are_refused_by_the_parser(capsys):
    for argv in (["--url", "127.0.0.1:30000"], ["--timeout-s", "0"], ["--watch", "-1"]):
        with pytest.raises(SystemExit) as exc:
            router_main(["status", *argv])
        assert exc.value.code == 2
    assert "http(s)://HOST:PORT" in capsys.readouterr().err


def test_the_default_url_is_the_routers_default_port(capsys):
    with pytest.raises(SystemExit):
        router_main(["status", "--help"])
    assert "http://127.0.0.1:30000" in capsys.readouterr().out
