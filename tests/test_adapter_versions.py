"""Versioned LoRA adapters (``name@version``) in the router, without worker processes: which version a request
means, the body the worker is sent, what a load of a version is refused for, which versions a publish drops,
and catch-up on an SGLang server that already holds a copy the router does not know (over real HTTP, against a
small server that answers SGLang's LoRA routes as SGLang 0.5.23 does). The fleet behaviour with real workers is
``tests/test_router_lora_versions.py``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, cast

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from router.contract.errors import Conflict, NotFound, Unavailable
from router.contract.lora import split_version
from router.gateway.admin.locked import ONE_PROCESS, AdminContext
from router.gateway.admin.update_gate import UpdateGate
from router.gateway.catch_up.adapters import AdapterCatchUp
from router.gateway.fleet.adapters import FleetAdapters
from router.gateway.fleet.registry import WorkerRegistry
from router.gateway.routing.adapter_names import renamed_body
from router.gateway.sync.adapter_versions import outdated, refuse_over_bound, refuse_taken
from router.gateway.upstream.client import WorkerClient


@dataclass
class _Worker:
    id: str
    instance_id: str | None


A, B = _Worker("w-a", "i1"), _Worker("w-b", "i2")


def _published(*names: str) -> FleetAdapters:
    table = FleetAdapters()
    for name in names:
        table.record_load(name, f"/adapters/{name}", [A, B])
    return table


def test_a_version_is_split_from_the_name_at_its_last_at() -> None:
    assert split_version("policy@v7") == ("policy", "v7")
    assert split_version("team@policy@3") == ("team@policy", "3")
    assert [split_version(n) for n in ("policy", "@v1", "policy@", "a:b")] == [None] * 4


def test_the_name_alone_means_the_latest_version_and_a_version_pins_itself() -> None:
    table = _published("policy@v2", "policy@v10", "other")  # published order, not the versions' spelling
    named = table.resolve({"lora_path": "policy"})
    assert named.names == {"policy@v10"} and named.renamed == {"policy": "policy@v10"}
    assert table.resolve({"lora_path": "policy@v2"}) == (frozenset({"policy@v2"}), None)
    assert table.resolve({"model": "policy"}).renamed == {"policy": "policy@v10"}
    assert table.resolve({"model": "Qwen/base:policy"}).renamed == {"policy": "policy@v10"}
    assert table.resolve({"lora_path": [None, "policy", "other"]}).names == {"policy@v10", "other"}
    assert table.resolve({"model": "Qwen/base"}).names == frozenset()  # the base model
    assert table.resolve({"lora_path": "other"}).renamed is None
    with pytest.raises(NotFound, match=r"version 'v9' of LoRA adapter 'policy' is not held .*policy@v2, policy@v10"):
        table.resolve({"lora_path": "policy@v9"})
    with pytest.raises(NotFound, match="version 'v9'"):
        table.resolve({"model": "policy@v9"})  # not the base model: the caller meant a version
    # A version being dropped serves nobody new; the latest moves back only to a version still routed.
    table.stop_serving("policy@v10")
    assert table.resolve({"lora_path": "policy"}).names == {"policy@v2"}
    with pytest.raises(NotFound, match="'policy@v10' is being unloaded"):
        table.resolve({"lora_path": "policy@v10"})
    table.stop_serving("policy@v2")
    with pytest.raises(NotFound, match="no version of LoRA adapter 'policy' is being served"):
        table.resolve({"lora_path": "policy"})


def test_a_data_plane_resolves_from_the_table_it_was_sent() -> None:
    plane = FleetAdapters()
    plane.replace(_published("policy@v1", "policy@v2").table())
    assert plane.resolve({"lora_path": "policy"}).names == {"policy@v2"}
    assert [e.published for e in plane.table().adapters] == [1, 2]


def test_the_forwarded_body_names_the_version() -> None:
    renamed = {"policy": "policy@v3"}
    body = json.dumps({"rid": "r1", "lora_path": ["policy", None, "x"], "text": ["a", "b", "c"]}).encode()
    assert json.loads(renamed_body(body, renamed)) == {
        "rid": "r1",
        "lora_path": ["policy@v3", None, "x"],
        "text": ["a", "b", "c"],
    }
    assert json.loads(renamed_body(b'{"model": "policy", "prompt": "hi"}', renamed))["model"] == "policy@v3"
    assert json.loads(renamed_body(b'{"model": "base:policy"}', renamed))["model"] == "base:policy@v3"


def test_a_version_is_never_loaded_twice_and_a_name_means_one_thing() -> None:
    table = _published("policy@v1", "plain")
    refuse_taken(table, "policy@v2")
    refuse_taken(table, "fresh@v1")
    refuse_taken(table, "plain")  # an update of a plain adapter stays what it was
    for name, said in (
        ("policy@v1", "a version never changes"),
        ("policy", "loaded as versions"),
        ("plain@v1", "loaded without a version"),
    ):
        with pytest.raises(Conflict, match=said) as refused:
            refuse_taken(table, name)
        assert refused.value.status == 409


def test_a_publish_drops_what_is_older_than_the_newest_n() -> None:
    table = _published("policy@a", "policy@b", "policy@c", "other@v1")
    table.keep_versions = 2
    assert outdated(table, "policy") == ["policy@a"]
    table.keep_versions = 1
    assert outdated(table, "policy") == ["policy@a", "policy@b"]
    assert outdated(table, "other") == [] and outdated(table, "nothing") == []
    # Versions a holder failed to unload are still outdated: the next version is not sent (503), nothing changes.
    with pytest.raises(Unavailable, match="policy@a, policy@b of LoRA adapter 'policy' are outside the newest 1") as r:
        refuse_over_bound(table, "policy", "policy@d")
    assert r.value.status == 503
    table.remove("policy@a")
    table.remove("policy@b")
    refuse_over_bound(table, "policy", "policy@d")


# -- catch-up on an SGLang server that holds a copy the router does not know ----------------------------------


class _SglangLora:
    """SGLang 0.5.23's LoRA routes as its server answers them: a name it holds is refused ("already loaded")."""

    def __init__(self, held: dict[str, str]) -> None:
        self.held = held
        self.calls: list[tuple[str, str, str | None]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/load_lora_adapter", self.load)
        app.router.add_post("/unload_lora_adapter", self.unload)
        return app

    async def load(self, request: web.Request) -> web.Response:
        body = await request.json()
        name = body["lora_name"]
        self.calls.append(("load", name, body.get("lora_path")))
        if name in self.held:
            error = f"Failed to load LoRA adapter {name} because it is already loaded"
            answer = {"success": False, "error_message": error, "loaded_adapters": self.held}
            return web.json_response(answer, status=400)
        self.held[name] = body["lora_path"]
        return web.json_response({"success": True, "error_message": None, "loaded_adapters": self.held})

    async def unload(self, request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        self.calls.append(("unload", name, None))
        self.held.pop(name, None)
        return web.json_response({"success": True, "error_message": None, "loaded_adapters": self.held})


@pytest.fixture
async def sglang() -> AsyncIterator[tuple[_SglangLora, str]]:
    server = _SglangLora({"policy@v1": "/stale/copy"})
    site = TestServer(server.app(), host="127.0.0.1")
    await site.start_server()
    try:
        yield server, str(site.make_url("")).rstrip("/")
    finally:
        await site.close()


class _Context:
    """What the adapter catch-up reads of an admin context."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry
        self.gate = UpdateGate(5.0)
        self.barrier = ONE_PROCESS


async def test_a_copy_sglang_already_holds_is_unloaded_and_the_fleets_loaded(sglang: Any) -> None:
    server, url = sglang
    registry = WorkerRegistry()
    worker = registry.add(url, engine="sglang")
    worker.health, worker.weight_state, worker.instance_id = "healthy", "serving", "i-1"
    registry.adapters.record_load("policy@v1", "/fleet/policy-v1", [])  # the fleet's; the worker's is unknown
    client = WorkerClient(stream_limit=4, connect_timeout_s=2.0)
    try:
        catch_up = AdapterCatchUp(cast(AdminContext, _Context(registry)), client, headers={})
        assert catch_up.missing(worker) is not None
        assert await catch_up.give(worker, "policy@v1", 0)
    finally:
        await client.close()
    assert server.calls == [
        ("load", "policy@v1", "/fleet/policy-v1"),
        ("unload", "policy@v1", None),
        ("load", "policy@v1", "/fleet/policy-v1"),
    ]
    assert server.held == {"policy@v1": "/fleet/policy-v1"}
    assert registry.adapters.holds(worker, "policy@v1") and catch_up.missing(worker) is None
