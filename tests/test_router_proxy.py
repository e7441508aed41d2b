"""The /generate proxy in-process, against two scripted loopback workers (pytest-aiohttp).

Every test runs twice: behind aiohttp's server (the single process, the control process) and behind a
data plane's lean server (:mod:`router.gateway.frontend`).

What the real-worker tests cannot provoke on demand: a worker that answers 503, one whose process
changed since its last probe (``X-Omni-Instance``), a stream that breaks halfway, and the exact
bytes each worker received. End-to-end behaviour with real workers is in test_router_routing.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from router.contract.generate import INSTANCE_HEADER
from router.contract.web.auth import TokenCheck, token_check
from router.gateway import keys
from router.gateway.app import create_app, routes
from router.gateway.config import RouterConfig
from router.gateway.frontend.site import FRONTEND, Frontend, LeanSite
from router.gateway.serving import app_runner
from router.gateway.shutdown import DRAIN, RequestDrain
from tests._polling import until
from tests.procs import free_port

REPLY = b'{"text": " ok", "output_ids": [1], "meta_info": {"id": "x", "weight_version": "default"}}'


class StandIn:
    """A scripted worker: healthy, records every /generate body and every abort."""

    def __init__(self, name: str):
        self.name = name
        self.instance = f"{name}-boot"
        self.bodies: list[bytes] = []
        self.aborts: list[Any] = []
        self.mode = "ok"  # ok | unavailable | restarted | restarted_meanwhile | stream | broken_stream | ...
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()
        self.answers_probes = asyncio.Event()
        self.answers_probes.set()
        """Cleared: ``/health`` waits (a stopped process, as far as a probe can tell)."""
        """``restarted_meanwhile``: a request has arrived, and may be answered (by the new process)."""
        self.aborted = asyncio.Event()
        self.raw_answers = 0
        self.hangups = 0
        """Raw answers (``not_http``, ``trailing``) after which the router closed the connection."""

    def app(self) -> web.Application:
        async def health(_: web.Request) -> web.Response:
            await self.answers_probes.wait()
            body = {
                "status": "ok",
                "weight_version": "default",
                "weight_state": "serving",
                "instance_id": self.instance,
            }
            return web.json_response(body)

        async def model_info(_: web.Request) -> web.Response:
            body = {"model_path": "standin", "weight_version": "default", "tp_size": 1, "instance_id": self.instance}
            return web.json_response(body)

        async def abort(request: web.Request) -> web.Response:
            self.aborts.append((await request.json())["rid"])
            self.aborted.set()
            return web.json_response({"success": True})

        async def generate(request: web.Request) -> web.StreamResponse:
            self.bodies.append(await request.read())
            headers = {INSTANCE_HEADER: self.instance}
            if self.mode == "unavailable":
                return web.json_response({"error": {"message": f"{self.name} is busy"}}, status=503, headers=headers)
            if self.mode in ("not_http", "trailing"):  # raw bytes on the wire, then the connection closes
                raw = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % len(REPLY)
                raw += b"%s: %s\r\n\r\n%s" % (INSTANCE_HEADER.encode(), self.instance.encode(), REPLY)
                transport = request.transport
                assert transport is not None
                transport.write(raw.replace(b"HTTP/1.1", b"HTPT/1.1") if self.mode == "not_http" else raw + b"junk")
                self.raw_answers += 1
                # The router reads the answer, then gives up on the connection (it is not HTTP, or bytes
                # trail it): wait for that hang-up (aiohttp then cancels this handler) rather than close
                # first and race the router's read.
                try:
                    await until(lambda: request.transport is None, 5, "the router to close the connection")
                finally:
                    self.hangups += request.transport is None
                    transport.close()
                raise ConnectionResetError("answered on the raw transport")
            if self.mode == "restarted":
                headers[INSTANCE_HEADER] = f"{self.name}-new"
            if self.mode == "restarted_meanwhile":
                self.arrived.set()
                await asyncio.wait_for(self.release.wait(), 10)
                headers[INSTANCE_HEADER] = f"{self.name}-new"
            if self.mode in ("stream", "broken_stream", "slow_stream"):
                resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
                await resp.prepare(request)
                for i in range(3):
                    await resp.write(f'data: {{"text": "{self.name}-{i}"}}\n\n'.encode())
                if self.mode == "broken_stream":
                    assert request.transport is not None
                    request.transport.close()
                    return resp
                if self.mode == "slow_stream":
                    await asyncio.sleep(30)  # the behaviour under test: a stream that stalls (its caller leaves)
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            return web.Response(body=REPLY, content_type="application/json", headers=headers)

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/model_info", model_info)
        app.router.add_post("/abort_request", abort)
        app.router.add_post("/generate", generate)
        app.router.add_post("/inference/v1/generate", generate)
        return app


async def serve_standins(standins: list[StandIn]) -> list[TestServer]:
    """Each stand-in on a loopback port of its own."""
    servers = [TestServer(s.app(), host="127.0.0.1") for s in standins]
    for server in servers:
        await server.start_server()
    return servers


class LeanClient:
    """What these tests use of aiohttp's ``TestClient``, against the app served by a lean site."""

    def __init__(self, app: web.Application, runner: web.AppRunner, base: str):
        self.app = app
        self._runner = runner
        self.base = base
        self._session = aiohttp.ClientSession()

    def post(self, path: str, **kwargs: Any) -> Any:
        return self._session.post(self.base + path, **kwargs)

    def get(self, path: str, **kwargs: Any) -> Any:
        return self._session.get(self.base + path, **kwargs)

    async def close(self) -> None:
        await self._session.close()
        await self._runner.cleanup()


