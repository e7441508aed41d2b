"""vLLM's weight-transfer API through the router.

In-process policy tests: the router app (``create_app``, driven by ``aiohttp_client``) in front
of two stand-in workers (small aiohttp apps on 127.0.0.1 that answer the worker contract and
record every call), so every rule is checked without a model: rank planning and group records
for ``/init_weight_transfer_engine``, the update held from ``/start_weight_update`` to
``/finish_weight_update`` (lock, fence, journal, concurrency of ``/update_weights``, failures,
expiry), and ``/pause``, ``/resume``, ``/is_paused``.

:class:`~router.trainer.aio.AsyncRouterClient`'s vLLM calls are checked against the same stand-ins.

The end-to-end tests at the bottom run a real router, two real workers and a trainer process, which
drives the flow with raw HTTP or, in ``client_sync``, with :class:`~router.trainer.client.RouterClient`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from router.contract.fleet import JournalView, WorkerList
from router.contract.fleet_answers import IsPausedFleetAnswer, PauseFleetAnswer, WeightTransferFleetAnswer
from router.gateway import keys
from router.gateway.app import create_app
from router.gateway.config import RouterConfig
from router.trainer import AsyncRouterClient, RouterCallError
from router.trainer.digests import expected_checksum
from tests._polling import until
from tests._router_fixtures import ADMIN_KEY, auth, escaped, generate_via, start_router, start_workers, workers
from tests._router_fixtures import Fleet as WorkerFleet
from tests._weight_sync_fixtures import WORKER_ARGS
from tests.procs import ManagedProcess, free_port, http_json
from worker.model.checkpoint import read_checkpoint

KEY = "vllm-policy-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: The longest any stand-in waits for its peer (a bound, never an assertion on time).
PEER_WAIT_S = 20.0

Reply = tuple[int, dict[str, Any]]


def ok(message: str = "ok", weights: str = "intact", **extra: Any) -> Reply:
    return 200, {"success": True, "message": message, "weights": weights, **extra}


def refused(status: int, message: str, weights: str | None = "intact", **extra: Any) -> Reply:
    body: dict[str, Any] = {"success": False, "message": message, "error": {"message": message}, **extra}
    if weights is not None:
        body["weights"] = weights
    return status, body


@dataclass
class StandIn:
    """A worker that answers the vLLM routes as omni-worker does, and records what it was sent."""

    tp_size: int = 1
    version: str = "boot"
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    calls: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    update_open: bool = False
    paused: bool = False
    #: Per path: the answer to give instead of the normal one (consumed once when it is a list).
    script: dict[str, Reply | list[Reply]] = field(default_factory=dict)
    #: Called inside ``/update_weights`` before it answers (a barrier with the other stand-in).
    on_update: Callable[[], Awaitable[None]] | None = None
    url: str = ""

    def paths(self) -> list[str]:
        return [p for p, _, _ in self.calls]

    def bodies(self, path: str) -> list[dict[str, Any]]:
        return [b for p, _, b in self.calls if p == path]

    def _scripted(self, path: str) -> Reply | None:
        entry = self.script.get(path)
        if isinstance(entry, list):
            return entry.pop(0) if entry else None
        return entry

    async def handle(self, request: web.Request) -> web.Response:
        path = request.path
        raw = await request.read()
        body = json.loads(raw) if raw else {}
        if path not in ("/health", "/model_info", "/get_weight_version"):
            self.calls.append((path, request.query_string, body))
        status, answer = self._scripted(path) or await self._answer(path, request, body)
        return web.json_response(answer, status=status)

    async def _answer(self, path: str, request: web.Request, body: dict[str, Any]) -> Reply:
        if path == "/health":
            return 200, {"status": "ok", "weight_version": self.version, "weight_state": "serving",
                         "instance_id": self.instance_id, "is_paused": self.paused,
                         "weight_update": "open" if self.update_open else None}  # fmt: skip
        if path == "/model_info":
            return 200, {"model_path": "/stand-in", "tp_size": self.tp_size, "weight_version": self.version,
                         "weight_state": "serving", "instance_id": self.instance_id}  # fmt: skip
        if path == "/get_weight_version":
            return 200, {"weight_version": self.version}
        if path == "/init_weight_transfer_engine":
            return ok("joined", join_attempted=True)
        if path == "/start_weight_update":
            if self.update_open:
                return refused(409, "a weight update is already open")
            self.update_open = True
            return ok("weight update started")
        if path == "/update_weights":
            if not self.update_open:
                return refused(409, "no weight update is open")
            if self.on_update is not None:
                await self.on_update()
            return ok("loaded", weights="updated")
        if path == "/finish_weight_update":
            if not self.update_open:
                return refused(409, "no weight update is open")
            self.update_open = False
            if body.get("weight_version") is not None:
                self.version = body["weight_version"]
            return ok("finished", weights="updated", weight_version=self.version)
        if path == "/pause":
            self.paused = True
            return 200, {"status": "paused", "success": True, "message": "paused"}
        if path == "/resume":
            self.paused = False
            return 200, {"status": "resumed", "success": True, "message": "resumed"}
        if path == "/is_paused":
            return 200, {"is_paused": self.paused}
        return refused(404, f"no route {path}")


ServerFactory = Callable[..., Awaitable[TestServer]]


async def serve(aiohttp_server: ServerFactory, stand_in: StandIn) -> None:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", stand_in.handle)
    server = await aiohttp_server(app, host="127.0.0.1")
    stand_in.url = f"http://127.0.0.1:{server.port}"


@dataclass
class Fleet:
    client: TestClient
    workers: list[StandIn]

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        async with self.client.request(method, path, data=data, headers=AUTH) as resp:
            return resp.status, await resp.json()

    async def disabled(self) -> list[bool]:
        workers = WorkerList.model_validate((await self.call("GET", "/workers"))[1]).workers
        return [w.disabled for w in workers]

    async def journal(self) -> Any:
        return JournalView.model_validate((await self.call("GET", "/weight_update_journal"))[1]).pending

    @property
    def lock_held(self) -> bool:
        return self.client.app[keys.GATE].is_busy

    def ids(self) -> list[str]:
        return [w.id for w in self.client.app[keys.REGISTRY]]


def init_body(world_size: int, rank_offset: int = 1, **extra: Any) -> dict[str, Any]:
    info = {"master_address": "127.0.0.1", "master_port": 29999, "rank_offset": rank_offset, "world_size": world_size}
    return {"init_info": {**info, **extra}}


CHUNK = {"update_info": {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}}


@pytest.fixture
def make_fleet(aiohttp_client: Any, aiohttp_server: ServerFactory, tmp_path: Path) -> Callable[..., Awaitable[Fleet]]:
    async def make(stand_ins: list[StandIn], **config: Any) -> Fleet:
        for s in stand_ins:
            await serve(aiohttp_server, s)
        cfg = RouterConfig(
            worker_urls=[s.url for s in stand_ins],
            admin_api_key=KEY,
            state_dir=tmp_path / "state",
            admin_lock_timeout_s=0.5,
            connect_timeout_s=2.0,
            health_check_interval_s=3600.0,
            **config,
        )
        return Fleet(await aiohttp_client(create_app(cfg)), stand_ins)

    return make


@pytest.fixture
async def fleet(make_fleet: Callable[..., Awaitable[Fleet]]) -> Fleet:
    return await make_fleet([StandIn(), StandIn(tp_size=2)])


# -- /init_weight_transfer_engine


async def test_init_plans_ranks_checks_the_world_size_and_records_the_group(fleet: Fleet) -> None:
    first, second = fleet.workers
    status, body = await fleet.call("GET", "/get_world_size")
    assert status == 200 and body["world_size"] == 3  # a vLLM trainer's group is 1 + world_size
    status, body = await fleet.call("POST", "/init_weight_transfer_engine", init_body(3))
    assert status == 400 and body["expected_world_size"] == 4 and "world_size must be 4" in body["error"]["message"]
    assert first.calls == [] and second.calls == [] and await fleet.disabled() == [False, False]

    status, body = await fleet.call("POST", "/init_weight_transfer_engine", init_body(1 + 3, backend="gloo"))
    assert status == 200 and body["success"] and body["message"] == "ok", body
    assert [(r["worker"], r["rank_offset"], r["tp_size"]) for r in body["ranks"]] == [
        (fleet.ids()[0], 1, 1),
        (fleet.ids()[1], 2, 2),
    ]
    # Each worker got the caller's init_info with its own first rank.
    (sent_first,), (sent_second,) = (
        first.bodies("/init_weight_transfer_engine"),
        second.bodies("/init_weight_transfer_engine"),
    )
    assert sent_first["init_info"]["rank_offset"] == 1 and sent_second["init_info"]["rank_offset"] == 2
    assert sent_first["init_info"]["backend"] == "gloo" and sent_second["init_info"]["world_size"] == 4
    assert await fleet.disabled() == [False, False] and await fleet.journal() is None and not fleet.lock_held
    (group,) = (await fleet.call("GET", "/get_world_size"))[1]["groups"]
    assert group["group_name"] == "weight_transfer" and group["world_size"] == 4 and group["matches_fleet"]


async def test_a_failed_join_stays_fenced_and_a_refusal_before_any_join_fences_nothing(fleet: Fleet) -> None:
    second = fleet.workers[1]
    second.script["/init_weight_transfer_engine"] = refused(400, "rendezvous failed: connection refused")
    status, body = await fleet.call("POST", "/init_weight_transfer_engine", init_body(4, group_name="g"))
    assert status == 502 and "stay disabled" in body["message"], body
    assert await fleet.disabled() == [False, True]  # the join was attempted: the group may be half-built
    assert (await fleet.journal()).failed == [fleet.ids()[1]]
    assert (await fleet.call("GET", "/get_world_size"))[1]["groups"] == []
    await fleet.call("POST", "/weight_update_journal/resolve", {"acknowledge": True})

    for s in fleet.workers:
        s.script["/init_weight_transfer_engine"] = refused(400, "backend nccl needs CUDA", join_attempted=False)
    status, body = await fleet.call("POST", "/init_weight_transfer_engine", init_body(4, backend="nccl"))
    assert status == 400 and body["error"]["message"] == "backend nccl needs CUDA", body
    assert await fleet.disabled() == [False, False] and await fleet.journal() is None


# -- one fleet update: start, update_weights × N, finish


def barrier(n: int) -> Callable[[], Awaitable[None]]:
    """Each caller waits until ``n`` have arrived: passes only when all receive at once."""
    arrived = 0
    event = asyncio.Event()

    async def wait() -> None:
        nonlocal arrived
        arrived += 1
        if arrived % n == 0:
            event.set()
        await asyncio.wait_for(event.wait(), PEER_WAIT_S)
        if arrived % n == 0:
            event.clear()

    return wait


async def test_update_or_finish_without_start_is_409_and_touches_no_worker(fleet: Fleet) -> None:
    for path, body in (("/update_weights", CHUNK), ("/finish_weight_update", {"weight_version": "v1"})):
        status, answer = await fleet.call("POST", path, body)
        assert status == 409 and "call /start_weight_update first" in answer["error"]["message"], answer
    assert all(s.calls == [] for s in fleet.workers)
    assert await fleet.disabled() == [False, False] and await fleet.journal() is None and not fleet.lock_held


async def test_a_sync_holds_the_lock_and_fence_from_start_to_finish(fleet: Fleet) -> None:
    both = barrier(2)  # both workers must be receiving at once, or neither answers
    for s in fleet.workers:
        s.on_update = both
    status, body = await fleet.call("POST", "/start_weight_update", {})
    assert status == 200 and body["update_open"] and body["worker_count"] == 2, body
    assert fleet.lock_held and await fleet.disabled() == [True, True]
    assert (await fleet.journal()).state == "in_flight"
    # The update holds the lock: another start is refused at once, fleet-changing calls wait and get 503.
    status, body = await fleet.call("POST", "/start_weight_update", {})
    assert status == 409 and "already open" in body["error"]["message"]
    assert (await fleet.call("POST", "/pause_generation", {}))[0] == 503
    assert (await fleet.call("POST", "/workers", {"url": "http://127.0.0.9:9"}))[0] == 409

    packed = {"update_info": {**CHUNK["update_info"], "packed": True, "packed_buffer_size_bytes": 4}}
    held = fleet.client.app[keys.WEIGHT_TRANSFER].held
    assert held is not None
    for chunk in (CHUNK, packed):
        expires_at = held.expires_at
        status, body = await fleet.call("POST", "/update_weights", chunk)
        assert status == 200 and body["update_open"] and body["message"].startswith("weights received"), body
        assert held.expires_at > expires_at  # each call extends the update's window, as on the workers
    assert all(s.bodies("/update_weights")[1]["update_info"]["packed"] for s in fleet.workers)

    status, body = await fleet.call("POST", "/finish_weight_update", {"weight_version": "v2"})
    assert status == 200 and body["weight_version"] == "v2" and not body["update_open"], body
    assert "finished on all 2 worker(s) (2 chunk(s))" in body["message"] and body["fenced"] == []
    assert await fleet.disabled() == [False, False] and await fleet.journal() is None and not fleet.lock_held
    for s in fleet.workers:
        assert s.paths() == ["/start_weight_update", "/update_weights", "/update_weights", "/finish_weight_update"]
    status, body = await fleet.call("GET", "/get_weight_version")
    assert status == 200 and body["weight_version"] == "v2"
    assert (await fleet.call("POST", "/finish_weight_update", {}))[0] == 409  # it is over


async def test_a_worker_whose_update_fails_is_reported_and_stays_fenced(fleet: Fleet) -> None:
    first, second = fleet.workers
    ids = fleet.ids()
    assert (await fleet.call("POST", "/start_weight_update", {}))[0] == 200
    assert (await fleet.call("POST", "/update_weights", CHUNK))[0] == 200
    second.script["/update_weights"] = [refused(400, "received fewer bytes than announced", weights="partial")]
    status, body = await fleet.call("POST", "/update_weights", CHUNK)
    assert status == 502 and body["fenced"] == [ids[1]] and body["update_open"], body
    assert "fewer bytes" in body["message"] and "call /finish_weight_update" in body["message"]
    # No further chunk goes out: the group can no longer carry a broadcast to every rank.
    status, body = await fleet.call("POST", "/update_weights", CHUNK)
    assert status == 409 and body["fenced"] == [ids[1]] and "no further /update_weights" in body["error"]["message"]
    assert len(first.bodies("/update_weights")) == 2 and len(second.bodies("/update_weights")) == 2

    status, body = await fleet.call("POST", "/finish_weight_update", {"weight_version": "v2"})
    assert status == 502 and body["fenced"] == [ids[1]], body
    assert first.paths()[-1] == "/finish_weight_update" and "/finish_weight_update" not in second.paths()
    assert await fleet.disabled() == [False, True] and not fleet.lock_held
    pending = await fleet.journal()
    assert pending.state == "failed" and pending.failed == [ids[1]]
    # The fleet's weights are the first worker's; the second is pending until an update reaches it.
    workers = (await fleet.call("GET", "/workers"))[1]["workers"]
    assert workers[0]["pending"] is None and workers[1]["pending"] is not None


async def test_a_chunk_every_worker_refuses_is_their_4xx_and_ends_the_update(fleet: Fleet) -> None:
    for s in fleet.workers:
        s.script["/update_weights"] = refused(400, "packed buffer 1 has 96 bytes, announced 64")
    assert (await fleet.call("POST", "/start_weight_update", {"timeout_s": 60}))[0] == 200
    status, body = await fleet.call("POST", "/update_weights", CHUNK)
    assert status == 400 and not body["update_open"] and body["fenced"] == sorted(fleet.ids()), body
    assert "announced 64" in body["error"]["message"] and "the router ended it" in body["message"]
    # Nobody is left to finish it: the lock is free at once, every target stays fenced and reported.
    assert not fleet.lock_held and await fleet.disabled() == [True, True]
    assert (await fleet.journal()).state == "failed"
    status, body = await fleet.call("POST", "/finish_weight_update", {})
    assert status == 409 and "the router ended the last one itself" in body["error"]["message"]


async def test_start_is_refused_when_the_fleet_outgrew_the_group(
    make_fleet: Callable[..., Awaitable[Fleet]], aiohttp_server: ServerFactory
) -> None:
    fleet = await make_fleet([StandIn(), StandIn()])
    assert (await fleet.call("POST", "/init_weight_transfer_engine", init_body(3, group_name="wt")))[0] == 200
    newcomer = StandIn()
    await serve(aiohttp_server, newcomer)
    assert (await fleet.call("POST", "/workers", {"url": newcomer.url}))[0] == 201
    status, body = await fleet.call("POST", "/start_weight_update", {})
    assert status == 409 and "'wt' no longer matches" in body["error"]["message"], body
    assert body["group_changes"] and "joined the fleet" in body["group_changes"][0]
    assert all("/start_weight_update" not in s.paths() for s in [*fleet.workers, newcomer])
    assert not any(await fleet.disabled()) and not fleet.lock_held
    (group,) = (await fleet.call("GET", "/get_world_size"))[1]["groups"]
    assert not group["matches_fleet"]


async def test_a_start_one_worker_refuses_is_closed_on_the_others(fleet: Fleet) -> None:
    first, second = fleet.workers
    second.script["/start_weight_update"] = [refused(409, "a weight update is already open")]
    status, body = await fleet.call("POST", "/start_weight_update", {})
    assert status == 502 and "closed it again" in body["message"], body
    assert first.paths() == ["/start_weight_update", "/finish_weight_update"] and not first.update_open
    assert first.bodies("/finish_weight_update") == [{"flush_cache": False}]  # commits nothing, keeps the version
    assert await fleet.disabled() == [False, False] and await fleet.journal() is None and not fleet.lock_held
    # Every worker refusing it: their own status, nothing changed.
    for s in fleet.workers:
        s.script["/start_weight_update"] = [refused(409, "a weight update is already open")]
    status, body = await fleet.call("POST", "/start_weight_update", {})
    assert status == 409 and body["error"]["message"].startswith("2 of 2 worker(s) could not start"), body
    assert await fleet.disabled() == [False, False] and not fleet.lock_held


async def test_an_update_nobody_finishes_expires_and_fails_closed(make_fleet: Callable[..., Awaitable[Fleet]]) -> None:
    fleet = await make_fleet([StandIn(), StandIn()], update_session_timeout_s=0.5)
    assert (await fleet.call("POST", "/start_weight_update", {}))[0] == 200
    await until(lambda: not fleet.lock_held, 10, "the expiry (about a second) to end the update")
    assert await fleet.disabled() == [True, True]
    pending = await fleet.journal()
    assert pending.state == "failed" and "expired" in pending.reason
    status, body = await fleet.call("POST", "/update_weights", CHUNK)
    assert status == 409 and "expired" in body["error"]["message"]


async def test_an_update_every_worker_ended_by_itself_is_ended_at_once(
    make_fleet: Callable[..., Awaitable[Fleet]],
) -> None:
    fleet = await make_fleet([StandIn(), StandIn()])
    assert (await fleet.call("POST", "/start_weight_update", {"timeout_s": 600}))[0] == 200
    for s in fleet.workers:
        s.update_open = False  # each worker's own window passed: its /health no longer shows the update
    await until(lambda: not fleet.lock_held, 10, "the router's next /health read (every second) to end it")
    assert await fleet.disabled() == [True, True]
    pending = await fleet.journal()
    assert pending.state == "failed" and "holds no open weight update" in pending.reason


# -- pause, resume, is_paused


async def test_pause_resume_and_is_paused(fleet: Fleet) -> None:
    first, second = fleet.workers
    status, body = await fleet.call("GET", "/is_paused")
    assert status == 200 and body["is_paused"] is False and len(body["results"]) == 2
    status, body = await fleet.call("POST", "/pause?mode=keep", None)
    assert status == 200 and body["status"] == "paused" and body["success"], body
    for s in fleet.workers:
        ((query, sent),) = [(q, b) for p, q, b in s.calls if p == "/pause"]
        assert query == "mode=keep" and sent == {"mode": "keep"}
    assert await fleet.disabled() == [False, False] and await fleet.journal() is None  # the fence was restored
    assert (await fleet.call("GET", "/is_paused"))[1]["is_paused"] is True
    second.paused = False
    status, body = await fleet.call("GET", "/is_paused")
    assert body["is_paused"] is False and [r["body"]["is_paused"] for r in body["results"]] == [True, False]
    status, body = await fleet.call("POST", "/resume", {})
    assert status == 200 and body["status"] == "resumed" and not first.paused
    # The query is typed as JSON would carry it (vLLM's deprecated spelling of ``wait``).
    status, body = await fleet.call("POST", "/pause?wait_for_inflight_requests=true&timeout_s=5", None)
    assert status == 200 and first.bodies("/pause")[-1] == {"wait_for_inflight_requests": True, "timeout_s": 5.0}
    sent = len(second.calls)
    assert (await fleet.call("POST", "/pause?mode=sideways", None))[0] == 400
    assert len(second.calls) == sent  # refused before any worker was contacted


async def test_the_routes_are_described(fleet: Fleet) -> None:
    async with fleet.client.get("/openapi.json") as resp:
        doc = await resp.json()
    paths = doc["paths"]
    for path in (
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/pause",
        "/resume",
        "/is_paused",
        "/get_world_size",
    ):
        assert path in paths, path
    answer = paths["/is_paused"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    assert "is_paused" in doc["components"]["schemas"][answer.rsplit("/", 1)[1]]["properties"]


# -- the trainer client's vLLM calls


async def test_the_router_client_drives_vllms_flow_with_typed_calls(fleet: Fleet) -> None:
    first, second = fleet.workers
    url = str(fleet.client.make_url("/"))
    async with AsyncRouterClient(url, admin_key=KEY, failover_budget_s=0) as client:
        paused = await client.pause("keep", timeout_s=5)
        assert isinstance(paused, PauseFleetAnswer) and paused.status == "paused", paused
        for s in fleet.workers:  # the arguments travel in the query, as vLLM reads them
            ((query, sent),) = [(q, b) for p, q, b in s.calls if p == "/pause"]
            assert query == "mode=keep&timeout_s=5.0" and sent == {"mode": "keep", "timeout_s": 5.0}
        is_paused = await client.is_paused()
        assert isinstance(is_paused, IsPausedFleetAnswer) and is_paused.is_paused

        init = await client.init_weight_transfer_engine(init_body(1 + 3)["init_info"])
        assert [(r.rank_offset, r.tp_size) for r in init.ranks] == [(1, 1), (2, 2)]
        start = await client.start_weight_update(timeout_s=60)
        assert isinstance(start, WeightTransferFleetAnswer) and start.update_open
        chunk = await client.update_weights(CHUNK["update_info"])
        assert chunk.update_open and [s.bodies("/update_weights") for s in fleet.workers] == [[CHUNK]] * 2
        finish = await client.finish_weight_update("v1")
        assert finish.weight_version == "v1" and not finish.update_open and finish.fenced == []
        assert first.bodies("/finish_weight_update") == [{"weight_version": "v1"}]  # the workers' own flush default
        assert (await client.resume()).status == "resumed" and not second.paused

        # Out of order: the router's 409, typed.
        with pytest.raises(RouterCallError) as refused:
            await client.update_weights(CHUNK["update_info"])
        assert refused.value.status == 409 and "/start_weight_update first" in refused.value.message
        # The digest travels as the router's header: stand-ins report none, so the finish is not published.
        await client.start_weight_update()
        with pytest.raises(RouterCallError) as unproven:
            await client.finish_weight_update("v2", expected_checksum="ab" * 32)
        assert unproven.value.status == 502 and isinstance(unproven.value.answer, WeightTransferFleetAnswer)
        assert all(s.version == "v2" for s in fleet.workers)  # committed by the engines, yet fenced
        assert await fleet.disabled() == [True, True] and (await fleet.journal()).state == "failed"


# -- end to end: a real router, two real workers, a trainer process


@pytest.fixture(scope="module")
def e2e(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, worker_fleet: Callable[..., WorkerFleet]
) -> Iterator[dict[str, Any]]:
    """Two workers serving ``llama`` behind a router, and the checksum of a worker loaded from ``llama_b``."""
    ((ref, ref_url),) = start_workers(checkpoints["llama_b"], 1, extra_args=WORKER_ARGS)
    try:
        status, body = http_json("POST", ref_url + "/weights_checker", {"action": "checksum"}, timeout=60)
        assert status == 200, body
        reference = body["per_gpu_checksum"]
    finally:
        ref.stop()
    fleet = worker_fleet(2, extra_args=[*WORKER_ARGS, "--admin-api-key", ADMIN_KEY], model=checkpoints["llama"])
    router, url = start_router(fleet.urls, admin_key=ADMIN_KEY, state_dir=tmp_path_factory.mktemp("vllm-router-state"))
    yield {"router": url, "workers": fleet.urls, "reference": reference, "procs": [router, *fleet.procs]}
    router.stop()


def run_vllm_trainer(router_url: str, model: Path, out_dir: Path, scenario: str, **extra: Any) -> dict[str, Any]:
    """The trainer process (bounded); its report, call by call."""
    out = out_dir / f"vllm-trainer-{scenario}.json"
    cfg = {"router": router_url, "model": str(model), "port": free_port(), "out": str(out), "scenario": scenario}
    # Forked from the suite's fork server (torch already imported), as the other trainers are.
    trainer = ManagedProcess(
        f"vllm-trainer-{scenario}", [sys.executable, "-m", "tests._vllm_trainer", json.dumps({**cfg, **extra})]
    )
    code = trainer.start().wait_exit(300)
    assert out.exists(), f"the trainer wrote no report (exit {code}):\n{trainer.log_text(3000)}"
    report: dict[str, Any] = json.loads(out.read_text())
    report["returncode"], report["stderr"] = code, trainer.log_text(3000)
    return report


def router_call(url: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    return http_json(method, url + path, body, headers=auth(), timeout=120)


def answers(report: dict[str, Any]) -> dict[str, list[tuple[int, Any]]]:
    out: dict[str, list[tuple[int, Any]]] = {}
    for c in report["calls"]:
        out.setdefault(c["path"], []).append((c["status"], c["body"]))
    return out


def test_a_vllm_trainer_syncs_the_fleet_through_the_router(
    e2e: dict[str, Any], checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    url = e2e["router"]
    # Out of order: refused by the router, nothing reaches a worker.
    status, body = router_call(url, "POST", "/update_weights", CHUNK)
    assert status == 409 and "/start_weight_update first" in body["error"]["message"], body
    assert all(not w["disabled"] for w in workers(url, ADMIN_KEY))

    report = run_vllm_trainer(url, checkpoints["llama_b"], tmp_path, "sync", version="v-b")
    assert report["returncode"] == 0 and "send_error" not in report, report
    calls = answers(report)
    assert calls["/init_weight_transfer_engine"][0][0] == 200, calls
    assert calls["/pause?mode=abort"][0][1]["status"] == "paused"
    assert calls["/is_paused"][0][1]["is_paused"] is True
    assert calls["/start_weight_update"][0][0] == 200
    assert [s for s, _ in calls["/update_weights"]] == [200, 200], calls["/update_weights"]
    status, finish = calls["/finish_weight_update"][0]
    assert status == 200 and finish["weight_version"] == "v-b" and finish["fenced"] == [], finish
    assert all(r["body"]["weight_version"] == "v-b" for r in finish["results"])

    # Both workers hold exactly the new checkpoint, under its version.
    status, body = router_call(url, "POST", "/weights_checker", {"action": "checksum"})
    assert status == 200 and body["identical"], body
    assert len(body["rank_checksums"]) == 2, body
    assert all(sums == [e2e["reference"]] for sums in body["rank_checksums"].values()), body
    status, body = router_call(url, "GET", "/get_weight_version")
    assert status == 200 and body["weight_version"] == "v-b", body
    (group,) = router_call(url, "GET", "/get_world_size")[1]["groups"]
    assert group["group_name"] == "weight_transfer" and group["world_size"] == 3 and group["matches_fleet"]

    status, body = router_call(url, "POST", "/resume", {})
    assert status == 200 and body["status"] == "resumed", body
    assert router_call(url, "GET", "/is_paused")[1]["is_paused"] is False
    status, out, served_by = generate_via(url, "hello", 4)
    assert status == 200 and len(out["output_ids"]) == 4 and served_by, out
    fleet = workers(url, ADMIN_KEY)
    assert all(not w["disabled"] and w["pending"] is None for w in fleet), fleet


def fleet_version(url: str) -> str | None:
    """The version the router published (a failed update's label never reaches it)."""
    status, body = router_call(url, "GET", "/fleet/versions")
    assert status == 200, body
    return body["weight_version"]


def test_a_router_client_trainer_syncs_with_its_digest_and_a_wrong_digest_is_not_published(
    e2e: dict[str, Any], checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    url = e2e["router"]
    ours, other = (sorted(read_checkpoint(checkpoints[n], torch.float32)) for n in ("llama", "llama_b"))
    digest, other_digest = expected_checksum(ours, "omni"), expected_checksum(other, "omni")
    report = run_vllm_trainer(
        url,
        checkpoints["llama"],
        tmp_path,
        "client_sync",
        version="v-client",
        wrong_version="v-wrong",
        other_model=str(checkpoints["llama_b"]),
    )
    assert report["returncode"] == 0 and "send_error" not in report, report
    calls = answers(report)
    assert calls["/init_weight_transfer_engine"][0][0] == 200, calls
    assert [(s, b["status"]) for s, b in calls["/pause"]] == [(200, "paused")] * 2
    assert all(b["is_paused"] for _, b in calls["/is_paused"])
    assert [s for s, _ in calls["/update_weights"]] == [200] * 4, calls["/update_weights"]

    # The sync whose finish names the digest of the tensors sent: published, every worker proven.
    (status, finish), (refused_status, refused) = calls["/finish_weight_update"]
    assert status == 200 and finish["weight_version"] == "v-client" and finish["fenced"] == [], finish
    assert set(finish["digests"].values()) == {digest}, finish
    assert calls["/get_weight_version"] == [(200, {"weight_version": "v-client", "worker_count": 2})]

    # The sync whose finish names other tensors' digest: a 502 with the typed answer, the label unpublished.
    assert refused_status == 502 and refused["answer_type"] == "WeightTransferFleetAnswer", refused
    assert set(refused["answer"]["digests"].values()) == {other_digest}, refused
    assert all(f"not the expected {digest}" in r["error"] for r in refused["answer"]["results"]), refused
    assert fleet_version(url) == "v-client"
    fleet = workers(url, ADMIN_KEY)
    assert all(w["disabled"] for w in fleet), fleet
    status, journal = router_call(url, "GET", "/weight_update_journal")
    assert journal["pending"]["state"] == "failed", journal

    # An operator vouches for the workers (they serve llama_b whole); the fleet serves again.
    assert router_call(url, "POST", "/weight_update_journal/resolve", {"acknowledge": True})[0] == 200
    for w in fleet:
        assert router_call(url, "PUT", f"/workers/{escaped(w['id'])}", {"disabled": False})[0] == 200
    assert router_call(url, "POST", "/resume", {})[0] == 200
    assert all(not w["disabled"] for w in workers(url, ADMIN_KEY))


def test_a_buffer_size_mismatch_fails_the_update_and_keeps_the_workers_fenced(
    e2e: dict[str, Any], checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    url = e2e["router"]
    report = run_vllm_trainer(url, checkpoints["llama"], tmp_path, "mismatch")
    calls = answers(report)
    assert calls["/start_weight_update"][0][0] == 200, calls
    ((status, body),) = calls["/update_weights"]
    assert 400 <= status < 500 and "receive failed" in body["error"]["message"], body
    assert not body["update_open"] and sorted(body["fenced"]) == sorted(w["id"] for w in workers(url, ADMIN_KEY))
    assert report["send_error"]  # the trainer sent buffers nobody took: its broadcast failed, bounded
    status, body = calls["/finish_weight_update"][0]
    assert status == 409 and "router ended" in body["error"]["message"], body
    # Every worker stays fenced and reported until an operator resolves it; the lock is free.
    assert all(w["disabled"] for w in workers(url, ADMIN_KEY))
    status, journal = router_call(url, "GET", "/weight_update_journal")
    assert journal["pending"]["state"] == "failed" and "/update_weights failed" in journal["pending"]["reason"]
    assert router_call(url, "POST", "/weight_update_journal/resolve", {"acknowledge": True})[0] == 200
    assert all(p.alive for p in e2e["procs"])
