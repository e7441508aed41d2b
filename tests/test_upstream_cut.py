"""Both upstream transports end a worker's requests in flight on ``cut`` (in-process, loopback).

The worker here is an aiohttp app that never finishes answering: one route never sends its
head, one sends a head and a first event and then nothing. The router cuts a worker when its
health checks find it dead (``test_router_hung_worker.py`` runs that end to end).
"""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from router.gateway.upstream.lean_http import HttpUpstream
from router.gateway.upstream.transport import Transport, UpstreamError
from router.gateway.upstream.via_aiohttp import AiohttpUpstream

ARRIVED = web.AppKey("arrived", asyncio.Event)

#: The request's own deadline: far beyond the test's waits, so only a cut can end them.
REQUEST_TIMEOUT_S = 120.0


async def _silent(request: web.Request) -> web.Response:
    request.app[ARRIVED].set()
    await asyncio.Event().wait()  # never answers; the server cancels it when the test ends
    raise AssertionError("unreachable")


async def _stalled_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b"data: first\n\n")
    await asyncio.Event().wait()
    return resp


@pytest.fixture
async def worker(aiohttp_server) -> tuple[str, asyncio.Event]:
    app = web.Application()
    app[ARRIVED] = asyncio.Event()
    app.router.add_post("/silent", _silent)
    app.router.add_post("/stalled", _stalled_stream)
    server = await aiohttp_server(app, host="127.0.0.1")
    return f"http://127.0.0.1:{server.port}", app[ARRIVED]


def transports() -> list[Transport]:
    return [HttpUpstream(limit=8, connect_timeout_s=5), AiohttpUpstream(limit=8, connect_timeout_s=5)]


@pytest.mark.parametrize("kind", [0, 1], ids=["lean", "aiohttp"])
async def test_a_request_waiting_for_its_head_is_cut(worker, kind):
    worker_url, arrived = worker
    transport = transports()[kind]
    try:
        waiting = asyncio.ensure_future(
            transport.request("POST", worker_url, "/silent", b"{}", {}, timeout_s=REQUEST_TIMEOUT_S)
        )
        async with asyncio.timeout(10):
            await arrived.wait()
        assert not waiting.done()
        transport.cut(worker_url, "worker w-x stopped answering health checks")
        async with asyncio.timeout(10):
            with pytest.raises(UpstreamError, match="stopped answering"):
                await waiting
    finally:
        await _close(transport)


@pytest.mark.parametrize("kind", [0, 1], ids=["lean", "aiohttp"])
async def test_a_stream_being_read_is_cut(worker, kind):
    worker_url, _ = worker
    transport = transports()[kind]
    try:
        resp = await transport.request("POST", worker_url, "/stalled", b"{}", {}, timeout_s=REQUEST_TIMEOUT_S)
        first = asyncio.Event()

        async def read() -> None:
            async for _chunk in resp.chunks():
                first.set()

        reader = asyncio.ensure_future(read())
        async with asyncio.timeout(10):
            await first.wait()
        assert transport.cut(worker_url, "worker w-x stopped answering health checks") == 1
        async with asyncio.timeout(10):
            with pytest.raises(UpstreamError, match="stopped answering"):
                await reader
        resp.release()
        # Nothing is left to cut, and the next request to that worker is not affected by the old cut.
        assert transport.cut(worker_url, "again") == 0
    finally:
        await _close(transport)


async def _close(transport: Transport) -> None:
    if isinstance(transport, HttpUpstream):
        transport.close()
    elif isinstance(transport, AiohttpUpstream):
        await transport.close()


@pytest.mark.parametrize("kind", [0, 1], ids=["lean", "aiohttp"])
async def test_cutting_the_unanswered_leaves_a_begun_answer_running(worker, kind):
    """A worker found paused: the request still waiting for its head goes elsewhere, the begun stream runs on."""
    worker_url, arrived = worker
    transport = transports()[kind]
    try:
        stream = await transport.request("POST", worker_url, "/stalled", b"{}", {}, timeout_s=REQUEST_TIMEOUT_S)
        waiting = asyncio.ensure_future(
            transport.request("POST", worker_url, "/silent", b"{}", {}, timeout_s=REQUEST_TIMEOUT_S)
        )
        async with asyncio.timeout(10):
            await arrived.wait()
        transport.cut(worker_url, "worker w-x is paused", unanswered_only=True)
        async with asyncio.timeout(10):
            with pytest.raises(UpstreamError, match="is paused"):
                await waiting
        chunks = stream.chunks()
        async with asyncio.timeout(10):
            assert await anext(chunks) == b"data: first\n\n"  # not cut: its answer had begun
        transport.cut(worker_url, "the test is over")
        stream.release()
    finally:
        await _close(transport)