async def serve_lean(app: web.Application, check: TokenCheck | None = None) -> LeanClient:
    """``app`` behind a lean site, its generation routes served as a data plane's are."""
    if check is None:
        check = token_check(admin_key=None, api_key=None, open_paths=(), generation_paths=())
    app[DRAIN] = RequestDrain(1.0)
    app[FRONTEND] = Frontend.of(routes(), check)
    runner = app_runner(app, 1.0)
    await runner.setup()
    port = free_port()
    await LeanSite(runner, "127.0.0.1", port).start()
    return LeanClient(app, runner, f"http://127.0.0.1:{port}")


@pytest.fixture(params=["aiohttp", "lean"])
async def fleet(request: Any, aiohttp_client: Any, tmp_path: Path) -> AsyncIterator[tuple[TestClient, list[StandIn]]]:
    standins = [StandIn("a"), StandIn("b")]
    servers = await serve_standins(standins)
    urls = [f"http://127.0.0.1:{server.port}" for server in servers]
    config = RouterConfig(
        worker_urls=urls,
        state_dir=tmp_path / "state",
        policy="round_robin",
        health_check_interval_s=3600.0,  # one probe round at start-up
        retry_initial_backoff_s=0.01,
        retry_max_backoff_s=0.02,
    )
    app = create_app(config)
    client = await aiohttp_client(app) if request.param == "aiohttp" else await serve_lean(app)
    registry = client.app[keys.REGISTRY]
    await until(lambda: len(registry.routable()) == 2, 4, "the first probes to find both workers")
    yield client, standins
    await client.close()
    for server in servers:
        await server.close()


async def generate(client: TestClient, body: bytes) -> tuple[int, bytes, str | None]:
    async with client.post("/generate", data=body, headers={"Content-Type": "application/json"}) as resp:
        return resp.status, await resp.read(), resp.headers.get("X-Omni-Worker")


