"""Late joiners catch up from a peer (``--sync-joiners peer``), with a real router and real workers.

Three omni-workers on tiny llama checkpoint A share one admin key; each source sends its snapshot
slowly (``--snapshot-send-delay-ms``) so a transfer can be interrupted. The tests run in order on
that fleet:

1. ``--sync-joiners off``: a worker registered after a weight update stays pending (as before).
2. A router with the default (``peer``, two data-plane processes) moves two workers to checkpoint B
   twice (``v1``, ``v2``); a third worker on A is registered and becomes routable with no trainer
   call, with a holder's checksum and ``transformers``' greedy tokens on B, having generated nothing
   before it was routable.
3. A worker restarted behind the router catches up; its source is SIGKILLed mid-transfer: it stays
   pending with the reason, and catches up from the other source.
4. The killed source, restarted, catches up the same way.
5. A trainer sync (two-phase, through the trainer client) after those catch-ups succeeds on all three.

``FleetWeights.caught_up`` itself (refused once the fleet moved on) is checked in-process first.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from router.gateway.admin.journal import UpdateJournal
from router.gateway.admin.locked import AdminContext
from router.gateway.catch_up.joiners import JoinerSync, backoff_s
from router.gateway.fleet.registry import WorkerRegistry
from router.gateway.fleet.weights import FleetWeights, WorkerWeights
from router.gateway.leader.gate import LeaderGate
from tests._polling import wait_for
from tests._router_fixtures import ADMIN_KEY, Fleet, auth, by_url, generate_via, start_router
from tests._router_trainer import run_trainer
from tests._weight_sync_fixtures import WORKER_ARGS, transformers_greedy
from tests.procs import ManagedProcess, http_json

PROMPT = [1, 2, 3, 4, 5]
NEW_TOKENS = 8
#: One tensor per 50 ms: a tiny model's snapshot (39 tensors) takes about 2 s, far longer than the test
#: takes to see a source start (it reads the sources' logs every 0.1 s) and kill it mid-way, even on a
#: loaded machine. Every catch-up in this module streams at this pace: a longer delay slows them all.
SLOW_SOURCE = ["--snapshot-send-delay-ms", "50"]
CATCH_UP_S = 30  # a hang guard only: a catch-up of the tiny model takes a few seconds


@pytest.fixture(scope="module")
def fleet(worker_fleet, checkpoints) -> Fleet:
    return worker_fleet(
        3, model=checkpoints["llama"], extra_args=["--admin-api-key", ADMIN_KEY, *WORKER_ARGS, *SLOW_SOURCE]
    )


@pytest.fixture(scope="module")
def router(fleet: Fleet, tmp_path_factory) -> Iterator[tuple[ManagedProcess, str]]:
    """The router under test (``--sync-joiners`` left at its default), over the first two workers; two
    data-plane processes, so the catch-up reaches routing through the control process's snapshots."""
    proc, url = start_router(
        fleet.urls[:2],
        admin_key=ADMIN_KEY,
        state_dir=tmp_path_factory.mktemp("state"),
        extra_args=["--data-plane-processes", "2"],
    )
    yield proc, url
    proc.stop()


def admin(method: str, url: str, body: Any = None) -> Any:
    status, answer = http_json(method, url, body, headers=auth(), timeout=60)
    assert status in (200, 201), (status, answer)
    return answer


def record(router_url: str, worker_url: str) -> dict[str, Any]:
    return by_url(router_url, ADMIN_KEY)[worker_url]


def routable(router_url: str, worker_url: str) -> bool:
    w = record(router_url, worker_url)
    return w["health"] == "healthy" and not w["disabled"] and w["pending"] is None


def checksum(worker_url: str) -> str:
    return admin("POST", worker_url + "/weights_checker", {"action": "checksum"})["per_gpu_checksum"]


def generated_tokens(worker_url: str) -> int:
    return admin("GET", worker_url + "/server_info")["internal_states"][0]["generated_tokens"]


def snapshots_sent(proc: ManagedProcess) -> int:
    return proc.log_text(1_000_000).count("weights_snapshot: sending")


def update_from_disk(router_url: str, model: Path, label: str) -> None:
    answer = admin(
        "POST", router_url + "/update_weights_from_disk", {"model_path": str(model), "weight_version": label}
    )
    assert answer["success"], answer


def restart(proc: ManagedProcess, url: str) -> None:
    proc.kill()
    proc.start()
    proc.wait_http_ready(url + "/health", timeout=90)


