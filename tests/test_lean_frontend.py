"""A data plane's lean server on the wire: one connection, raw bytes, scripted loopback workers (in-process).

What its callers may send that aiohttp's server took care of: another route after generation on one
connection (handed to aiohttp), pipelined requests, a body or headers too large, bytes that are not HTTP,
``Expect: 100-continue``, HTTP/1.0, the API key. The proxy behind it is the one of
tests/test_router_proxy.py, which runs every proxy test behind both servers.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import pytest

from router.contract.web.auth import token_check
from router.contract.web.parsing import MAX_BODY_BYTES
from router.gateway import keys
from router.gateway.app import create_app
from router.gateway.config import RouterConfig
from router.gateway.frontend.connection import MAX_HEAD_BYTES
from tests._polling import until
from tests.test_router_proxy import REPLY, LeanClient, StandIn, serve_lean, serve_standins

API_KEY = "generation-key"
BODY = b'{"text": "hi"}'


def generate_request(body: bytes = BODY, *, key: str | None = API_KEY, extra: str = "") -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = f"POST /generate HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n{auth}{extra}"
    return head.encode() + b"Content-Length: %d\r\n\r\n" % len(body) + body


HEALTH = b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n"


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One answer: status, headers (names in lower case), body (by Content-Length or chunked)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    body = b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        chunk = await reader.readexactly(size + 2)
        if size == 0:
            return status, headers, body
        body += chunk[:-2]


@pytest.fixture
async def lean(tmp_path: Path) -> AsyncIterator[tuple[LeanClient, str, int]]:
    standins = [StandIn("a"), StandIn("b")]
    servers = await serve_standins(standins)
    config = RouterConfig(
        worker_urls=[f"http://127.0.0.1:{server.port}" for server in servers],
        state_dir=tmp_path / "state",
        health_check_interval_s=3600.0,
        api_key=API_KEY,
    )
    check = token_check(admin_key=None, api_key=API_KEY, open_paths=("/health",), generation_paths=("/generate",))
    client = await serve_lean(create_app(config), check)
    registry = client.app[keys.REGISTRY]
    await until(lambda: len(registry.routable()) == 2, 4, "the first probes to find both workers")
    host, port = client.base.removeprefix("http://").split(":")
    yield client, host, int(port)
    await client.close()
    for server in servers:
        await server.close()


async def connect(lean: tuple[Any, str, int]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    _, host, port = lean
    return await asyncio.open_connection(host, port)


async def test_generation_is_served_lean_and_another_route_moves_the_connection_to_aiohttp(lean) -> None:
    reader, writer = await connect(lean)
    for _ in range(2):  # kept alive across answers
        writer.write(generate_request())
        status, headers, body = await read_answer(reader)
        assert status == 200 and body == REPLY and "server" not in headers  # aiohttp names itself; lean does not
        assert parsedate_to_datetime(headers["date"]).tzinfo is not None  # HTTP's Date, in GMT
        assert headers["x-omni-worker"] and headers["content-type"].startswith("application/json")
    writer.write(HEALTH)
    status, headers, body = await read_answer(reader)
    assert status == 200 and "aiohttp" in headers["server"]
    writer.write(generate_request())  # aiohttp serves this connection from now on, generation included
    status, headers, body = await read_answer(reader)
    assert status == 200 and body == REPLY and "aiohttp" in headers["server"]
    writer.close()
    # A connection whose first request is another route is aiohttp's from the start.
    reader, writer = await connect(lean)
    writer.write(HEALTH + generate_request())
    assert (await read_answer(reader))[0] == 200
    status, headers, body = await read_answer(reader)
    assert status == 200 and body == REPLY and "aiohttp" in headers["server"]
    writer.close()


async def test_pipelined_requests_are_answered_in_order_and_another_route_behind_them_is_refused(lean) -> None:
    reader, writer = await connect(lean)
    writer.write(generate_request() + generate_request(b'{"text": "second", "rid": "r2"}'))
    first, second = await read_answer(reader), await read_answer(reader)
    assert first[0] == second[0] == 200 and "server" not in first[1]
    writer.write(generate_request() + HEALTH)
    assert (await read_answer(reader))[0] == 200
    status, _, body = await read_answer(reader)
    assert status == 400 and "pipelined" in json.loads(body)["error"]["message"]
    assert await asyncio.wait_for(reader.read(), 10) == b""  # and the connection is closed
    writer.close()


async def test_bad_bytes_a_large_body_and_a_missing_key_are_refused_with_an_error_body_and_a_close(lean) -> None:
    cases = [
        (b"NOT HTTP AT ALL\r\n\r\n", 400, "could not be parsed"),
        (generate_request(extra=f"Content-Length: {MAX_BODY_BYTES + 1}\r\n")[: -len(BODY)], 400, None),
        (
            b"POST /generate HTTP/1.1\r\nHost: r\r\nAuthorization: Bearer %b\r\nContent-Length: %d\r\n\r\n"
            % (API_KEY.encode(), MAX_BODY_BYTES + 1),
            413,
            "over the router's bound",
        ),
        (
            b"POST /generate HTTP/1.1\r\nX-Padding: " + b"a" * (MAX_HEAD_BYTES + 1) + b"\r\n\r\n",
            431,
            "headers are over",
        ),
    ]
    for raw, want, words in cases:
        reader, writer = await connect(lean)
        writer.write(raw)
        status, _, body = await read_answer(reader)
        assert status == want, (raw[:60], status, body)
        if words is not None:
            assert words in json.loads(body)["error"]["message"]
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
    reader, writer = await connect(lean)
    writer.write(generate_request())
    assert (await read_answer(reader))[0] == 200
    for key in (None, "wrong"):
        writer.write(generate_request(key=key))
        status, headers, body = await read_answer(reader)
        assert status == 401 and headers["www-authenticate"] == "Bearer" and json.loads(body)["error"]["message"]
        assert headers["connection"] == "close"  # refused at its head: its body is never read
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
        reader, writer = await connect(lean)
    writer.close()


async def test_expect_continue_and_http_1_0_are_answered_as_their_callers_expect(lean) -> None:
    reader, writer = await connect(lean)
    writer.write(generate_request(extra="Expect: 100-continue\r\n")[: -len(BODY)])
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(BODY)
    assert (await read_answer(reader))[0] == 200
    writer.close()
    reader, writer = await connect(lean)
    writer.write(generate_request().replace(b"HTTP/1.1", b"HTTP/1.0", 1))
    status, headers, body = await read_answer(reader)
    assert status == 200 and body == REPLY and headers["connection"] == "close"
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()
