"""The weight-version policy without HTTP: the fleet's version history, who holds which entry,
what each policy admits, and the answer stamping's version check.

The same rules run behind real workers in tests/test_router_version_routing.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from router.contract.errors import BadRequest, Unavailable
from router.contract.version_policy import LATEST_ONLY, VersionPolicy, parse_version_policy
from router.gateway.data_planes.mirror import VIEW_FIELDS, ViewCache, apply, same_routing, view_of
from router.gateway.fleet.registry import Worker, WorkerRegistry
from router.gateway.fleet.weights import FLEET_FILE, HISTORY_LIMIT, FleetWeights, WorkerWeights, agreed_checksum
from router.gateway.routing.stamping import answer_mixes_versions
from router.gateway.routing.version_policy import candidates, policy_from_headers, refusal


def fleet_of(n: int, state: Path | None = None) -> tuple[WorkerRegistry, list[Worker]]:
    registry = WorkerRegistry(fleet=FleetWeights(state))
    workers = [registry.add(f"http://127.0.0.1:{9000 + i}") for i in range(n)]
    for i, w in enumerate(workers):
        w.health = "healthy"
        w.instance_id = f"process-{i}"
        w.weight_version = "boot"
    return registry, workers


def update(registry: WorkerRegistry, moved: list[Worker], label: str, *, targets: list[Worker] | None = None) -> None:
    """A weight change that succeeded on ``moved`` (of ``targets``; the whole fleet when ``None``), told
    about the other workers as the admin run tells it."""
    for w in moved:
        w.weight_version = label
    ids = None if targets is None else [w.id for w in targets]
    others = [(w.id, w.weights) for w in registry if ids is None or w.id not in ids]
    asyncio.run(registry.fleet.changed(((w.id, w.weights) for w in moved), targets=ids, bystanders=others))


def served(registry: WorkerRegistry, policy: str, tried: frozenset[str] = frozenset()) -> set[str]:
    return {w.id for w in candidates(registry, parse_version_policy(policy), tried, {})}


def test_policies_parse_in_each_form_and_name_the_forms_when_bad() -> None:
    assert parse_version_policy("latest-only") is LATEST_ONLY
    assert parse_version_policy(" Max-Staleness:3 ") == VersionPolicy("max-staleness", staleness=3)
    assert parse_version_policy("min-version:v7").min_version == "v7"
    assert parse_version_policy("min-version:v7").text == "min-version:v7"
    assert parse_version_policy("any").kind == "any"
    for bad in ("", "newest", "max-staleness", "max-staleness:-1", "max-staleness:x", "min-version:", "any:1"):
        with pytest.raises(ValueError, match="latest-only, max-staleness:K"):
            parse_version_policy(bad)
    assert policy_from_headers(None, LATEST_ONLY) is LATEST_ONLY
    with pytest.raises(BadRequest) as caught:
        policy_from_headers("sometimes", LATEST_ONLY)
    assert caught.value.status == 400 and "X-Version-Policy" in caught.value.message


def test_a_record_written_before_the_history_reads_as_a_one_entry_history(tmp_path: Path) -> None:
    (tmp_path / FLEET_FILE).write_text(
        json.dumps({"weight_version": "v3", "changed_at": 12.5, "holders": {"w-a": "process-a", "w-b": "process-b"}})
    )
    fleet = FleetWeights(tmp_path)
    record = fleet.record
    assert record is not None
    assert [(e.sequence, e.weight_version, e.changed_at) for e in record.history] == [(1, "v3", 12.5)]
    assert record.weight_version == "v3" and fleet.latest_sequence == 1
    on_v3 = WorkerWeights(weight_version="v3", instance_id="process-a")
    assert fleet.verified_sequence("w-a", on_v3) == 1 and fleet.why_not_serving("w-a", on_v3) is None
    elsewhere = WorkerWeights(weight_version="v4", instance_id="process-b")
    assert fleet.verified_sequence("w-b", elsewhere) is None
    # The next change appends entry 2 and writes the new format, which reads back the same.
    asyncio.run(fleet.changed([("w-a", WorkerWeights(weight_version="v4", instance_id="process-a"))]))
    again = FleetWeights(tmp_path)
    assert again.record == fleet.record and again.latest_sequence == 2


def test_a_rolling_update_keeps_the_untargeted_worker_one_version_stale() -> None:
    registry, (a, b) = fleet_of(2)
    update(registry, [a, b], "v1")
    update(registry, [a], "v2", targets=[a])
    assert served(registry, "latest-only") == {a.id}
    assert served(registry, "max-staleness:1") == {a.id, b.id}
    assert served(registry, "max-staleness:0") == {a.id}
    assert registry.record(b).staleness == 1 and registry.record(b).fleet_sequence == 1
    assert registry.is_routable(a) and not registry.is_routable(b)
    assert "1 behind" in (registry.pending_reason(b) or "")
    update(registry, [a], "v3", targets=[a])
    assert served(registry, "max-staleness:1") == {a.id}
    assert served(registry, "max-staleness:2") == {a.id, b.id}
    assert served(registry, "any") == {a.id, b.id}


def test_a_first_update_of_part_of_the_fleet_keeps_the_others_on_their_boot_weights() -> None:
    registry, (a, b, c) = fleet_of(3)
    c.weight_state = "partial"  # holds no whole boot checkpoint: not recorded on the boot entry
    update(registry, [a], "v1", targets=[a])
    assert served(registry, "latest-only") == {a.id}
    assert served(registry, "max-staleness:1") == {a.id, b.id}
    assert registry.record(b).fleet_sequence == 0 and registry.record(b).staleness == 1
    assert registry.pending_reason(c) is not None and c.id not in served(registry, "any")
    b.weight_version = "relabelled"  # behind the router's back: no longer the boot weights it recorded
    assert served(registry, "any") == {a.id}


def test_a_target_that_failed_loses_its_entry_and_a_whole_fleet_change_replaces_every_holder() -> None:
    registry, (a, b, c) = fleet_of(3)
    update(registry, [a, b, c], "v1")
    update(registry, [a], "v2", targets=[a, b])  # b was targeted and failed; c was not targeted
    assert served(registry, "any") == {a.id, c.id}
    assert registry.record(b).fleet_sequence is None and "joined or restarted" in (registry.pending_reason(b) or "")
    update(registry, [a], "v3")  # targets=None: today's whole-fleet rule
    assert served(registry, "any") == {a.id}


def test_min_version_admits_the_named_entry_and_later_ones_and_numbers_compare() -> None:
    registry, (a, b) = fleet_of(2)
    update(registry, [a, b], "1")
    update(registry, [a], "2", targets=[a])
    assert served(registry, "min-version:1") == {a.id, b.id}
    assert served(registry, "min-version:2") == {a.id}
    assert served(registry, "min-version:1.5") == {a.id}  # unknown, compared as a number
    assert served(registry, "min-version:0.5") == {a.id, b.id}
    assert served(registry, "min-version:9") == set()
    with pytest.raises(BadRequest) as caught:
        served(registry, "min-version:v-next")
    assert "recorded versions: 1, 2" in caught.value.message


def test_min_version_reads_labels_as_trainers_write_them() -> None:
    """``step-12``, ``v12``, ``rollout_12``: the trailing integer orders them; one not published yet admits none
    (the caller retries later: a 503), never a 400."""
    registry, (a, b) = fleet_of(2)
    update(registry, [a, b], "step-9")
    update(registry, [a], "step-12", targets=[a])
    assert served(registry, "min-version:step-10") == {a.id}
    assert served(registry, "min-version:v9") == {a.id, b.id}  # another spelling, the same number
    assert served(registry, "min-version:rollout_12") == {a.id}
    assert served(registry, "min-version:step-13") == set()  # not published yet: no worker, no 400


def test_a_reused_label_does_not_make_old_weights_current() -> None:
    registry, (a, b) = fleet_of(2)
    update(registry, [a, b], "default")
    update(registry, [a], "v1", targets=[a])
    update(registry, [a], "default", targets=[a])  # the label comes back on newer weights
    assert registry.fleet.latest_sequence == 3
    assert served(registry, "latest-only") == {a.id}
    assert served(registry, "min-version:default") == {a.id}  # its latest use
    assert registry.record(b).staleness == 2


def test_weights_the_router_never_recorded_are_eligible_under_no_policy() -> None:
    registry, (a, b, c, d) = fleet_of(4)
    update(registry, [a, b, c, d], "v1")
    b.instance_id = "a-restarted-process"
    c.weight_version = "changed-behind-the-router"
    d.weight_state = "partial"
    for policy in ("latest-only", "max-staleness:100", "min-version:v1", "any"):
        assert served(registry, policy) == {a.id}, policy
    assert "behind the router" in (registry.pending_reason(c) or "")
    filtered: dict[str, int] = {}
    candidates(registry, parse_version_policy("any"), frozenset(), filtered)
    assert filtered == {"pending": 3}


def test_fenced_unhealthy_and_departed_workers_are_never_eligible() -> None:
    registry, (a, b, c, d) = fleet_of(4)
    update(registry, [a, b, c, d], "v1")
    b.disabled, c.health, d.departed = True, "unhealthy", "pod deleted"
    filtered: dict[str, int] = {}
    assert {w.id for w in candidates(registry, parse_version_policy("any"), frozenset(), filtered)} == {a.id}
    assert filtered == {"fenced": 2, "unhealthy": 1}


def test_paused_workers_take_requests_only_when_every_eligible_worker_is_paused() -> None:
    registry, (a, b) = fleet_of(2)
    registry.observe_control("/pause_generation", [a.id])
    filtered: dict[str, int] = {}
    assert [w.id for w in candidates(registry, LATEST_ONLY, frozenset(), filtered)] == [b.id]
    assert filtered == {"paused": 1}
    registry.observe_control("/pause", [b.id])  # vLLM's spelling
    assert {w.id for w in candidates(registry, LATEST_ONLY, frozenset(), {})} == {a.id, b.id}  # they wait there
    registry.observe_control("/continue_generation", [a.id])
    registry.observe_control("/sleep", [a.id])
    assert registry.record(a).asleep and not registry.record(a).paused and registry.record(b).paused
    registry.observe_control("/wake_up", [a.id])
    registry.observe_control("/flush_cache", [a.id, b.id])  # no control effect
    assert [w.id for w in candidates(registry, LATEST_ONLY, frozenset(), {})] == [a.id]


def test_the_history_is_bounded_and_sequences_only_grow() -> None:
    registry, (a,) = fleet_of(1)
    for i in range(HISTORY_LIMIT + 5):
        update(registry, [a], f"v{i % 3}")
    record = registry.fleet.record
    assert record is not None and len(record.history) == HISTORY_LIMIT
    sequences = [e.sequence for e in record.history]
    assert sequences == list(range(6, HISTORY_LIMIT + 6))
    assert served(registry, "latest-only") == {a.id}


def test_no_eligible_worker_is_a_503_that_names_the_policy_and_who_holds_what() -> None:
    registry, (a, b) = fleet_of(2)
    update(registry, [a, b], "v1")
    update(registry, [a], "v2", targets=[a])
    a.disabled = True
    error = refusal(registry, parse_version_policy("max-staleness:0"), "fleet state")
    assert isinstance(error, Unavailable) and error.status == 503 and error.headers["Retry-After"]
    assert "'max-staleness:0'" in error.message and "'v1'" in error.message and "stale" in error.message
    assert error.extra["workers"][b.id]["staleness"] == 1 and error.extra["workers"][a.id]["left_out"] == "fenced"
    assert refusal(registry, LATEST_ONLY, "fleet state").message == "fleet state"


def test_an_agreed_checksum_is_recorded_and_a_disagreement_is_none() -> None:
    class Answer:
        def __init__(self, checksum: str | None):
            self.checksum = checksum

    assert agreed_checksum([Answer("abc"), Answer("abc")]) == "abc"
    assert agreed_checksum([Answer("abc"), Answer("abd")]) is None
    assert agreed_checksum([object()]) is None


def test_the_data_planes_copy_carries_the_history_and_the_control_state() -> None:
    registry, (a, b) = fleet_of(2)
    update(registry, [a, b], "v1")
    update(registry, [a], "v2", targets=[a])
    registry.observe_control("/pause_generation", [b.id])
    copy = WorkerRegistry(fleet=FleetWeights(None))
    apply(copy, view_of(registry, 1))
    assert copy.fleet.record == registry.fleet.record and copy.fleet.latest_sequence == 2
    assert served(copy, "max-staleness:1") == {a.id}  # b is eligible, but paused
    assert copy.get(b.id).paused and copy.record(copy.get(b.id)).staleness == 1


def test_a_mixed_answer_is_told_from_one_that_names_only_the_picked_version() -> None:
    def answer(*spans: str, last: str | None = None) -> bytes:
        meta = {
            "weight_version": last or spans[-1],
            "weight_versions": [{"version": v, "start": i, "end": i + 1} for i, v in enumerate(spans)],
        }
        return json.dumps({"text": 'a "version": "v9"', "meta_info": meta}).encode()

    assert not answer_mixes_versions(answer("v1", "v1"), "v1")
    assert answer_mixes_versions(answer("v1", "v2"), "v1")
    assert answer_mixes_versions(answer("v2"), "v1")  # the worker moved after the pick
    assert answer_mixes_versions(json.dumps([json.loads(answer("v1")), json.loads(answer("v2"))]).encode(), "v1")
    assert not answer_mixes_versions(b'{"meta_info": {"weight_version": "v1"}}', "v1")
    assert not answer_mixes_versions(b"not json", "v1")


def test_a_snapshot_reuses_the_view_of_every_worker_whose_routing_state_it_saw_before() -> None:
    """A fence raised and lowered on the whole fleet builds no worker's view twice (the control process
    publishes a snapshot at each), and the snapshots that say the same hold the same objects."""
    registry, (a, b) = fleet_of(2)
    a.engine, a.tp_size, a.reported_paused, a.departed = "vllm", 2, True, "pod gone"
    views = ViewCache()
    before = view_of(registry, 1, views=views)
    first = before.workers[0]
    assert first.model_dump() == {name: getattr(a, name) for name in VIEW_FIELDS}  # every field, in its place
    for w in (a, b):
        w.disabled = True
    fenced = view_of(registry, 2, views=views)
    assert fenced.workers[0] is not first and fenced.workers[0].disabled and not same_routing(before, fenced)
    for w in (a, b):
        w.disabled = False
    after = view_of(registry, 3, views=views)
    assert all(x is y for x, y in zip(after.workers, before.workers, strict=True)) and same_routing(before, after)
    assert view_of(registry, 4, views=views).workers[1] is after.workers[1]
    b.health = "dead"
    assert view_of(registry, 5, views=views).workers[1].health == "dead"
