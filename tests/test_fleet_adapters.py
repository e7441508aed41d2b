"""The router's table of fleet LoRA adapters: which name a request means, who may serve it, and how a
load, a failed rollback and an unload change it. No process: the table alone."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from router.contract.errors import NotFound
from router.gateway.fleet.adapters import FleetAdapters
from router.gateway.sync.adapters import REPORTS_CATCH_UP_S


@dataclass
class _Worker:
    id: str
    instance_id: str | None


A, B = _Worker("w-a", "i1"), _Worker("w-b", "i2")


def _table() -> FleetAdapters:
    table = FleetAdapters()
    table.record_load("policy", "/ckpt/policy", [A, B])
    return table


def test_a_request_names_adapters_by_lora_path_or_model() -> None:
    table = _table()
    assert table.named_by({"lora_path": "policy"}) == {"policy"}
    assert table.named_by({"lora_path": [None, "policy"]}) == {"policy"}
    assert table.named_by({"model": "policy"}) == {"policy"}
    assert table.named_by({"model": "Qwen/base:policy"}) == {"policy"}
    # A model that names no adapter is the base model; nothing at all is the base model.
    assert table.named_by({"model": "Qwen/base"}) == frozenset()
    assert table.named_by({"model": "llama3:8b"}) == frozenset()
    assert table.named_by({}) == frozenset() and table.named_by(None) == frozenset()
    with pytest.raises(NotFound, match="'other' is not loaded on the fleet \\(loaded: policy\\)"):
        table.named_by({"lora_path": ["policy", "other"]})
    # Without any adapter a lora_path is still refused, not passed to a worker that may hold anything.
    with pytest.raises(NotFound, match="loaded: none"):
        FleetAdapters().named_by({"lora_path": "policy"})


def test_only_holders_of_the_fleet_version_from_the_same_process_serve() -> None:
    table = _table()
    assert table.holds(A, "policy") and table.holds_all(B, ["policy"])
    assert not table.holds(_Worker("w-a", "i9"), "policy")  # restarted: holds nothing
    assert not table.holds(_Worker("w-c", "i3"), "policy")  # joined later
    table.record_load("policy", "/ckpt/policy-v2", [A])  # only A took version 2
    assert table.get("policy").version == 2 and table.holds(A, "policy") and not table.holds(B, "policy")
    table.forget_holders("policy", ["w-a"])
    assert not table.holds(A, "policy") and table.get("policy").holders == {}
    # Catch-up gives a worker the fleet version; a version the fleet has left is not recorded.
    table.add_holder("policy", "w-b", 2, "i2")
    table.add_holder("policy", "w-a", 1, "i1")
    assert table.holds(B, "policy") and not table.holds(A, "policy")


def test_an_unload_stops_routing_first_and_can_be_undone() -> None:
    table = _table()
    before = table.key()
    table.stop_serving("policy")
    assert table.key() != before  # a change the snapshot carries
    assert not table.holds(A, "policy")
    with pytest.raises(NotFound, match="'policy' is being unloaded"):
        table.named_by({"lora_path": "policy"})
    table.resume_serving("policy")
    assert table.holds(A, "policy")
    table.remove("policy")
    assert not table and table.table().adapters == []


def test_requests_in_flight_are_counted_per_adapter_across_processes() -> None:
    table = _table()
    table.started({"policy"})
    table.started({"policy"})
    table.inflight_elsewhere = {"policy": 3}
    assert table.in_flight("policy") == 5
    table.ended({"policy"})
    table.ended({"policy"})
    assert table.inflight == {} and table.in_flight("policy") == 3


def test_a_data_plane_copies_the_table_whole() -> None:
    plane = FleetAdapters()
    plane.replace(_table().table())
    assert plane.holds(A, "policy") and plane.serving_names() == ["policy"]
    plane.replace(None)
    assert not plane


def test_an_unload_waits_longer_than_the_data_planes_report_period() -> None:
    from router.gateway.data_planes.hub import LOAD_EVERY_S

    assert REPORTS_CATCH_UP_S >= 2 * LOAD_EVERY_S