async def test_bodies_pass_through_and_a_rid_is_assigned_only_when_missing(fleet) -> None:
    client, (a, b) = fleet
    mine = b'{"text": "hi",  "rid": "trainer-1"}'
    for body in (mine, b'{"text": "hi"}', b'{"text": ["x", "y"]}'):
        status, answer, worker = await generate(client, body)
        assert status == 200 and answer == REPLY and worker is not None
    seen = sorted(a.bodies + b.bodies, key=len)
    assert mine in seen  # byte for byte
    single = json.loads(next(x for x in seen if b'"hi"' in x and x != mine))
    assert single["text"] == "hi" and single["rid"].startswith("omni-")
    batch = json.loads(next(x for x in seen if b'"x"' in x))
    assert batch["rid"] == [f"{batch['rid'][0][:-2]}-0", f"{batch['rid'][0][:-2]}-1"]


async def test_a_worker_answering_503_is_retried_on_the_other_and_both_503_is_passed_on(fleet) -> None:
    client, (a, b) = fleet
    a.mode = "unavailable"
    for _ in range(4):  # round robin: half of these try a first
        status, answer, _ = await generate(client, b'{"text": "hi"}')
        assert status == 200 and answer == REPLY
    assert a.bodies and len(b.bodies) == 4
    b.mode = "unavailable"
    status, answer, worker = await generate(client, b'{"text": "hi"}')
    assert status == 503 and b"is busy" in answer and worker is not None
    metrics = (await (await client.get("/metrics")).read()).decode()
    assert 'omni_router_generate_retries_total{reason="status_503"}' in metrics


async def test_an_answer_that_is_not_http_is_retried_and_trailing_bytes_do_not_spoil_an_answer(fleet) -> None:
    client, (a, b) = fleet
    a.mode = "not_http"
    for _ in range(4):  # round robin: half of these try a first, fail before any byte went out, and go to b
        status, answer, _ = await generate(client, b'{"text": "hi"}')
        assert status == 200 and answer == REPLY
    assert a.bodies and len(b.bodies) == 4
    metrics = (await (await client.get("/metrics")).read()).decode()
    assert "omni_router_upstream_errors_total" in metrics
    a.mode, b.mode = "trailing", "trailing"
    for _ in range(4):  # each answer is whole; its connection is not reused
        status, answer, _ = await generate(client, b'{"text": "hi"}')
        assert status == 200 and answer == REPLY
    # The router closes every connection that carried a raw answer (once it has relayed the answer).
    assert b.raw_answers > 0
    await until(lambda: (a.hangups, b.hangups) == (a.raw_answers, b.raw_answers), 5, "every raw answer's hang-up")


async def test_an_answer_from_a_restarted_worker_is_dropped_and_served_elsewhere(fleet) -> None:
    client, (a, _) = fleet
    registry = client.app[keys.REGISTRY]
    wa, wb = list(registry)
    a.mode = "restarted"
    while not a.bodies:
        status, answer, worker = await generate(client, b'{"text": "hi"}')
        assert status == 200 and answer == REPLY and worker == wb.id
    # a answered, and its answer never reached the caller: it came from another process than the probe saw.
    assert len(a.bodies) == 1 and wa.instance_id == "a-new"
    # Before any weight update every worker's boot weights are the fleet's: a serves again, as its new self.
    served = {(await generate(client, b'{"text": "hi"}'))[2] for _ in range(2)}
    assert served == {wa.id, wb.id}


