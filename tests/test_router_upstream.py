"""The gateway's worker client against scripted loopback servers.

The lean HTTP/1.1 transport: every framing, keep-alive reuse and when a connection must not be
reused, errors, the deadline, cancellation, the in-flight limit, flow control, and whole exchanges
(any method, no body, the size cap, the idle bound per worker). Then :class:`WorkerClient`: one
typed decode and one failure classification for whole answers, contract endpoint calls, and the
transport chosen by scheme."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from router.contract import endpoints as ep
from router.contract.admin import AbortRequest, HealthStatus, ModelInfo
from router.gateway.upstream import UpstreamError, WorkerClient, lean_conn, lean_http
from router.gateway.upstream.lean_http import HttpUpstream
from router.gateway.upstream.transport import MAX_BODY_BYTES
from tests._polling import until

Reply = Callable[[asyncio.StreamWriter, bytes], Awaitable[None]]


class Server:
    """Reads each request (head + Content-Length body) and answers with a scripted reply."""

    def __init__(self, reply: Reply):
        self.reply = reply
        self.connections = 0
        self.requests: list[bytes] = []
        self.url = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
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
    srv = await asyncio.start_server(server.serve, "127.0.0.1", 0)
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
    resp = await client.request(
        "POST", url, "/generate", body, {"Content-Type": "application/json"}, timeout_s=timeout_s
    )
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
        resp = await client.request("POST", server.url, "/generate", b"{}", {}, timeout_s=10)
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
    pooled_now = asyncio.Event()

    async def reply(writer: asyncio.StreamWriter, _: bytes) -> None:
        writer.write(OK)
        await writer.drain()
        await pooled_now.wait()  # the client has taken the answer and pooled the connection
        writer.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n")  # nobody asked

    async with serving(reply) as server:
        client = HttpUpstream(limit=8, connect_timeout_s=5)
        await post(client, server.url)
        (pooled,) = client.idle_connections(server.url)
        assert pooled.reusable
        pooled_now.set()
        await until(lambda: not pooled.reusable, 5, "the unasked-for answer closed the pooled connection")
        assert await post(client, server.url) == b'{"ok":true}'
        assert server.connections == 2
        client.close()


async def test_an_answer_without_a_body_and_trailers_and_header_whitespace():
    no_content = b"HTTP/1.1 204 No Content\r\nX-Omni-Instance:  w-1 \r\n\r\n"
    async with serving(fixed(no_content)) as server:
        client = HttpUpstream(limit=8, connect_timeout_s=5)
        resp = await client.request("POST", server.url, "/generate", b"{}", {}, timeout_s=10)
        assert resp.status == 204 and resp.header("X-Omni-Instance") == "w-1"
        assert await resp.read() == b""
        resp.release()
        resp = await client.request("POST", server.url, "/generate", b"{}", {}, timeout_s=10)  # reused
        resp.release()
        assert server.connections == 1
        client.close()
    trailers = b"HTTP/1.1 200 OK\r\nContent-Type: a/b\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nContent-Type: c/d\r\n\r\n"
    async with serving(fixed(trailers)) as server:
        client = HttpUpstream(limit=8, connect_timeout_s=5)
        resp = await client.request("POST", server.url, "/generate", b"{}", {}, timeout_s=10)
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
        (pooled,) = client.idle_connections(server.url)
        await until(lambda: not pooled.reusable, 5, "the worker's close reached the client")
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
        resp = await client.request("POST", server.url, "/generate", b"{}", {}, timeout_s=10)
        with pytest.raises(UpstreamError, match="mid-answer"):
            await resp.read()
        resp.release()
    # A broken chunk.
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
    async with serving(fixed(chunked)) as server:
        resp = await client.request("POST", server.url, "/generate", b"{}", {}, timeout_s=10)
        with pytest.raises(UpstreamError, match="not valid HTTP"):
            await resp.read()
        resp.release()
    # A chunked answer whose connection closed between chunks.
    async with serving(fixed(chunked.replace(b"zz\r\n", b"2\r\n{}\r\n"), close=True)) as server:
        resp = await client.request("POST", server.url, "/generate", b"{}", {}, timeout_s=10)
        with pytest.raises(UpstreamError, match="mid-answer"):
            await resp.read()
        resp.release()
    # A header value that would split the request.
    async with serving(fixed(OK)) as server:
        with pytest.raises(UpstreamError, match="line break"):
            await client.request("POST", server.url, "/generate", b"{}", {"Accept": "a\r\nX-Evil: 1"}, timeout_s=10)
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
    endless = b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (lean_conn.MAX_HEAD_BYTES + 1)
    async with serving(fixed(endless)) as server:
        with pytest.raises(UpstreamError, match="too large"):
            await post(client, server.url)
    client.close()


async def test_the_deadline_covers_the_head_and_the_body():
    async def silent(writer: asyncio.StreamWriter, _: bytes) -> None:
        await asyncio.sleep(30)  # the behaviour under test: a worker that never answers (past the 0.2 s deadline)

    async def half(writer: asyncio.StreamWriter, _: bytes) -> None:
        writer.write(OK[:-4])
        await writer.drain()
        await asyncio.sleep(30)  # the behaviour under test: an answer whose body never ends

    client = HttpUpstream(limit=8, connect_timeout_s=5)
    async with serving(silent) as server:
        with pytest.raises(TimeoutError):
            await post(client, server.url, timeout_s=0.2)
    async with serving(half) as server:
        resp = await client.request("POST", server.url, "/generate", b"{}", {}, timeout_s=0.2)
        with pytest.raises(TimeoutError):
            await resp.read()
        resp.release()
    client.close()


def holding() -> tuple[Reply, asyncio.Event, asyncio.Event]:
    """A reply that holds a request whose body is ``hold`` until released; ``arrived`` once it came."""
    arrived, release = asyncio.Event(), asyncio.Event()

    async def reply(writer: asyncio.StreamWriter, body: bytes) -> None:
        if body == b"hold":
            arrived.set()
            await release.wait()
        writer.write(OK)
        await writer.drain()

    return reply, arrived, release


async def test_the_limit_queues_requests_and_cancellation_frees_the_slot():
    reply, arrived, release = holding()
    async with serving(reply) as server:
        client = HttpUpstream(limit=1, connect_timeout_s=5)
        first = asyncio.ensure_future(post(client, server.url, b"hold"))
        await arrived.wait()  # the first request holds the only slot
        second = asyncio.ensure_future(post(client, server.url))
        await until(lambda: client.waiting == 1, 5, "the second request waits for a slot")
        assert not second.done() and len(server.requests) == 1
        first.cancel()  # the caller went away: its connection is closed and its slot freed
        with pytest.raises(asyncio.CancelledError):
            await first
        assert await second == b'{"ok":true}'
        assert client.waiting == 0
        release.set()
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
        resp = await client.request("POST", server.url, "/generate", b"{}", {}, timeout_s=10)
        # A caller that reads nothing yet: the client stops reading at the high water.
        await until(lambda: resp.reading_paused, 5, "reading paused")
        assert not resp.complete
        got = bytearray()
        async for chunk in resp.chunks():  # reading resumes as the caller takes
            got += chunk
        resp.release()
        assert got == big
        assert server.connections == (2 if framing == "until-close" else 1)
        client.close()


async def test_waiting_for_a_slot_counts_against_the_deadline():
    reply, arrived, release = holding()
    async with serving(reply) as server:
        client = HttpUpstream(limit=1, connect_timeout_s=5)
        first = asyncio.ensure_future(post(client, server.url, b"hold"))
        await arrived.wait()  # the first request holds the only slot
        with pytest.raises(TimeoutError):
            await post(client, server.url, timeout_s=0.2)
        assert client.waiting == 0 and len(server.requests) == 1  # it never reached the worker
        release.set()
        assert await first == b'{"ok":true}'
        assert await post(client, server.url) == b'{"ok":true}'  # the timed-out wait took no slot
        client.close()


async def test_idle_connections_of_workers_that_get_no_more_requests_are_closed(monkeypatch):
    monkeypatch.setattr(lean_http, "KEEPALIVE_S", 0.05)
    async with serving(fixed(OK)) as gone, serving(fixed(OK)) as stays:
        client = HttpUpstream(limit=8, connect_timeout_s=5)
        await post(client, gone.url)
        assert len(client.idle_connections(gone.url)) == 1
        await asyncio.sleep(0.1)  # not a wait for an event: the pooled connection must outlive its keep-alive
        assert len(client.idle_connections(gone.url)) == 1  # still pooled until a sweep
        await post(client, stays.url)  # a later request sweeps the pool
        assert client.idle_connections(gone.url) == []
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
        assert client.idle_connections(server.url) == []
        client.close()


async def test_fetch_caps_the_body_and_closes_that_connection():
    big = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 100
    big_chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"32\r\n" + b"x" * 50 + b"\r\n" * 2
    for raw in (big, big_chunked):
        async with serving(fixed(raw)) as server:
            client = HttpUpstream(limit=0, connect_timeout_s=5)
            with pytest.raises(UpstreamError, match="larger than 40 bytes"):
                await client.fetch("GET", server.url, "/x", None, {}, timeout_s=5, max_bytes=40)
            assert client.idle_connections(server.url) == []
            client.close()
    assert MAX_BODY_BYTES == 64 * 1024 * 1024


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
        assert len(client.idle_connections(server.url)) == 2
        with pytest.raises(UpstreamError, match="line break"):
            await client.fetch("GET", server.url, "/", None, {"X": "a\r\nb"}, timeout_s=5)
        with pytest.raises(UpstreamError, match="HEAD"):
            await client.fetch("HEAD", server.url, "/", None, {}, timeout_s=5)
        client.close()
    with pytest.raises(OSError):
        await HttpUpstream(limit=0, connect_timeout_s=5).fetch(
            "GET", f"http://127.0.0.1:{closed_port()}", "/", None, {}, timeout_s=5
        )


async def test_fetch_all_sends_in_one_pass_and_converts_each_answer_as_it_lands():
    """A broadcast's batch: the first call to each worker opens a connection (a task of its own), later ones
    reuse the pooled connection and are written in one pass; each call ends on its own (an answer, a body over
    the cap, a deadline, a worker that closed), and the connections that answered whole are pooled again."""
    gate = asyncio.Event()
    big = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 100

    async def stalls_second_time(writer: asyncio.StreamWriter, _: bytes) -> None:
        if stalled.connections and stalled.requests[1:]:
            await gate.wait()
        writer.write(OK)
        await writer.drain()

    async with (
        serving(fixed(OK)) as ok,
        serving(fixed(big)) as large,
        serving(stalls_second_time) as stalled,
        serving(fixed(OK)) as closing,
    ):
        client = HttpUpstream(limit=0, connect_timeout_s=5)
        calls = [(s.url, "/flush_cache", b"{}") for s in (ok, large, stalled, closing)]
        landed: list[int] = []

        def convert(i: int, exchange: lean_http.Exchange) -> object:
            landed.append(i)
            return exchange if isinstance(exchange, BaseException) else exchange[:2]

        first = await client.fetch_all("POST", calls, {}, timeout_s=5, convert=convert, max_bytes=40)
        assert first[0] == (200, b'{"ok":true}') and first[2] == (200, b'{"ok":true}')
        assert isinstance(first[1], UpstreamError) and "larger than 40" in str(first[1])
        assert sorted(landed) == [0, 1, 2, 3] and client.idle_connections(large.url) == []
        for conn in client.idle_connections(closing.url):
            assert conn.transport is not None
        landed.clear()
        closing.reply = fixed(b"", close=True)  # answers nothing and closes, on its pooled connection
        second = await client.fetch_all("POST", calls, {}, timeout_s=0.5, convert=convert, max_bytes=40)
        assert second[0] == (200, b'{"ok":true}') and ok.connections == 1  # the pooled connection, reused
        assert isinstance(second[2], TimeoutError) and isinstance(second[3], (ConnectionError, UpstreamError))
        assert sorted(landed) == [0, 1, 2, 3]
        assert len(client.idle_connections(ok.url)) == 1 and client.idle_connections(stalled.url) == []
        gate.set()
        client.close()


async def test_a_cancelled_batch_closes_what_it_sent_and_nothing_lands_afterwards():
    """No task per call: the batch's own cancellation must close every connection still mid-exchange (never
    pooled half-read), and an answer that comes later lands nowhere. A header that cannot be sent fails every
    call of the batch, and a bare ``POST`` says it has no body."""
    gate = asyncio.Event()

    async def held(writer: asyncio.StreamWriter, _: bytes) -> None:
        await gate.wait()
        writer.write(OK)
        await writer.drain()

    async with serving(fixed(OK)) as ok, serving(held) as slow:
        client = HttpUpstream(limit=0, connect_timeout_s=5)
        calls = [(ok.url, "/flush_cache", b""), (slow.url, "/flush_cache", b"")]
        landed: list[int] = []

        def convert(i: int, exchange: lean_http.Exchange) -> object:
            landed.append(i)
            return exchange

        gate.set()
        await client.fetch_all("POST", calls, {}, timeout_s=5, convert=convert)  # opens and pools both
        assert b"\r\nContent-Length: 0\r\n" in ok.requests[-1] and ok.requests[-1].endswith(b"\r\n\r\n")
        gate.clear()
        landed.clear()
        batch = asyncio.create_task(client.fetch_all("POST", calls, {}, timeout_s=5, convert=convert))
        await until(lambda: len(slow.requests) == 2 and landed == [0], what="the second request sent, one answer in")
        batch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await batch
        assert client.idle_connections(slow.url) == [] and len(client.idle_connections(ok.url)) == 1
        gate.set()
        await asyncio.sleep(0.05)
        assert landed == [0]
        refused = await client.fetch_all("POST", calls, {"X": "a\r\nb"}, timeout_s=5, convert=convert)
        assert all(isinstance(r, UpstreamError) and "line break" in str(r) for r in refused)
        assert len(client.idle_connections(ok.url)) == 1  # refused before a byte: the connection is pooled again
        client.close()


# ----------------------------------------------------------------------------- the worker client


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


HEALTHY = b'{"status": "ok", "weight_version": "v1", "weight_state": "serving"}'


async def test_fetch_decodes_into_the_model_and_classifies_every_failure():
    workers = WorkerClient(stream_limit=8, connect_timeout_s=5)
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(HEALTHY), HEALTHY)
    async with serving(fixed(answer)) as server:
        got = await workers.fetch(server.url, "/health", HealthStatus, headers={}, timeout_s=5)
        assert got.status == 200 and got.error is None
        assert isinstance(got.value, HealthStatus) and got.value.weight_version == "v1"
    async with serving(fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]")) as server:
        got = await workers.fetch(server.url, "/health", HealthStatus, headers={}, timeout_s=5)
        assert got.status == 200 and got.value is None and got.error is not None
        assert "not a valid HealthStatus" in got.error
    refused = b'{"error": {"message": "needs key"}}'
    refusal = b"HTTP/1.1 401 Unauthorized\r\nContent-Length: %d\r\n\r\n%s" % (len(refused), refused)
    async with serving(fixed(refusal)) as server:
        got = await workers.fetch(server.url, "/model_info", ModelInfo, headers={}, timeout_s=5)
        assert (got.status, got.body, got.error) == (401, None, "needs key")

    async def silent(writer: asyncio.StreamWriter, _: bytes) -> None:
        await asyncio.sleep(30)  # the behaviour under test: a worker that never answers (past the 0.2 s deadline)

    async with serving(silent) as server:
        got = await workers.fetch(server.url, "/health", HealthStatus, headers={}, timeout_s=0.2)
        assert (got.status, got.value, got.error) == (None, None, "no answer within 0.2s")
    url = f"http://127.0.0.1:{closed_port()}"
    got = await workers.fetch(url, "/health", HealthStatus, headers={}, timeout_s=5)
    assert got.status is None and got.error is not None and "ConnectionRefusedError" in got.error
    async with serving(fixed(OK)) as server:
        got = await workers.fetch(server.url, "/health", HealthStatus, headers={"X": "a\r\nb"}, timeout_s=5)
        assert got.status is None and got.error is not None and got.error.startswith("UpstreamError: ")
    # Not http://: aiohttp carries it, and its errors are classified the same way.
    got = await workers.fetch(f"https://127.0.0.1:{closed_port()}", "/health", HealthStatus, headers={}, timeout_s=5)
    assert got.status is None and got.error is not None and "ClientConnectorError" in got.error
    await workers.close()


async def test_call_takes_its_method_body_and_deadline_from_the_endpoint(monkeypatch):
    workers = WorkerClient(stream_limit=8, connect_timeout_s=5)
    waits: list[float] = []
    fetch = workers.fetch

    async def recording(*args, **kwargs):
        waits.append(kwargs["timeout_s"])
        return await fetch(*args, **kwargs)

    monkeypatch.setattr(workers, "fetch", recording)
    async with serving(echo_request()) as server:
        info = await workers.call(server.url, ep.MODEL_INFO, headers={"Authorization": "Bearer k"})
        assert server.requests[-1].startswith(b"GET /model_info HTTP/1.1\r\n")
        assert b"content-length" not in server.requests[-1].lower()
        assert info.status == 200 and info.error is not None  # an empty body is no ModelInfo
        aborted = await workers.call(server.url, ep.ABORT_REQUEST, AbortRequest(rid="r-1"), headers={})
        assert server.requests[-1].startswith(b"POST /abort_request HTTP/1.1\r\n")
        assert server.requests[-1].endswith(b'\r\n\r\n{"rid":"r-1"}')
        # Decoded as the endpoint's response model (the echoed request is not one).
        assert aborted.status == 200 and aborted.error is not None and "AbortRequestResult" in aborted.error
    assert waits == [ep.MODEL_INFO.budget.router_wait(), ep.ABORT_REQUEST.budget.router_wait()]
    await workers.close()


async def test_the_aiohttp_transport_reads_whole_answers_within_the_cap():
    from router.gateway.upstream.via_aiohttp import AiohttpUpstream

    tls = AiohttpUpstream(limit=8, connect_timeout_s=5)
    async with serving(echo_request()) as server:
        assert await tls.fetch("POST", server.url, "/x", b'{"a": 1}', {}, timeout_s=5) == (200, b'{"a": 1}')
        with pytest.raises(UpstreamError, match="larger than 4 bytes"):
            await tls.fetch("POST", server.url, "/x", b'{"a": 1}', {}, timeout_s=5, max_bytes=4)
        resp = await tls.request("POST", server.url, "/x", b"streamed", {}, timeout_s=5)
        assert resp.status == 200 and b"".join([c async for c in resp.chunks()]) == b"streamed"
        resp.release()
    with pytest.raises(ConnectionError):
        await tls.request("GET", f"http://127.0.0.1:{closed_port()}", "/", None, {}, timeout_s=5)
    await tls.close()