async def test_a_catch_up_is_recorded_only_on_the_entry_it_copied() -> None:
    """``FleetWeights.caught_up``: the joiner becomes a holder of the latest entry, never of one the fleet left."""
    fleet = FleetWeights(None)
    holder = WorkerWeights(weight_version="v1", weight_state="serving", instance_id="i-holder")
    await fleet.changed([("holder", holder)])
    joiner = WorkerWeights(weight_version="v1", weight_state="serving", instance_id="i-joiner")
    assert fleet.verified_sequence("joiner", joiner) is None
    copied = fleet.latest_sequence
    await fleet.changed([("holder", holder.model_copy(update={"weight_version": "v2"}))])
    assert not await fleet.caught_up("joiner", joiner, copied)  # the fleet moved on meanwhile
    stale_label = joiner.model_copy(update={"weight_version": "v1"})
    assert not await fleet.caught_up("joiner", stale_label, fleet.latest_sequence)  # not the fleet's label
    partial = WorkerWeights(weight_version="v2", weight_state="partial", instance_id="i-joiner")
    assert not await fleet.caught_up("joiner", partial, fleet.latest_sequence)
    assert fleet.verified_sequence("joiner", joiner) is None
    loaded = joiner.model_copy(update={"weight_version": "v2"})
    assert await fleet.caught_up("joiner", loaded, fleet.latest_sequence)
    assert fleet.verified_sequence("joiner", loaded) == fleet.latest_sequence == 2
    assert fleet.verified_sequence("holder", holder.model_copy(update={"weight_version": "v2"})) == 2


class _PolicyOnly:
    """The parts of an admin context the eligibility rule reads (no worker is called)."""

    def __init__(self, registry: WorkerRegistry, journal: UpdateJournal):
        self.registry = registry
        self.journal = journal


class _NoLease:
    identity, holder = "standby", "another replica"

    def seconds_until_free(self) -> float:
        return 10.0

    def holds_lease(self) -> bool:
        return False


async def test_who_catches_up_and_from_whom() -> None:
    registry, journal = WorkerRegistry(), UpdateJournal(None)
    holder, joiner, stale = (registry.add(f"http://127.0.0.1:{port}", engine="omni") for port in (1, 2, 3))
    for n, w in enumerate((holder, joiner, stale)):
        w.health, w.weight_state, w.weight_version, w.instance_id = "healthy", "serving", "v1", f"i-{n}"
    sync = JoinerSync(cast(AdminContext, _PolicyOnly(registry, journal)), cast(Any, None), headers={})
    assert not sync.eligible(joiner)  # no weight change yet: boot weights are the fleet's
    await registry.fleet.changed([(holder.id, holder.weights), (stale.id, stale.weights)])
    holder.weight_version = "v2"
    await registry.fleet.changed([(holder.id, holder.weights)], targets=[holder.id])  # leaves ``stale`` behind
    assert [sync.eligible(w) for w in (holder, joiner, stale)] == [False, True, False]
    assert sync.sources(joiner) == [holder]
    for field, value in (("disabled", True), ("weight_state", "partial"), ("update_holds", 1), ("health", "dead")):
        before = getattr(joiner, field)
        setattr(joiner, field, value)
        assert not sync.eligible(joiner), field
        setattr(joiner, field, before)
    await journal.begin("/update_weights_from_disk", [(joiner.id, joiner.url, False)])
    assert not sync.eligible(joiner)  # fenced by an unresolved update: an operator decides
    await journal.clear()
    holder.weight_version = "rogue"  # changed behind the router: pending, and a candidate itself
    assert sync.eligible(holder) and sync.sources(joiner) == []
    assert [backoff_s(n) for n in (1, 2, 3, 6, 20)] == [2.0, 4.0, 8.0, 60.0, 60.0]


async def test_a_standby_changes_no_worker() -> None:
    """Behind a closed leader gate the scan reads nothing and calls nothing."""
    sync = JoinerSync(cast(AdminContext, None), cast(Any, None), headers={}, leader=LeaderGate(_NoLease()))
    await sync.scan()


def test_with_sync_joiners_off_a_joiner_stays_pending(fleet: Fleet, checkpoints, tmp_path):
    proc, url = start_router(fleet.urls[:2], admin_key=ADMIN_KEY, extra_args=["--sync-joiners", "off"])
    try:
        update_from_disk(url, checkpoints["llama_b"], "v1")
        admin("POST", url + "/workers", {"url": fleet.urls[2]})
        wait_for(lambda: record(url, fleet.urls[2])["health"] == "healthy", 30, proc, "the joiner's first probe")
        # Six scans' worth of time (the catch-up loop scans every 0.5 s when it runs): nothing may change.
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            joiner = record(url, fleet.urls[2])
            assert "joined or restarted" in (joiner["pending"] or ""), joiner
            assert joiner["catch_up"] is None and joiner["weight_version"] == "default", joiner
            time.sleep(0.2)
        assert "caught up" not in proc.log_text(1_000_000)
    finally:
        proc.stop()


