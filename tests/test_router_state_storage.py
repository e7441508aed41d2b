"""The router's state store refuses writes: the router still starts, fences, reports, and catches up.

The fault is made by putting a directory where the store writes its temporary
file (``<record>.tmp``): every write of that record then fails with an
``OSError``, whoever runs the test (a read-only mount would not stop root).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from router.contract.fleet import JournalState, JournalTarget
from router.gateway.admin.journal import JOURNAL_FILE, UpdateJournal
from router.gateway.fleet.registry import normalize_url, worker_id_for
from router.gateway.fleet.weights import FLEET_FILE
from router.gateway.state.durable import DurableState
from tests._router_fixtures import (
    ADMIN_KEY,
    auth,
    generate_via,
    start_router,
    wait_for,
)
from tests.procs import http_json


def block_writes(state_dir: Path, name: str) -> Path:
    blocker = state_dir / f"{name}.tmp"
    blocker.mkdir(parents=True)
    (blocker / "keep").write_text("a directory where the store's temporary file goes")
    return blocker


class TestDurableRecord:
    async def test_an_unsaved_record_is_written_once_the_store_takes_it(self, tmp_path):
        state = DurableState.in_directory(tmp_path)
        record = state.record("r.json")
        blocker = block_writes(tmp_path, "r.json")
        assert not await record.save(b"one")
        assert record.unsaved and record.error is not None
        view = state.view()
        assert view is not None and not view.healthy and view.unsaved == ["r.json"] and "r.json" in view.error
        assert not (tmp_path / "r.json").exists()
        # A newer content is what the retry writes, never an older one.
        assert not await record.save(b"two")
        shutil.rmtree(blocker)
        await state.retry_unsaved()
        assert (tmp_path / "r.json").read_bytes() == b"two"
        assert not record.unsaved and record.error is None
        view = state.view()
        assert view is not None and view.healthy and view.unsaved == []

    def test_a_write_on_its_way_is_no_storage_fault(self, tmp_path):
        state = DurableState.in_directory(tmp_path)
        record = state.record("r.json")
        record.want(b"next")  # as a clean end of an update leaves it: written after the call answers
        assert record.unsaved and not record.failing
        view = state.view()
        assert view is not None and view.healthy and view.unsaved == [], view
        record.flush()
        assert (tmp_path / "r.json").read_bytes() == b"next" and not record.unsaved

    async def test_save_or_raise_keeps_the_previous_content_wanted(self, tmp_path):
        state = DurableState.in_directory(tmp_path)
        record = state.record("r.json")
        assert await record.save(b"old")
        blocker = block_writes(tmp_path, "r.json")
        with pytest.raises(OSError):
            await record.save_or_raise(b"new")
        shutil.rmtree(blocker)
        await state.retry_unsaved()
        assert (tmp_path / "r.json").read_bytes() == b"old"

    def test_a_crash_journal_on_a_store_that_refuses_writes_still_loads(self, tmp_path):
        crash = JournalState(
            state="in_flight",
            path="/update_weights_from_disk",
            started_at=time.time(),
            targets=[JournalTarget(id="w-a", url="http://127.0.0.2:1", previous_disabled=False)],
        )
        (tmp_path / JOURNAL_FILE).write_text(crash.model_dump_json())
        block_writes(tmp_path, JOURNAL_FILE)
        journal = UpdateJournal(DurableState.in_directory(tmp_path).record(JOURNAL_FILE))
        pending = journal.load_or_unreadable([("w-a", "http://127.0.0.2:1")])
        assert pending is not None and pending.state == "failed" and pending.failed == ["w-a"]
        assert journal.record.unsaved
        # The store still holds the old entry: it fences the same workers if the router restarts now.
        assert json.loads((tmp_path / JOURNAL_FILE).read_text())["state"] == "in_flight"


@pytest.fixture(scope="module")
def pair(worker_fleet) -> list[str]:
    return worker_fleet(2, extra_args=["--admin-api-key", ADMIN_KEY]).urls


def test_router_starts_on_a_crash_journal_it_cannot_rewrite(pair, tmp_path):
    """Before, rewriting the entry as failed raised at start-up and the router crash-looped."""
    journaled, _ = pair
    journaled_id, other_id = (worker_id_for(normalize_url(u)) for u in pair)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    crash = JournalState(
        state="in_flight",
        path="/update_weights_from_disk",
        started_at=time.time(),
        targets=[JournalTarget(id=journaled_id, url=journaled, previous_disabled=False)],
    )
    (state_dir / JOURNAL_FILE).write_text(crash.model_dump_json())
    blocker = block_writes(state_dir, JOURNAL_FILE)

    proc, url = start_router(pair, admin_key=ADMIN_KEY, state_dir=state_dir, wait_healthy=1)
    try:
        status, health = http_json("GET", url + "/health")
        assert status == 200
        storage = health["state_storage"]
        assert storage["healthy"] is False and storage["unsaved"] == [JOURNAL_FILE] and storage["error"]

        status, view = http_json("GET", url + "/weight_update_journal", headers=auth())
        assert status == 200
        assert view["pending"]["state"] == "failed"
        assert view["pending"]["failed"] == [journaled_id]
        assert view["storage"]["healthy"] is False

        # The journaled worker serves nothing; the other one serves everything.
        served = {generate_via(url)[2] for _ in range(6)}
        assert served == {other_id}
        # No update starts while the entry is pending.
        status, body = http_json("POST", url + "/pause_generation", {"mode": "abort"}, headers=auth(), timeout=30)
        assert status == 409, body

        # The store takes writes again: the failed entry reaches it, and /health says so.
        shutil.rmtree(blocker)
        wait_for(lambda: http_json("GET", url + "/health")[1]["state_storage"]["healthy"], timeout=20)
        on_disk = json.loads((state_dir / JOURNAL_FILE).read_text())
        assert on_disk["state"] == "failed" and on_disk["failed"] == [journaled_id]

        # The documented recovery works: resolve, and the worker is routable again.
        status, body = http_json("POST", url + "/weight_update_journal/resolve", {"acknowledge": True}, headers=auth())
        assert status == 200 and body["resolved"], body
        assert not (state_dir / JOURNAL_FILE).exists()
        wait_for(lambda: {generate_via(url)[2] for _ in range(6)} == {journaled_id, other_id}, timeout=20)
    finally:
        proc.stop()


def test_a_state_path_that_is_a_file_refuses_updates_and_keeps_serving(pair, tmp_path):
    """ENOTDIR on every read means no record was ever written there: a clean start, not a lost journal. Before,
    the router recorded an update of unknown path as failed, fenced every worker and served nothing."""
    ids = {worker_id_for(normalize_url(u)) for u in pair}
    not_a_dir = tmp_path / "state"
    not_a_dir.write_text("an operator's mistake: a file where the state directory should be")
    proc, url = start_router(pair, admin_key=ADMIN_KEY, state_dir=not_a_dir)
    try:
        storage = http_json("GET", url + "/health")[1]["state_storage"]
        assert storage["healthy"] is False and "is not a directory" in storage["error"], storage
        assert "is not a directory" in proc.log_text()
        assert http_json("GET", url + "/weight_update_journal", headers=auth())[1]["pending"] is None
        assert {generate_via(url)[2] for _ in range(6)} == ids  # generation goes on, on every worker
        status, body = http_json("POST", url + "/pause_generation", {"mode": "abort"}, headers=auth(), timeout=30)
        assert status == 503 and "update journal" in body["error"]["message"], body
        workers = http_json("GET", url + "/workers", headers=auth())[1]["workers"]
        assert not any(w["disabled"] or w["pending"] or w["paused"] for w in workers), workers
    finally:
        proc.stop()


def test_an_unreadable_fleet_record_is_brought_back_by_the_operators_resolve(pair, tmp_path):
    """A record that exists and cannot be parsed is unknown: every worker is pending (fail closed), with what to
    do in GET /workers; the operator's resolve records the workers as they report now."""
    ids = {worker_id_for(normalize_url(u)) for u in pair}
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / FLEET_FILE).write_text("{ not json")
    proc, url = start_router(pair, admin_key=ADMIN_KEY, state_dir=state_dir)
    try:
        workers = http_json("GET", url + "/workers", headers=auth())[1]["workers"]
        assert all("could not be read" in (w["pending"] or "") for w in workers), workers
        assert all("/weight_update_journal/resolve" in w["pending"] for w in workers)
        assert http_json("POST", url + "/generate", {"text": "hi"})[0] == 503
        status, body = http_json("POST", url + "/weight_update_journal/resolve", {"acknowledge": True}, headers=auth())
        assert status == 200 and body["fleet_record_rebuilt"] and body["resolved"], body
        assert {generate_via(url)[2] for _ in range(6)} == ids
        assert json.loads((state_dir / FLEET_FILE).read_text())["holders"].keys() == ids
    finally:
        proc.stop()
