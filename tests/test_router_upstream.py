"""The router's lean HTTP/1.1 client (the proxy's and the admin fan-out's) against scripted loopback
servers: every framing, keep-alive reuse and when a connection must not be reused, errors, the
deadline, cancellation, the in-flight limit, flow control, and the fan-out's whole exchanges (any
method, no body, the size cap, the idle bound per worker)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from router.gateway import upstream_http as upstream
from router.gateway.upstream_http import HttpUpstream, UpstreamError

Reply = Callable[[asyncio.StreamWriter, bytes], Awaitable[None]]


class Server:
    """Reads each request (head + Content-Length body) and answers with a scripted reply."""

    def __init__(self, reply: Reply):
        self.reply = reply
        self.connections = 0
        self.requests: list[bytes] = []
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.decode("latin-1").split("\r\n"):
                    name, _, value = line.partition(":")
                    if name.lower() == "content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                await self.reply(writer, body)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serving(reply: Reply) -> AsyncIterator[Server]:
    server = Server(reply)
    srv = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    server.url = f"http://127.0.0.1:{port}"
    try:
        yield server
    finally:
        srv.close()


def fixed(raw: bytes, *, close: bool = False) -> Reply:
    async def reply(writer: asyncio.StreamWriter, _: bytes) -> None:
        writer.write(raw)
        await writer.drain()
        if close:
            writer.close()

    return reply


OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'


async def post(client: HttpUpstream, url: str, body: bytes = b'{"text": "hi"}', timeout_s: float = 10.0) -> bytes:
    resp = await client.post(url, "/generate", body, {"Content-Type": "application/json"}, timeout_s=timeout_s)
    try:
        assert resp.status == 200
        return await resp.read()
    finally:
        resp.release()


async def test_content_length_answer_and_keep_alive_reuse():
    async with serving(fixed(OK)) as server:
        client = HttpUpstream(limit=8, connect_timeout_s=5)
        for _ in range(3):
            assert await post(client, server.url) == b'{"ok":true}'
        assert server.connections == 1
        request = server.requests[0]
        assert request.startswith(b"POST /generate HTTP/1.1\r\n")
        assert b"Content-Length: 14\r\n" in request and request.endswith(b'\r\n\r\n{"text": "hi"}')
        client.close()


async def test_chunked_answer_in_small_pieces_and_its_chunks():
    events = [b'data: {"text": "a"}\n\n', b'data: {"text": "ab"}\n\n', b"data: [DONE]\n\n"]

    async def reply(writer: asyncio.StreamWriter, _: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        wire = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\nX-Trailer: t\r\n\r\n"
        for i in range(len(wire)):  # one byte at a time: every parser state is split somewhere
            writer.write(wire[i : i + 1])
            await writer.drain()

    async with serving(reply) as server:
        client = HttpUpstream(limit=8, connect_timeout_s=5)
        resp = await client.post(server.url, "/generate", b"{}", {}, timeout_s=10)
        assert resp.header("content-type") == "text/event-stream"
        got = b"".join([chunk async for chunk in resp.chunks()])
        resp.release()
        assert got == b"".join(events)
        assert await post(client, server.url) == b"".join(events)  # the same connection, read whole
        assert server.connections == 1
        client.close()


async def test_answers_that_end_the_connection_are_not_reused():
    until_close = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + b"x" * 5000
    async with serving(fixed(until_close, close=True)) as server:
        client = HttpUpstream(limit=8, connect_timeout_s=5)
        assert await post(client, server.url) == b"x" * 5000
        assert await post(client, server.url) == b"x" * 5000
        assert server.connections == 2
        client.close()
    closing = OK.replace(b"Content-Length", b"Connection: close\r\nContent-Length")
    async with serving(fixed(closing)) as server:
        client = HttpUpstream(limit=8, connect_timeout_s=5)
        await post(client, server.url)
        await post(client, server.url)
        assert server.connections == 2
        client.close()
    # Bytes after a complete answer (junk, or a second answer nobody asked for, even cut short):
    # that connection's framing cannot be trusted any more.
    for extra in (b"junk", OK, OK[:20]):
        async with serving(fixed(OK + extra)) as server:
            client = HttpUpstream(limit=8, connect_timeout_s=5)
            assert await post(client, server.url) == b'{"ok":true}'
            assert await post(client, server.url) == b'{"ok":true}'
            assert server.connections == 2
            client.close()
    async with serving(fixed(OK + b"\r\n")) as server:  # an empty line between messages is no message
        client = HttpUpstream(limit=8, connect_timeout_s=5)
        await post(client, server.url)
        await post(client, server.url)
        assert server.connections == 1
        client.close()
    # HTTP/1.0 keeps the connection only when the answer asks to.
    for head, connections in ((b"HTTP/1.0 200 OK\r\n", 2), (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\n", 1)):
        async with serving(fixed(head + OK.split(b"\r\n", 1)[1])) as server:
            client = HttpUpstream(limit=8, connect_timeout_s=5)
            await post(client, server.url)
            await post(client, server.url)
            assert server.connections == connections
            client.close()


async def test_bytes_that_arrive_while_a_connection_is_pooled_close_it():
    async def reply(writer: asyncio.StreamWriter, _: bytes) -> None:
        writer.write(OK)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n")  # nobody asked

    async with serving(reply) as server:
        client = HttpUpstream(limit=8, connect_timeout_s=5)
        await post(client, server.url)
        idle = client._idle[("127.0.0.1", int(server.url.rsplit(":", 1)[1]))]
        for _ in range(100):
            if not idle[0].reusable:
                break
            await asyncio.sleep(0.02)
        assert not idle[0].reusable
        assert await post(client, server.url) == b'{"ok":true}'
        assert server.connections == 2
        client.close()


async def test_an_answer_without_a_body_and_trailers_and_header_whitespace():
    no_content = b"HTTP/1.1 204 No Content\r\nX-Omni-Instance:  w-1 \r\n\r\n"
    async with serving(fixed(no_content)) as server:
        client = HttpUpstream(limit=8, connect_timeout_s=5)
        resp = await client.post(server.url, "/generate", b"{}", {}, timeout_s=10)
        assert resp.status == 204 and resp.header("X-Omni-Instance") == "w-1"
        assert await resp.read() == b""
        resp.release()
        resp = await client.post(server.url, "/generate", b"{}", {}, timeout_s=10)  # reused
        resp.release()
        assert server.connections == 1
        client.close()
    trailers = b"HTTP/1.1 200 OK\r\nContent-Type: a/b\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nContent-Type: c/d\r\n\r\n"
    async with serving(fixed(trailers)) as server:
        client = HttpUpstream(limit=8, connect_timeout_s=5)
        resp = await client.post(server.url, "/generate", b"{}", {}, timeout_s=10)
        assert await resp.read() == b"{}"
        assert resp.header("content-type") == "a/b"  # trailers do not rewrite the head
        resp.release()
        client.close()


async def test_interim_answer_is_skipped_and_head_split_across_reads():
    async def reply(writer: asyncio.StreamWriter, _: bytes) -> None:
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Le")
        await writer.drain()
        writer.write(b"ngth: 2\r\n\r\n{}")

    async with serving(reply) as server:
        client = HttpUpstream(limit=8, connect_timeout_s=5)
        assert await post(client, server.url) == b"{}"
        client.close()


async def test_a_pooled_connection_the_worker_closed_is_not_reused():
    async with serving(fixed(OK, close=True)) as server:
        client = HttpUpstream(limit=8, connect_timeout_s=5)
        await post(client, server.url)
        idle = client._idle[("127.0.0.1", int(server.url.rsplit(":", 1)[1]))]
        for _ in range(100):  # until the worker's close reached the client
            if not idle or not idle[0].reusable:
                break
            await asyncio.sleep(0.02)
        assert await post(client, server.url) == b'{"ok":true}'
        assert server.connections == 2
        client.close()


async def test_errors_before_and_after_the_answer_began():
    # Nobody listens: an OSError before any answer.
    client = HttpUpstream(limit=8, connect_timeout_s=5)
    async with serving(fixed(OK)) as server:
        url = server.url
    with pytest.raises(OSError):
        await post(client, url)
    # The worker closes without answering.
    async with serving(fixed(b"", close=True)) as server:
        with pytest.raises(ConnectionError):
            await post(client, server.url)
    # Not HTTP.
    async with serving(fixed(b"SSH-2.0-OpenSSH\r\n\r\n")) as server:
        with pytest.raises(UpstreamError, match="not valid HTTP"):
            await post(client, server.url)
    # The answer began, then the connection closed before its Content-Length was complete.
    async with serving(fixed(OK[:-4], close=True)) as server:
        resp = await client.post(server.url, "/generate", b"{}", {}, timeout_s=10)
        with pytest.raises(UpstreamError, match="mid-answer"):
            await resp.read()
        resp.release()
    # A broken chunk.
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
    async with serving(fixed(chunked)) as server:
        resp = await client.post(server.url, "/generate", b"{}", {}, timeout_s=10)
        with pytest.raises(UpstreamError, match="not valid HTTP"):
            await resp.read()
        resp.release()
    # A chunked answer whose connection closed between chunks.
    async with serving(fixed(chunked.replace(b"zz\r\n", b"2\r\n{}\r\n"), close=True)) as server:
        resp = await client.post(server.url, "/generate", b"{}", {}, timeout_s=10)
        with pytest.raises(UpstreamError, match="mid-answer"):
            await resp.read()
        resp.release()
    # A header value that would split the request.
    async with serving(fixed(OK)) as server:
        with pytest.raises(UpstreamError, match="line break"):
            await client.post(server.url, "/generate", b"{}", {"Accept": "a\r\nX-Evil: 1"}, timeout_s=10)
    client.close()


async def test_malformed_heads_and_upgrades_fail_before_the_answer():
    client = HttpUpstream(limit=8, connect_timeout_s=5)
    bad = [
        b"HTTP/1.1 200 OK\r\nNo colon here\r\n\r\n",
        b"HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nxx",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    ]
    for raw in bad:
        async with serving(fixed(raw)) as server:
            with pytest.raises(UpstreamError, match="not valid HTTP"):
                await post(client, server.url)
    switch = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n"
    async with serving(fixed(switch)) as server:
        with pytest.raises(UpstreamError, match="switched protocols"):
            await post(client, server.url)
    endless = b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (upstream.MAX_HEAD_BYTES + 1)
    async with serving(fixed(endless)) as server:
        with pytest.raises(UpstreamError, match="too large"):
            await post(client, server.url)
    client.close()


async def test_the_deadline_covers_the_head_and_the_body():
    async def silent(writer: asyncio.StreamWriter, _: bytes) -> None:
        await asyncio.sleep(30)

    async def half(writer: asyncio.StreamWriter, _: bytes) -> None:
        writer.write(OK[:-4])
        await writer.drain()
        await asyncio.sleep(30)

    client = HttpUpstream(limit=8, connect_timeout_s=5)
    async with serving(silent) as server:
        with pytest.raises(TimeoutError):
            await post(client, server.url, timeout_s=0.2)
    async with serving(half) as server:
        resp = await client.post(server.url, "/generate", b"{}", {}, timeout_s=0.2)
        with pytest.raises(TimeoutError):
            await resp.read()
        resp.release()
    client.close()


async def test_the_limit_queues_requests_and_cancellation_frees_the_slot():
    gate = asyncio.Event()

    async def held(writer: asyncio.StreamWriter, body: bytes) -> None:
        if body == b"hold":
            await gate.wait()
        writer.write(OK)
        await writer.drain()

    async with serving(held) as server:
        client = HttpUpstream(limit=1, connect_timeout_s=5)
        first = asyncio.ensure_future(post(client, server.url, b"hold"))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(post(client, server.url))
        await asyncio.sleep(0.05)
        assert not second.done()  # waits for the only slot
        first.cancel()  # the caller went away: its connection is closed and its slot freed
        with pytest.raises(asyncio.CancelledError):
            await first
        assert await second == b'{"ok":true}'
        gate.set()
        client.close()


@pytest.mark.parametrize("framing", ["length", "chunked", "until-close"])
async def test_a_slow_caller_pauses_reading_and_a_large_body_read_whole_is_not_stalled(framing: str):
    big = b"y" * (3 * 1024 * 1024)
    if framing == "length":
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(big), big)
    elif framing == "chunked":
        pieces = [big[i : i + 100_000] for i in range(0, len(big), 100_000)]
        answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        answer += b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    else:
        answer = b"HTTP/1.1 200 OK\r\n\r\n" + big
    async with serving(fixed(answer, close=framing == "until-close")) as server:
        client = HttpUpstream(limit=8, connect_timeout_s=5)
        assert await post(client, server.url) == big
        resp = await client.post(server.url, "/generate", b"{}", {}, timeout_s=10)
        conn = resp._conn  # type: ignore[attr-defined]
        for _ in range(100):  # a caller that reads nothing yet: the client stops reading at the high water
            if conn._paused:
                break
            await asyncio.sleep(0.02)
        assert conn._paused and not conn.complete
        got = bytearray()
        async for chunk in resp.chunks():  # reading resumes as the caller takes
            got += chunk
        resp.release()
        assert got == big
        assert server.connections == (2 if framing == "until-close" else 1)
        client.close()


async def test_waiting_for_a_slot_counts_against_the_deadline():
    gate = asyncio.Event()

    async def held(writer: asyncio.StreamWriter, body: bytes) -> None:
        if body == b"hold":
            await gate.wait()
        writer.write(OK)
        await writer.drain()

    async with serving(held) as server:
        client = HttpUpstream(limit=1, connect_timeout_s=5)
        first = asyncio.ensure_future(post(client, server.url, b"hold"))
        await asyncio.sleep(0.05)
        with pytest.raises(TimeoutError):
            await post(client, server.url, timeout_s=0.2)
        gate.set()
        assert await first == b'{"ok":true}'
        assert await post(client, server.url) == b'{"ok":true}'  # the timed-out wait took no slot
        client.close()


async def test_idle_connections_of_workers_that_get_no_more_requests_are_closed(monkeypatch):
    monkeypatch.setattr(upstream, "KEEPALIVE_S", 0.05)
    async with serving(fixed(OK)) as gone, serving(fixed(OK)) as stays:
        client = HttpUpstream(limit=8, connect_timeout_s=5)
        await post(client, gone.url)
        gone_key = ("127.0.0.1", int(gone.url.rsplit(":", 1)[1]))
        assert len(client._idle[gone_key]) == 1
        await asyncio.sleep(0.1)
        await post(client, stays.url)  # a later request sweeps the pool
        assert gone_key not in client._idle
        client.close()


# ----------------------------------------------------------------------------- the admin fan-out's whole exchanges


def echo_request() -> Reply:
    """Answers each request with its own head and body back, Content-Length framed."""

    async def reply(writer: asyncio.StreamWriter, body: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()

    return reply


async def test_fetch_any_method_with_or_without_a_body_and_every_framing():
    async with serving(echo_request()) as server:
        client = HttpUpstream(limit=0, connect_timeout_s=5, max_idle_per_host=8)
        status, body = await client.fetch(
            "POST", server.url, "/flush_cache?x=1", b'{"a": 1}', {"Authorization": "Bearer k"}, timeout_s=5
        )
        assert (status, body) == (200, b'{"a": 1}')
        head = server.requests[-1]
        assert head.startswith(b"POST /flush_cache?x=1 HTTP/1.1\r\n")
        assert b"\r\nAuthorization: Bearer k\r\n" in head and b"\r\nContent-Length: 8\r\n" in head
        # A GET without a body carries no Content-Length at all, on the same pooled connection.
        assert await client.fetch("GET", server.url, "/model_info", None, {}, timeout_s=5) == (200, b"")
        assert server.requests[-1].startswith(b"GET /model_info HTTP/1.1\r\n")
        assert b"content-length" not in server.requests[-1].lower()
        assert server.connections == 1
        client.close()
    chunked = (
        b'HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{"a"\r\n3\r\n: 1\r\n1\r\n}\r\n0\r\n\r\n'
    )
    async with serving(fixed(chunked)) as server:
        client = HttpUpstream(limit=0, connect_timeout_s=5)
        assert await client.fetch("GET", server.url, "/x", None, {}, timeout_s=5) == (404, b'{"a": 1}')
        client.close()
    async with serving(fixed(b"HTTP/1.1 200 OK\r\n\r\nbye", close=True)) as server:
        client = HttpUpstream(limit=0, connect_timeout_s=5)
        assert await client.fetch("GET", server.url, "/x", None, {}, timeout_s=5) == (200, b"bye")
        assert not client._idle.get(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
        client.close()


async def test_fetch_caps_the_body_and_closes_that_connection():
    big = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 100
    big_chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"32\r\n" + b"x" * 50 + b"\r\n" * 2
    for raw in (big, big_chunked):
        async with serving(fixed(raw)) as server:
            client = HttpUpstream(limit=0, connect_timeout_s=5)
            with pytest.raises(UpstreamError, match="larger than 40 bytes"):
                await client.fetch("GET", server.url, "/x", None, {}, timeout_s=5, max_bytes=40)
            assert not client._idle.get(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
            client.close()
    assert upstream.MAX_BODY_BYTES == 64 * 1024 * 1024


async def test_fetch_timeout_refusals_and_the_idle_bound_per_worker():
    gate = asyncio.Event()

    async def slow(writer: asyncio.StreamWriter, _: bytes) -> None:
        await gate.wait()
        writer.write(OK)
        await writer.drain()

    async with serving(slow) as server:
        client = HttpUpstream(limit=0, connect_timeout_s=5, max_idle_per_host=2)
        with pytest.raises(TimeoutError):
            await client.fetch("POST", server.url, "/slow", b"{}", {}, timeout_s=0.2)
        gate.set()
        # Three at once (no bound in flight), two kept idle afterwards.
        answers = await asyncio.gather(*(client.fetch("GET", server.url, "/", None, {}, timeout_s=5) for _ in range(3)))
        assert answers == [(200, b'{"ok":true}')] * 3
        assert len(client._idle[("127.0.0.1", int(server.url.rsplit(":", 1)[1]))]) == 2
        with pytest.raises(UpstreamError, match="line break"):
            await client.fetch("GET", server.url, "/", None, {"X": "a\r\nb"}, timeout_s=5)
        with pytest.raises(UpstreamError, match="HEAD"):
            await client.fetch("HEAD", server.url, "/", None, {}, timeout_s=5)
        client.close()
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(OSError):
        await HttpUpstream(limit=0, connect_timeout_s=5).fetch(
            "GET", f"http://127.0.0.1:{port}", "/", None, {}, timeout_s=5
        )
