"""Faults between the layers, through the router, with real processes.

* A trainer that dies mid-sync (both two-phase modes): the router ends the
  prepared update as soon as every worker's receive has failed, instead of
  holding its admin lock until the update expires. Atomic: the old weights are
  kept and served at once. Streaming: the partial workers are never routed, not
  even after an operator resolves the journal; ``/generate`` answers 503 at once
  rather than waiting; the next sync makes them routable again.
* A worker that restarts between syncs comes back with its boot checkpoint: it is
  *pending* (no generation traffic, the reason in ``GET /workers``) until a weight
  update brings it to the fleet's weights.

Real parts: omni-workers on a tiny llama, an omni-router, and trainer processes
(``tests._router_trainer``) that sync through the project's client over gloo.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from router.contract.weight_sync import DEFAULT_GROUP_NAME
from tests._router_fixtures import (
    ADMIN_KEY,
    Fleet,
    auth,
    by_url,
    generate_via,
    make_tiny_checkpoint,
    start_router,
    wait_for,
    workers,
)
from tests._router_trainer import DIED, run_trainer
from tests._weight_sync_fixtures import WORKER_ARGS
from tests.procs import http_json

#: The sync's receive window (tests/_router_trainer.py asks for 60 s): the prepared update would live
#: this long plus a margin if nothing ended it. The waits for its end are bounded by ENDED_WITHIN_S,
#: far shorter, so reaching their end at all shows the router ended it early.
ENDED_WITHIN_S = 25
#: Far above the moment a 503 takes; a router that held the request for a routable worker would
#: hold it until the next sync, so its caller's read would time out instead.
ANSWERED_WITHIN_S = 20


@pytest.fixture(scope="module")
def pair(worker_fleet) -> Fleet:
    return worker_fleet(2, extra_args=["--admin-api-key", ADMIN_KEY, *WORKER_ARGS])


def journal_pending(url: str) -> dict[str, Any] | None:
    return http_json("GET", url + "/weight_update_journal", headers=auth())[1]["pending"]


def checksums(url: str) -> list[str]:
    body = http_json("POST", url + "/weights_checker", {"action": "checksum"}, headers=auth())[1]
    return [c for per in body["rank_checksums"].values() for c in per]


def call(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    return http_json("POST", url + path, body, headers=auth(), timeout=60)


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "streaming"])
def test_trainer_killed_mid_sync(pair: Fleet, tmp_path: Path, atomic: bool) -> None:
    model = pair.model
    router, url = start_router(pair.urls, admin_key=ADMIN_KEY, state_dir=tmp_path / "state")
    try:
        before = checksums(url)
        killed, _ = run_trainer(
            url, model, tmp_path, [["two_phase", "flattened_bucket", {"atomic": atomic, "die_at_bucket": 2}]]
        )
        assert killed.returncode == DIED, killed.stderr[-3000:]
        # The trainer's sockets closed with it: every receive fails, and the router ends the update
        # at once (its admin lock free again) rather than at its expiry (receive window + margin).
        if atomic:
            wait_for(lambda: not any(w["disabled"] for w in workers(url, ADMIN_KEY)), ENDED_WITHIN_S, router, "ended")
            assert journal_pending(url) is None
            # Nothing was applied: the old weights, served at once.
            assert checksums(url) == before
            # The dead trainer had paused generation; resuming it is the caller's call, not the router's.
            assert call(url, "/continue_generation", {})[0] == 200
            assert generate_via(url)[0] == 200
        else:
            # In flight while prepared; failed (closed) once the router ended it.
            wait_for(lambda: (journal_pending(url) or {}).get("state") == "failed", ENDED_WITHIN_S, router, "ended")
            assert all(w["disabled"] for w in workers(url, ADMIN_KEY))
            # The operator vouches for the fleet as the 409s suggest: the workers are enabled but still
            # pending (partial weights), so nothing is routed to them and /generate is 503 at once.
            status, body = call(url, "/weight_update_journal/resolve", {"acknowledge": True})
            assert status == 200 and body["resolved"], body
            fleet = workers(url, ADMIN_KEY)
            assert not any(w["disabled"] for w in fleet)
            assert all(w["pending"] for w in fleet), json.dumps(fleet)
            # What each worker says of itself reaches the router with its next health probe.
            for worker_url in pair.urls:
                assert http_json("GET", worker_url + "/health")[1]["weight_state"] == "partial"
            partial = lambda: all("partial" in (w["pending"] or "") for w in workers(url, ADMIN_KEY))  # noqa: E731
            wait_for(partial, 30, router, "pending: partial")
            status, body, served = generate_via(url, timeout=ANSWERED_WITHIN_S)
            assert status == 503 and served is None, body
            # The router reports the fleet as it is: partial.
            status, info = http_json("GET", url + "/model_info", headers=auth())
            assert status == 409 and "does not hold whole weights" in info["error"]["message"], info
        # A complete after the end is told why the update is gone.
        status, body = call(url, "/complete_weights_update", {"group_name": DEFAULT_GROUP_NAME})
        assert status == 409 and "ended the last one itself" in body["error"]["message"], body
        assert "receive failed" in body["error"]["message"]

        # The next trainer (a restarted process) rebuilds the group and syncs: everyone routable.
        status, body = call(url, "/destroy_weights_update_group", {"group_name": DEFAULT_GROUP_NAME})
        assert status == 200, body
        again, report = run_trainer(url, model, tmp_path, [["two_phase", "flattened_bucket", {"atomic": atomic}]])
        assert again.returncode == 0 and "error" not in report, (report, again.stderr[-3000:])
        assert report["steps"][0]["matches_expected"] is True
        fleet = workers(url, ADMIN_KEY)
        assert [(w["disabled"], w["pending"]) for w in fleet] == [(False, None), (False, None)], fleet
        assert generate_via(url)[0] == 200
    finally:
        router.stop()


def test_broadcasts_of_other_sizes_than_announced_fail_through_the_router(pair: Fleet, tmp_path: Path) -> None:
    """A buggy trainer (no checksums sent): fewer or more bytes than announced, in both formats. Every
    sync fails, no process is lost, the old weights stay (atomic), nothing stays fenced; the next
    correct sync on the same client succeeds."""
    model = pair.model
    router, url = start_router(pair.urls, admin_key=ADMIN_KEY, state_dir=tmp_path / "state")
    try:
        before = checksums(url)
        cases = [
            ("flattened_bucket", {"short_by": 4096}, "fewer"),
            ("flattened_bucket", {"long_by": 4096}, "more"),
            (None, {"short_by": 64}, "fewer"),
            (None, {"long_by": 16}, "more"),
        ]
        steps = [["two_phase", fmt, {"atomic": True, **tamper}] for fmt, tamper, _ in cases]
        steps.append(["two_phase", "flattened_bucket", {"atomic": True}])
        done, report = run_trainer(url, model, tmp_path, steps)
        assert done.returncode == 0 and "error" not in report, (report.get("error"), done.stderr[-3000:])
        for step, (fmt, _, verdict) in zip(report["steps"], cases, strict=False):
            failed = step["failed"]
            assert failed["stage"] == "complete", (fmt, failed)
            messages = [r["body"]["message"] for r in failed["results"] if r.get("body")]
            assert len(messages) == 2 and all(f"received {verdict} bytes than announced" in m for m in messages), (
                fmt,
                messages,
            )
            seen = step["after_failure"]
            kept = [c for per in seen["checksums"].values() for c in per]
            assert kept == before and seen["disabled"] == [] and seen["journal_pending"] is None, seen
        assert all(p.alive for p in pair.procs)
        good = report["steps"][-1]
        assert good["matches_expected"] is True and good["fleet_identical"] is True
    finally:
        router.stop()


@pytest.mark.parametrize("probe_interval_s", [0.5, 60.0], ids=["seen-by-a-probe", "seen-by-the-proxy"])
def test_worker_restarted_between_syncs_is_pending_until_the_next_update(
    pair: Fleet, tmp_path: Path, probe_interval_s: float
) -> None:
    """With frequent probes the router sees the new process before any request does; with
    rare ones the first answer from it (a header names its instance) is dropped and retried
    on another worker. Either way no rollout comes from the boot checkpoint."""
    stay_url, restarted_url = pair.urls
    restarted = pair.procs[1]
    other = make_tiny_checkpoint(tmp_path / "other", seed=7)
    router, url = start_router(
        [stay_url, restarted_url],
        admin_key=ADMIN_KEY,
        state_dir=tmp_path / "state",
        # The pending rule itself: no catch-up from a peer (tests/test_router_catch_up.py covers that).
        extra_args=["--health-check-interval-s", str(probe_interval_s), "--sync-joiners", "off"],
    )
    try:
        status, body = call(url, "/update_weights_from_disk", {"model_path": str(other), "weight_version": "v2"})
        assert status == 200 and body["success"], body
        ids = {u: w["id"] for u, w in by_url(url, ADMIN_KEY).items()}
        restarted.kill()
        restarted.start()
        restarted.wait_http_ready(restarted_url + "/health", timeout=120)
        if probe_interval_s < 1:

            def back_and_pending() -> bool:
                view = by_url(url, ADMIN_KEY)[restarted_url]
                return view["health"] == "healthy" and bool(view["pending"])

            wait_for(back_and_pending, 30, router, "restarted worker healthy and pending")
        served = [generate_via(url)[2] for _ in range(8)]
        assert served == [ids[stay_url]] * 8  # no rollout from the old policy
        # Back with its boot checkpoint and a new instance: pending, with the reason.
        view = by_url(url, ADMIN_KEY)[restarted_url]
        assert not view["disabled"] and view["pending"], view
        assert "restarted" in view["pending"] or "weight_version" in view["pending"], view
        # The fleet answers say the fleet is mixed.
        status, versions = http_json("GET", url + "/get_weight_version", headers=auth())
        assert status == 409 and "mixed worker weight_version" in versions["error"]["message"], versions
        # The next update reaches it too (a pending worker is still a broadcast target): routable again.
        status, body = call(url, "/update_weights_from_disk", {"model_path": str(other), "weight_version": "v3"})
        assert status == 200 and body["success"], body
        wait_for(lambda: by_url(url, ADMIN_KEY)[restarted_url]["pending"] is None, 20, router, "routable again")
        assert len(set(checksums(url))) == 1
        served = [generate_via(url)[2] for _ in range(12)]
        assert set(served) == {ids[stay_url], ids[restarted_url]}
    finally:
        router.stop()