def test_a_joiner_catches_up_from_a_peer_before_it_takes_traffic(fleet: Fleet, router, checkpoints):
    proc, url = router
    update_from_disk(url, checkpoints["llama_b"], "v1")
    update_from_disk(url, checkpoints["llama_b"], "v2")
    joiner_url = fleet.urls[2]
    assert admin("GET", joiner_url + "/model_info")["weight_version"] == "default"
    joiner = admin("POST", url + "/workers", {"url": joiner_url})["id"]

    # Traffic meanwhile: none of it reaches the joiner until the router records it as a holder.
    deadline = time.monotonic() + CATCH_UP_S
    served = 0
    while True:
        tokens = generated_tokens(joiner_url)  # read before the record: a later "pending" covers it
        if routable(url, joiner_url):
            break
        assert tokens == 0, "the joiner generated before it was routable"
        status, body, worker = generate_via(url)
        assert status == 200 and worker != joiner and body["meta_info"]["weight_version"] == "v2", (status, body)
        served += 1
        assert time.monotonic() < deadline, proc.log_text()
    assert served > 0

    holder = checksum(fleet.urls[0])
    assert checksum(joiner_url) == holder
    assert record(url, joiner_url)["weight_version"] == "v2" and record(url, joiner_url)["catch_up"] is None
    status, out = http_json(
        "POST",
        joiner_url + "/generate",
        {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True},
        },
        headers=auth(),
    )
    assert status == 200 and out["output_ids"] == transformers_greedy(checkpoints["llama_b"], PROMPT, NEW_TOKENS), out
    # The joiner is recorded (and routed to) before its catch-up is logged and counted, which may follow later
    # on a loaded machine: polled, bounded.
    caught_up = f"worker {joiner} ({joiner_url}) caught up from"
    wait_for(lambda: caught_up in proc.log_text(1_000_000), 30, proc, "the catch-up's log line")
    success = 'omni_router_catch_ups_total{outcome="success"} 1.0'
    wait_for(lambda: success in http_json("GET", url + "/metrics")[1], 30, proc, "the catch-up counted")


def test_a_restarted_worker_catches_up_from_another_source_when_its_source_dies(fleet: Fleet, router):
    proc, url = router
    sink_url = fleet.urls[1]
    sources = (0, 2)
    streams_before = {i: snapshots_sent(fleet.procs[i]) for i in sources}
    restart(fleet.procs[1], sink_url)

    # The router sees the new process, picks a source and starts the load: kill that source mid-transfer.
    def streaming() -> int | None:
        return next((i for i in sources if snapshots_sent(fleet.procs[i]) > streams_before[i]), None)

    wait_for(lambda: streaming() is not None, CATCH_UP_S, proc, "a source streaming to the restarted worker")
    source = streaming()
    assert source is not None
    fleet.procs[source].kill()

    wait_for(
        lambda: (record(url, sink_url)["catch_up"] or {}).get("state") == "failed",
        CATCH_UP_S,
        proc,
        "the failed attempt",
    )
    failed = record(url, sink_url)
    assert failed["pending"] and failed["catch_up"]["attempts"] == 1 and failed["catch_up"]["last_error"], failed
    wait_for(lambda: routable(url, sink_url), CATCH_UP_S, proc, "the catch-up from the other source")
    other = next(u for i, u in enumerate(fleet.urls) if i not in (1, source))
    assert checksum(sink_url) == checksum(other)
    assert record(url, sink_url)["weight_version"] == "v2"
    assert f"caught up from {record(url, other)['id']}" in proc.log_text(1_000_000)

    # The killed source, restarted on checkpoint A, catches up the same way.
    restart(fleet.procs[source], fleet.urls[source])
    wait_for(lambda: routable(url, fleet.urls[source]), CATCH_UP_S, proc, "the restarted source caught up")
    assert checksum(fleet.urls[source]) == checksum(other)


def test_a_trainer_sync_after_catch_ups_reaches_every_worker(fleet: Fleet, router, checkpoints, tmp_path):
    proc, url = router
    assert all(routable(url, u) for u in fleet.urls)
    done, report = run_trainer(url, str(checkpoints["llama"]), tmp_path, [["two_phase", None]])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "error" not in report, json.dumps(report.get("error"), indent=1)[:3000] + proc.log_text()
    assert report["world_size"] == 4
    step = report["steps"][0]
    assert step["fleet_identical"] is True and step["matches_expected"] is True, step
    assert all(routable(url, u) and record(url, u)["weight_version"] == "step-0" for u in fleet.urls)