async def test_an_answer_from_a_process_the_router_learnt_of_while_the_request_ran_is_dropped(fleet) -> None:
    """The request went to the process the router picked; by the time the answer comes, a probe (or a data
    plane's snapshot) has told the router of the restarted process that sends it. The answer is checked against
    the process picked, not the one known now: it is dropped and the request served elsewhere."""
    client, (a, _) = fleet
    registry = client.app[keys.REGISTRY]
    wa, wb = list(registry)
    a.mode = "restarted_meanwhile"
    while True:
        sent = asyncio.create_task(generate(client, b'{"text": "hi"}'))
        arrived = asyncio.create_task(a.arrived.wait())
        await asyncio.wait({sent, arrived}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        if a.arrived.is_set():
            break
        arrived.cancel()
        status, answer, worker = await sent  # round robin sent this one to b
        assert status == 200 and worker == wb.id
    wa.instance_id = "a-new"  # what the next probe of a reads: the process that will answer
    a.release.set()
    status, answer, worker = await asyncio.wait_for(sent, 10)
    assert status == 200 and answer == REPLY and worker == wb.id
    assert len(a.bodies) == 1


async def test_a_stream_is_relayed_and_a_broken_one_ends_with_an_error_event(fleet) -> None:
    client, (a, b) = fleet
    a.mode = b.mode = "stream"
    status, answer, _ = await generate(client, b'{"text": "hi", "stream": true}')
    assert status == 200 and answer.endswith(b"data: [DONE]\n\n") and answer.count(b"data: ") == 4
    a.mode = b.mode = "broken_stream"
    status, answer, _ = await generate(client, b'{"text": "hi", "stream": true}')
    assert status == 200 and answer.count(b'-0"}') == 1  # what was relayed stays relayed, nothing retried
    assert b"stream broke" in answer.rsplit(b"data: ", 1)[1]


async def test_a_caller_that_leaves_a_stream_is_aborted_on_its_worker(fleet) -> None:
    client, (a, b) = fleet
    a.mode = b.mode = "slow_stream"
    async with client.post("/generate", data=b'{"text": "hi", "stream": true}') as resp:
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")
    # Leaving the block closed the connection mid-stream: the router aborts the request on its worker.
    done, _ = await asyncio.wait(
        [asyncio.ensure_future(a.aborted.wait()), asyncio.ensure_future(b.aborted.wait())],
        timeout=10,
        return_when=asyncio.FIRST_COMPLETED,
    )
    assert done
    aborted = a.aborts + b.aborts
    sent = json.loads((a.bodies + b.bodies)[0])
    assert aborted == [sent["rid"]]


async def test_a_worker_that_does_not_answer_its_probe_does_not_delay_noticing_a_dead_one(
    aiohttp_client: Any, tmp_path: Path
) -> None:
    """One worker stops answering (a stopped process: its probe waits for its whole timeout), another dies:
    the dead one is dead within a few intervals, not after the stopped one's timeouts, one per round."""
    dying, stopped = StandIn("dying"), StandIn("stopped")
    stopped.answers_probes.clear()
    servers = await serve_standins([dying, stopped])
    config = RouterConfig(
        worker_urls=[f"http://127.0.0.1:{server.port}" for server in servers],
        state_dir=tmp_path / "state",
        health_check_interval_s=0.1,
        health_check_timeout_s=30.0,
    )
    client = await aiohttp_client(create_app(config))
    try:
        registry = client.app[keys.REGISTRY]
        dead = registry.find(config.worker_urls[0])
        assert dead is not None
        await until(lambda: dead.health == "healthy", 5, "the dying worker's first probe")
        await servers[0].close()
        # Six failed probes, 0.1 s apart, while the other worker's probe waits for its 30 s timeout.
        await until(lambda: dead.health == "dead", 10, "the closed worker to be found dead")
    finally:
        stopped.answers_probes.set()
        await client.close()
        await servers[1].close()


async def test_vllms_token_route_goes_only_to_workers_holding_the_adapter_its_model_names(fleet) -> None:
    """``/inference/v1/generate`` chooses a LoRA adapter by ``model``, as the OpenAI routes do: the router sends
    it only to a worker that holds that adapter at the fleet's version; other names go anywhere."""
    client, (a, b) = fleet
    registry = client.app[keys.REGISTRY]
    wa, _ = list(registry)
    registry.adapters.record_load("small", "/adapters/small", [wa])
    for _ in range(4):
        async with client.post("/inference/v1/generate", json={"model": "small", "token_ids": [1]}) as resp:
            assert resp.status == 200 and resp.headers["X-Omni-Worker"] == wa.id
    assert len(a.bodies) == 4 and not b.bodies
    for _ in range(4):  # the base model (any other name) goes to either worker
        async with client.post("/inference/v1/generate", json={"model": "base", "token_ids": [1]}) as resp:
            assert resp.status == 200
    assert b.bodies
