"""The front door under hostile callers: raw bytes on loopback sockets, against both servers a router may serve
its generation routes with (its lean server, :mod:`router.gateway.frontend`, and aiohttp's behind
:mod:`router.gateway.edge`), in-process, with scripted stand-in workers.

What a caller can do to cost the router memory, a worker's time or another caller's answer, and what the
router must answer (docs/router.md, "The front door"; :mod:`router.gateway.head_rules`):

- a head that is refused before any body byte is read (a repeated single header, no key, a declared length
  over the bound, the lean server's body budget): answered at once, ``Connection: close``, then closed;
- framing two parsers could read two ways (request smuggling): refused with a 4xx, never forwarded, a
  second request hidden in the body never served;
- HTTP/1.0 (no chunked coding), ``Expect: 100-continue``, pipelining (in order, one answer per complete
  request);
- callers that vanish mid-body or mid-request, slowloris heads beside normal traffic, a pipelining flood
  the server must stop reading, a stream whose caller stops reading (cut after the stall bound, aborted on
  its worker);
- a property-based fuzz of request bytes against the lean server: no 5xx, never more answers than complete
  requests, nothing held or left open afterwards.

Sockets are raw and non-blocking (``loop.sock_*``), not asyncio streams: a server that refuses a request
while its caller is still sending may reset the connection, and a stream reader drops what it buffered
when it sees the reset; the kernel hands over the answer before the error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import hypothesis
import pytest
from aiohttp import web
from hypothesis import strategies as st

from router.contract.generate import INSTANCE_HEADER
from router.contract.web.parsing import MAX_BODY_BYTES
from router.gateway import keys
from router.gateway.app import create_app
from router.gateway.config import RouterConfig
from router.gateway.frontend.connection import MAX_HEAD_BYTES
from router.gateway.frontend.site import FRONTEND, LeanServer, LeanSite
from router.gateway.serving import app_runner
from tests._hypothesis import generate_only
from tests._polling import until
from tests.procs import free_port
from tests.test_lean_frontend import API_KEY, BODY, generate_request
from tests.test_router_proxy import REPLY, StandIn, serve_lean, serve_standins

#: The stall bound of every router here: small, so a caller that stops reading is cut within the test.
STALL_S = 0.5
#: "At once": the caller sent only the head (or one body byte), so a later answer means the server waited
#: for a body it should never have read.
AT_ONCE_S = 2.0
JSON = "Content-Type: application/json"
MIB = 1024 * 1024
#: One event of the endless stream: large, so the caller's buffers fill within a fraction of a second.
EVENT = b'data: {"text": "' + b"x" * (64 * 1024) + b'"}\n\n'
#: A whole request that a worker would record if it were served: hidden in another request's body, it shows
#: a server that read the framing one way where a proxy in front could read it another.
SMUGGLED = generate_request(b'{"text": "smuggled"}')


# -- the workers -------------------------------------------------------------------------------------------------------


class Worker(StandIn):
    """A :class:`StandIn` that records each ``/generate``'s headers, and has three more modes: ``echo``
    (answers with the request's ``rid``, to tell pipelined answers apart), ``hold`` (answers once
    ``release`` is set, 10 s at most) and ``endless`` (streams 64 KiB events until its request is aborted or
    its connection closes, 10 s at most)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.seen: list[Any] = []
        """The headers of every ``/generate`` (aiohttp's multidict: a repeated header shows as repeated)."""

    def app(self) -> web.Application:
        app = super().app()

        @web.middleware
        async def scripted(request: web.Request, handler: Any) -> web.StreamResponse:
            if request.path != "/generate":
                return cast(web.StreamResponse, await handler(request))
            self.seen.append(request.headers)
            if self.mode not in ("echo", "hold", "endless"):
                return cast(web.StreamResponse, await handler(request))
            body = await request.read()
            self.bodies.append(body)
            headers = {INSTANCE_HEADER: self.instance}
            if self.mode == "echo":
                rid = json.loads(body).get("rid")
                answer = {"text": rid, "output_ids": [1], "meta_info": {"id": "x", "weight_version": "default"}}
                return web.json_response(answer, headers=headers)
            if self.mode == "hold":
                self.arrived.set()
                await asyncio.wait_for(self.release.wait(), 10)
                return web.Response(body=REPLY, content_type="application/json", headers=headers)
            return await self._endless(request, headers)

        app.middlewares.append(scripted)
        return app

    async def _endless(self, request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
        await resp.prepare(request)
        deadline = loop.time() + 10
        try:
            while not self.aborted.is_set() and (left := deadline - loop.time()) > 0:
                await asyncio.wait_for(resp.write(EVENT), left)
                await asyncio.sleep(0)  # let the abort, when it comes, be served
        except (ConnectionResetError, TimeoutError):
            pass  # the router hung up: what the test waits for
        return resp


# -- both servers ------------------------------------------------------------------------------------------------------


@dataclass
class Front:
    """One router's generation routes on ``host:port``; ``lean`` is its lean server (``None``: aiohttp's)."""

    kind: str
    host: str
    port: int
    app: web.Application
    workers: list[Worker]
    lean: LeanServer | None

    @property
    def metrics(self) -> Any:
        return self.app[keys.METRICS]

    def served(self) -> int:
        """Requests the workers have received."""
        return sum(len(w.bodies) for w in self.workers)

    def set_mode(self, mode: str) -> None:
        for worker in self.workers:
            worker.mode = mode


@pytest.fixture(params=["lean", "aiohttp"])
async def front(request: Any, tmp_path: Path) -> AsyncIterator[Front]:
    workers = [Worker("a"), Worker("b")]
    servers = await serve_standins(list(workers))
    config = RouterConfig(
        worker_urls=[f"http://127.0.0.1:{server.port}" for server in servers],
        state_dir=tmp_path / "state",
        policy="round_robin",
        health_check_interval_s=3600.0,  # one probe round at start-up
        api_key=API_KEY,
        stream_stall_timeout_s=STALL_S,
    )
    app = create_app(config)
    lean: LeanServer | None = None
    if request.param == "lean":
        client = await serve_lean(app, app[FRONTEND].check)  # the app's own check: the config's key
        site = cast(LeanSite, next(iter(client._runner.sites)))
        lean = site._lean
        port = int(client.base.rsplit(":", 1)[1])
        close = client.close
    else:
        # As the router serves with --generation-server aiohttp (router/gateway/serving.py).
        runner = app_runner(app, 1.0)  # as the router serves it (refusals at the head close at once)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        close = runner.cleanup
    registry = app[keys.REGISTRY]
    try:
        await until(lambda: len(registry.routable()) == 2, 4, "the first probes to find both workers")
        yield Front(request.param, "127.0.0.1", port, app, workers, lean)
    finally:
        for worker in workers:
            worker.release.set()
            worker.aborted.set()
        await close()
        for server in servers:
            await server.close()


def lean_only(front: Front) -> LeanServer:
    assert front.lean is not None
    return front.lean


def gauge(metric: Any) -> float:
    """A metric's one sample (a ``set_function`` gauge has no ``_value`` to read)."""
    return float(metric.collect()[0].samples[0].value)


# -- requests as bytes -------------------------------------------------------------------------------------------------


def raw_request(
    *headers: str, body: bytes = b"", key: str | None = API_KEY, line: str = "POST /generate HTTP/1.1"
) -> bytes:
    """A request with exactly ``headers`` besides ``Host`` and the key: no length is added."""
    auth = [f"Authorization: Bearer {key}"] if key else []
    return ("\r\n".join([line, "Host: router", *auth, *headers]) + "\r\n\r\n").encode("latin-1") + body


def chunked(body: bytes) -> bytes:
    return b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)


def http_1_0(request: bytes) -> bytes:
    return request.replace(b"HTTP/1.1", b"HTTP/1.0", 1)


# -- answers as bytes --------------------------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    """Names in lower case; a repeated header keeps its first value."""
    body: bytes


def parse_answers(data: bytes, closed: bool) -> list[Answer]:
    """The whole answers in ``data`` (interim ones included); a close-delimited body is whole once ``closed``."""
    answers: list[Answer] = []
    while True:
        end = data.find(b"\r\n\r\n")
        if end < 0:
            return answers
        status_line, *lines = data[:end].decode("latin-1").split("\r\n")
        version, status, _ = status_line.split(" ", 2)
        # aiohttp answers a request the lean server handed over in the request's own version (``HTTP/2.0`` too).
        assert re.fullmatch(r"HTTP/\d\.\d", version) and re.fullmatch(r"\d{3}", status), status_line
        headers: dict[str, str] = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers.setdefault(name.strip().lower(), value.strip())
        rest = data[end + 4 :]
        if int(status) < 200:
            body = b""
        elif "content-length" in headers:
            size = int(headers["content-length"])
            if len(rest) < size:
                return answers
            body, rest = rest[:size], rest[size:]
        elif "chunked" in headers.get("transfer-encoding", ""):
            whole = _dechunk(rest)
            if whole is None:
                return answers
            body, rest = whole
        elif closed:
            body, rest = rest, b""
        else:
            return answers
        answers.append(Answer(int(status), headers, body))
        data = rest


def _dechunk(data: bytes) -> tuple[bytes, bytes] | None:
    body = b""
    while True:
        end = data.find(b"\r\n")
        if end < 0:
            return None
        size = int(data[:end], 16)
        if len(data) < end + 2 + size + 2:
            return None
        body += data[end + 2 : end + 2 + size]
        data = data[end + 2 + size + 2 :]
        if size == 0:
            return body, data


def finals(answers: list[Answer]) -> list[Answer]:
    return [a for a in answers if a.status >= 200]


@dataclass
class Reply:
    """What came back on one connection: its bytes, whether the server closed it, and how long the first
    final answer took to come whole (``None``: it did not)."""

    data: bytes
    closed: bool
    answered_s: float | None

    @property
    def answers(self) -> list[Answer]:
        return parse_answers(self.data, self.closed)

    @property
    def finals(self) -> list[Answer]:
        return finals(self.answers)

    def show(self) -> str:
        return f"{self.data[:400]!r}{'...' if len(self.data) > 400 else ''} (closed: {self.closed})"


# -- raw sockets -------------------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def dial(front: Front, *, rcvbuf: int | None = None, sndbuf: int | None = None) -> AsyncIterator[socket.socket]:
    """A non-blocking loopback connection, closed on leaving; the buffer sizes are set before connecting."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        if sndbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        sock.setblocking(False)
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (front.host, front.port)), 5)
        yield sock
    finally:
        sock.close()


async def send(sock: socket.socket, data: bytes) -> bool:
    """Send all of ``data``; ``False`` when the server closed first (it may refuse before reading it all)."""
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_sendall(sock, data), 5)
        return True
    except (ConnectionResetError, BrokenPipeError):
        return False


async def receive(sock: socket.socket, *, want: int | None = None, quiet_s: float = 1.0, limit_s: float = 5.0) -> Reply:
    """Read until the server closes, ``want`` final answers are whole, ``quiet_s`` passes without a byte, or
    ``limit_s`` in all."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    data = b""
    answered: float | None = None
    while True:
        if want is not None and len(finals(parse_answers(data, False))) >= want:
            return Reply(data, False, answered)
        left = start + limit_s - loop.time()
        if left <= 0:
            return Reply(data, False, answered)
        try:
            chunk = await asyncio.wait_for(loop.sock_recv(sock, 256 * 1024), min(quiet_s, left))
        except TimeoutError:
            return Reply(data, False, answered)
        except ConnectionResetError:
            return Reply(data, True, answered)
        if not chunk:
            return Reply(data, True, answered)
        data += chunk
        if answered is None and finals(parse_answers(data, False)):
            answered = loop.time() - start


async def read_head(sock: socket.socket) -> bytes:
    """Bytes up to the first empty line (an interim answer's head is all of it)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await asyncio.get_running_loop().sock_recv(sock, 1)
        if not chunk:
            break
        data += chunk
    return data


async def exchange(front: Front, raw: bytes, **read: Any) -> Reply:
    """``raw`` on a new connection, and what comes back (:func:`receive`)."""
    async with dial(front) as sock:
        await send(sock, raw)
        return await receive(sock, **read)


async def served_normally(front: Front) -> None:
    """A plain request on a new connection is answered 200 at once: the router still serves others."""
    reply = await exchange(front, generate_request(), want=1, limit_s=AT_ONCE_S)
    assert [a.status for a in reply.finals] == [200], reply.show()


async def nothing_held(front: Front) -> None:
    """The lean server holds no body and no connection (they go back as the callers' connections close)."""
    if front.lean is not None:
        lean = front.lean
        await until(lambda: lean.budget.held == 0, 5, "the body budget to be given back")
        assert gauge(front.metrics.body_bytes_held) == 0
        await until(lambda: not lean.connections, 5, "every caller's connection to be closed")


async def recovered(front: Front) -> None:
    """The workers back to answering at once; then the router serves others and holds nothing."""
    front.set_mode("ok")
    await served_normally(front)
    await nothing_held(front)


# -- refused at the head -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadCase:
    name: str
    raw: bytes
    status: int
    by_parser: bool = False
    """aiohttp's own parser refuses it, with its plain-text 400: only the status is its to match."""
    names: str | None = None
    """The header the lean server's 400 names."""


def _declared(length: int, *extra: str, key: str | None = API_KEY) -> bytes:
    return raw_request(JSON, *extra, f"Content-Length: {length}", key=key)


HEAD_CASES = [
    HeadCase("two Authorization", _declared(14, f"Authorization: Bearer {API_KEY}"), 400, names="authorization"),
    HeadCase(
        "a wrong key, then the right one",
        _declared(14, f"Authorization: Bearer {API_KEY}", key="wrong"),
        400,
        names="authorization",
    ),
    HeadCase("two Host", _declared(14, "Host: other"), 400, by_parser=True, names="host"),
    HeadCase("two Content-Type", _declared(14, JSON), 400, by_parser=True, names="content-type"),
    HeadCase(
        "two User-Agent", _declared(14, "User-Agent: a", "User-Agent: b"), 400, by_parser=True, names="user-agent"
    ),
    HeadCase(
        "two Content-Type and no key (the repeat is judged first)",
        _declared(14, JSON, key=None),
        400,
        by_parser=True,
        names="content-type",
    ),
    HeadCase("no key, 50 MB declared and one byte sent", _declared(50_000_000, key=None) + b"{", 401),
    HeadCase("a wrong key, 50 MB declared and one byte sent", _declared(50_000_000, key="wrong") + b"{", 401),
    HeadCase("no key and 10 GB declared (the key is judged first)", _declared(10_000_000_000, key=None), 401),
    HeadCase("10 GB declared", _declared(10_000_000_000), 413),
    HeadCase("one byte over the bound declared", _declared(MAX_BODY_BYTES + 1), 413),
]


def head_problems(front: Front, case: HeadCase, reply: Reply) -> list[str]:
    answers = reply.finals
    if not answers:
        return [f"no answer: got {reply.show()}"]
    answer, problems = answers[0], []
    if answer.status != case.status:
        problems.append(f"status {answer.status}, not {case.status}")
    if len(answers) > 1:
        problems.append(f"{len(answers)} answers to one request")
    if reply.answered_s is None or reply.answered_s > AT_ONCE_S:
        problems.append(f"answered after {reply.answered_s}s, not at once")
    if not reply.closed:
        problems.append("the connection was left open")
    if front.kind == "aiohttp" and case.by_parser:
        return problems
    if answer.headers.get("connection", "").lower() != "close":
        problems.append(f"Connection: {answer.headers.get('connection')!r}, not close")
    try:
        message = json.loads(answer.body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return [*problems, f"not a JSON error body: {answer.body[:200]!r}"]
    if case.status == 401 and answer.headers.get("www-authenticate") != "Bearer":
        problems.append(f"WWW-Authenticate: {answer.headers.get('www-authenticate')!r}")
    if front.kind == "lean" and case.names is not None and case.names not in message.lower():
        problems.append(f"the message does not name {case.names}: {message!r}")
    return problems


async def test_a_request_refused_at_its_head_is_answered_at_once_and_its_connection_closed(front: Front) -> None:
    """The caller sends only the head (or one body byte of 50 MB declared); the answer must
    not wait for the body, must say ``Connection: close`` and the connection must close after it."""
    problems = []
    for case in HEAD_CASES:
        reply = await exchange(front, case.raw, limit_s=AT_ONCE_S + 1)
        problems += [f"{case.name}: {p}  <- sent {case.raw[:300]!r}" for p in head_problems(front, case, reply)]
    assert front.served() == 0
    assert not problems, "\n".join(problems)
    await recovered(front)


async def test_an_answer_sent_before_the_body_was_read_says_the_connection_closes(front: Front) -> None:
    """A handler that refuses before it reads the body (a fleet-wide route given ``?workers=``) answers while the
    body is still on its way; the server then closes the connection (it never reads the rest), so the answer
    must say ``Connection: close``, or a keep-alive client sends its next request down a closing socket."""
    head = (
        b"POST /load_lora_adapter?workers=a HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n"
    )
    reply = await exchange(front, head + b'{"lora_name": ', limit_s=AT_ONCE_S + 1)
    answers = reply.finals
    assert [a.status for a in answers] == [400], reply.show()
    assert answers[0].headers.get("connection", "").lower() == "close", answers[0].headers
    assert reply.closed
    await recovered(front)


async def test_a_repeated_header_that_may_come_twice_is_read_as_its_first_value(front: Front) -> None:
    """``Accept`` and ``X-Request-Id`` (forwarded to the worker) given twice are not refused;
    the worker gets the first of each, as aiohttp's ``headers.get`` reads them."""
    raw = generate_request(
        extra="Accept: application/json\r\nAccept: text/plain\r\nX-Request-Id: first\r\nX-Request-Id: second\r\n"
    )
    reply = await exchange(front, raw, want=1)
    assert [a.status for a in reply.finals] == [200], reply.show()
    (seen,) = [h for w in front.workers for h in w.seen]
    assert seen.getall("Accept") == ["application/json"] and seen.getall("X-Request-Id") == ["first"]


# -- smuggling shapes --------------------------------------------------------------------------------------------------


def _smuggling_cases() -> list[tuple[str, bytes]]:
    n = len(BODY)
    ended = b"0\r\n\r\n" + SMUGGLED  # an empty chunked body, then a request: or a body of its length
    long_line = "POST /generate?pad=" + "a" * (MAX_HEAD_BYTES + 1) + " HTTP/1.1"
    padding = [f"X-Pad-{i}: {'a' * 60}" for i in range(MAX_HEAD_BYTES // 60 + 100)]
    return [
        (
            "Content-Length, then Transfer-Encoding",
            raw_request(JSON, f"Content-Length: {len(ended)}", "Transfer-Encoding: chunked", body=ended),
        ),
        (
            "Transfer-Encoding, then Content-Length",
            raw_request(JSON, "Transfer-Encoding: chunked", f"Content-Length: {len(ended)}", body=ended),
        ),
        ("two equal Content-Lengths", raw_request(JSON, f"Content-Length: {n}", f"Content-Length: {n}", body=BODY)),
        (
            "two different Content-Lengths",
            raw_request(JSON, "Content-Length: 0", f"Content-Length: {len(SMUGGLED)}", body=SMUGGLED),
        ),
        ("a list length", raw_request(JSON, f"Content-Length: {n}, {n}", body=BODY)),
        ("a length signed +", raw_request(JSON, f"Content-Length: +{n}", body=BODY)),
        ("a length signed -", raw_request(JSON, f"Content-Length: -{n}", body=BODY + SMUGGLED)),
        ("an unknown coding", raw_request(JSON, "Transfer-Encoding: gzip", body=SMUGGLED)),
        ("chunked not the final coding", raw_request(JSON, "Transfer-Encoding: chunked, gzip", body=chunked(BODY))),
        (
            "chunked twice",
            raw_request(JSON, "Transfer-Encoding: chunked", "Transfer-Encoding: chunked", body=chunked(BODY)),
        ),
        (
            "a chunk size that is not hex",
            raw_request(JSON, "Transfer-Encoding: chunked", body=b"zz\r\n" + BODY + b"\r\n0\r\n\r\n"),
        ),
        (
            "a chunk size that overflows",
            raw_request(JSON, "Transfer-Encoding: chunked", body=b"ffffffffffffffffff\r\n" + BODY + b"\r\n0\r\n\r\n"),
        ),
        ("an obs-fold line", raw_request(JSON, "X-Note: a", " folded", f"Content-Length: {n}", body=BODY)),
        (
            "a length folded onto another line",
            raw_request(JSON, "Content-Length: 0", f"\t{len(SMUGGLED)}", body=SMUGGLED),
        ),
        ("NUL in a value", raw_request(JSON, "X-Note: a\x00b", f"Content-Length: {n}", body=BODY)),
        ("a bare CR in a value", raw_request(JSON, "X-Note: a\rb", f"Content-Length: {n}", body=BODY)),
        ("bare LF line ends", raw_request(JSON, f"Content-Length: {n}", body=BODY).replace(b"\r\n", b"\n")),
        ("a space before a colon", raw_request(JSON, "X-Note : bar", f"Content-Length: {n}", body=BODY)),
        ("a space before a length's colon", raw_request(JSON, f"Content-Length : {len(SMUGGLED)}", body=SMUGGLED)),
        ("a request line over 64 KiB", raw_request(JSON, f"Content-Length: {n}", body=BODY, line=long_line)),
        ("a head over 64 KiB", raw_request(JSON, *padding, f"Content-Length: {n}", body=BODY)),
    ]


SMUGGLING = _smuggling_cases()
OVERSIZED = {"a request line over 64 KiB", "a head over 64 KiB"}


async def test_smuggling_shapes_are_refused_and_never_served(front: Front) -> None:
    """Each shape is one 4xx (431 for the lean server's oversized heads), the connection closes,
    and no worker receives a request: neither the request itself nor one hidden in its body."""
    problems = []
    for name, raw in SMUGGLING:
        before = front.served()
        reply = await exchange(front, raw, limit_s=3.0)
        statuses = [a.status for a in reply.finals]
        want = 431 if front.kind == "lean" and name in OVERSIZED else None
        wrong = []
        if len(statuses) != 1 or not 400 <= statuses[0] < 500 or (want is not None and statuses[0] != want):
            wrong.append(f"statuses {statuses}, not one {want or '4xx'}")
        if front.served() != before:
            wrong.append(f"served: a worker got {[b for w in front.workers for b in w.bodies][before:]}")
        if not reply.closed:
            wrong.append("the connection was left open")
        if front.kind == "lean" and reply.finals:
            try:
                json.loads(reply.finals[0].body)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                wrong.append("not a JSON error body")
        problems += [f"{name}: {w}\n  sent {raw[:300]!r}\n  got {reply.show()}" for w in wrong]
    assert not problems, "\n".join(problems)
    await recovered(front)


# -- HTTP/1.0 ----------------------------------------------------------------------------------------------------------


async def test_a_stream_to_an_http_1_0_caller_is_close_delimited_never_chunked(front: Front) -> None:
    """HTTP/1.0 knows no chunked coding (RFC 9112 section 6.1): a stream's body is its events as they come,
    ended by the connection's close, with no ``Content-Length``."""
    front.set_mode("stream")
    reply = await exchange(front, http_1_0(generate_request(b'{"text": "hi", "stream": true}')), limit_s=5.0)
    assert reply.closed, reply.show()
    (answer,) = reply.finals
    assert answer.status == 200 and "transfer-encoding" not in answer.headers, answer.headers
    assert "content-length" not in answer.headers, answer.headers
    # The events as the worker sent them, with no chunk sizes between them.
    assert answer.body.startswith(b"data: ") and answer.body.endswith(b"data: [DONE]\n\n"), answer.body
    assert answer.body.count(b"data: ") == 4 and b"\r\n" not in answer.body, answer.body


async def test_a_whole_answer_to_http_1_0_says_its_length_and_keeps_the_connection_only_when_asked(
    front: Front,
) -> None:
    """HTTP/1.0 closes after each answer unless the caller asked otherwise (and the answer says it agreed)."""
    kept = http_1_0(generate_request(extra="Connection: keep-alive\r\n"))
    async with dial(front) as sock:
        for _ in range(2):  # the second request on the kept connection is answered too
            await send(sock, kept)
            reply = await receive(sock, want=1)
            (answer,) = reply.finals
            assert answer.status == 200 and answer.body == REPLY, reply.show()
            assert answer.headers["content-length"] == str(len(REPLY))
            assert answer.headers.get("connection", "").lower() == "keep-alive", answer.headers
    reply = await exchange(front, http_1_0(generate_request()), limit_s=5.0)
    (answer,) = reply.finals
    assert answer.status == 200 and answer.headers["content-length"] == str(len(REPLY)), reply.show()
    assert reply.closed, "an HTTP/1.0 caller that did not ask to keep its connection: it closes"


# -- pipelining --------------------------------------------------------------------------------------------------------


def _rid_request(rid: str) -> bytes:
    return generate_request(json.dumps({"text": "hi", "rid": rid}).encode())


async def test_pipelined_requests_are_answered_in_order_one_answer_per_complete_request(front: Front) -> None:
    """Four whole requests and the first part of a fifth in one write: four answers, in order (each echoes its
    request's rid; round robin alternates the workers), none to the fifth until its last bytes come."""
    front.set_mode("echo")
    rids = [f"p{i}" for i in range(5)]
    last = _rid_request(rids[-1])
    async with dial(front) as sock:
        # Four whole requests and the first half of a fifth, in one write.
        await send(sock, b"".join(_rid_request(r) for r in rids[:-1]) + last[: len(last) - 5])
        reply = await receive(sock, want=4)
        assert [a.status for a in reply.finals] == [200] * 4, reply.show()
        assert [json.loads(a.body)["text"] for a in reply.finals] == rids[:-1]
        workers = [a.headers["x-omni-worker"] for a in reply.finals]
        assert workers[0::2] == [workers[0]] * 2 and workers[1::2] == [workers[1]] * 2 and workers[0] != workers[1]
        extra = await receive(sock, quiet_s=0.5)
        assert extra.data == b"" and not extra.closed, f"an answer to a request not yet whole: {extra.show()}"
        await send(sock, last[len(last) - 5 :])
        reply = await receive(sock, want=1)
        assert [json.loads(a.body)["text"] for a in reply.finals] == rids[-1:], reply.show()
    assert front.served() == 5


# -- Expect: 100-continue ----------------------------------------------------------------------------------------------


async def test_expect_continue_is_answered_only_for_a_caller_with_the_key(front: Front) -> None:
    """A caller with the key is told to send its body; one without is refused at once, with no ``100`` first
    (it would invite the body the refusal is there not to read)."""
    head = generate_request(extra="Expect: 100-continue\r\n")[: -len(BODY)]
    async with dial(front) as sock:
        await send(sock, head)
        interim = await asyncio.wait_for(read_head(sock), AT_ONCE_S)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n", interim
        await send(sock, BODY)
        reply = await receive(sock, want=1)
        assert [a.status for a in reply.finals] == [200], reply.show()
    raw = generate_request(key=None, extra="Expect: 100-continue\r\n")[: -len(BODY)]
    reply = await exchange(front, raw, limit_s=AT_ONCE_S + 1)
    assert [a.status for a in reply.answers] == [401], f"sent {raw!r}, got {reply.show()}"
    assert reply.answered_s is not None and reply.answered_s <= AT_ONCE_S and reply.closed, reply.show()
    assert reply.finals[0].headers["www-authenticate"] == "Bearer"


# -- callers that vanish, slowloris ------------------------------------------------------------------------------------


async def test_callers_that_vanish_leave_nothing_held_and_others_are_served(front: Front) -> None:
    """Half a body, half a head, a whole request whose answer is not waited for: each caller goes away; the
    router goes on serving, holds nothing of theirs, and aborts the request that had reached a worker."""
    # Half a body, then gone: the half the lean server held goes back with the connection.
    async with dial(front) as sock:
        await send(sock, _declared(1000) + b"x" * 500)
        if front.lean is not None:
            lean = front.lean
            await until(lambda: lean.budget.held == 500, 5, "the half body to be held")
            assert gauge(front.metrics.body_bytes_held) == 500
    await recovered(front)
    # Half a head, then gone.
    async with dial(front) as sock:
        await send(sock, _declared(14)[:30])
    # A whole request, gone before its answer: it is aborted on its worker.
    front.set_mode("hold")
    async with dial(front) as sock:
        await send(sock, _rid_request("vanished-1"))
        await until(lambda: any(w.arrived.is_set() for w in front.workers), 5, "the request to reach a worker")
    await until(lambda: any("vanished-1" in w.aborts for w in front.workers), 5, "the request to be aborted")
    for worker in front.workers:
        worker.release.set()
    await recovered(front)


async def test_slowloris_heads_do_not_delay_other_callers(front: Front) -> None:
    """50 connections each trickle a head a byte every 50 ms for 2 s; meanwhile plain requests on other
    connections are answered at once."""
    head = _declared(14)
    loop = asyncio.get_running_loop()

    async def trickle(sock: socket.socket) -> None:
        for i in range(40):  # 40 of the head's bytes: never the whole head
            try:
                await loop.sock_sendall(sock, head[i : i + 1])
            except (ConnectionResetError, BrokenPipeError):
                return  # a server may close a head that comes this slowly
            await asyncio.sleep(0.05)

    async with contextlib.AsyncExitStack() as stack:
        socks = [await stack.enter_async_context(dial(front)) for _ in range(50)]
        slow = asyncio.gather(*(trickle(s) for s in socks))
        try:
            answered = 0
            while not slow.done():
                await served_normally(front)
                answered += 1
                await asyncio.sleep(0.1)
            await asyncio.wait_for(slow, 5)
        finally:
            slow.cancel()
        assert answered >= 5, f"only {answered} requests answered beside the slow heads"
    await recovered(front)


# -- the pipelining flood ----------------------------------------------------------------------------------------------


async def push(sock: socket.socket, data: bytes, stall_s: float = 1.0, limit_s: float = 15.0) -> int:
    """Offer ``data`` until the kernel takes no byte for ``stall_s``; the bytes it took."""
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    sent = 0
    start = last = loop.time()
    while sent < len(data) and loop.time() - start < limit_s:
        try:
            n = sock.send(view[sent : sent + 256 * 1024])
        except BlockingIOError:
            if loop.time() - last > stall_s:
                break
            await asyncio.sleep(0.02)
            continue
        sent += n
        last = loop.time()
    return sent


async def test_a_pipelining_flood_is_not_read_while_the_first_request_is_served(front: Front) -> None:
    """A first request the worker holds, then 30 requests of 1 MB pipelined behind it by a caller
    that never reads. The server must stop reading: the kernel takes far less than is offered, and the
    lean server holds the first body, 64 KiB of the next and one socket read at most."""
    front.set_mode("hold")
    first = json.dumps({"text": "hi", "rid": "flood-first"}).encode()
    big = generate_request(json.dumps({"text": "x" * MIB}).encode())
    # A small send buffer: what the kernel takes is then mostly what the server read.
    async with dial(front, sndbuf=256 * 1024) as sock:
        await send(sock, generate_request(first))
        await until(lambda: any(w.arrived.is_set() for w in front.workers), 5, "the first request to reach a worker")
        taken = await push(sock, big * 30)
        assert taken < 20 * MIB, f"the kernel took {taken} of the {30 * len(big)} bytes offered: the server read on"
        assert front.served() == 1, "a pipelined request was served before the first was answered"
        if front.lean is not None:
            held = front.lean.budget.held
            assert held <= len(first) + MIB, f"the lean server holds {held} bytes"
        for worker in front.workers:
            worker.release.set()
    await recovered(front)


# -- the stall bound ---------------------------------------------------------------------------------------------------


async def test_a_stream_whose_caller_stops_reading_is_cut_and_aborted_on_its_worker(front: Front) -> None:
    """A worker that streams 64 KiB events without end, a caller that reads none of them: within the stall
    bound of its buffers filling, the stream is cut, counted, and its request aborted on the worker."""
    front.set_mode("endless")
    stalls = gauge(front.metrics.stream_stalls)
    async with dial(front, rcvbuf=64 * 1024) as sock:
        await send(sock, generate_request(b'{"text": "hi", "stream": true, "rid": "stalled-1"}'))
        # Nothing is read: the router's buffers fill, and STALL_S later the stream is cut.
        await until(lambda: any("stalled-1" in w.aborts for w in front.workers), 8, "the stalled stream to be aborted")
    assert gauge(front.metrics.stream_stalls) == stalls + 1
    await recovered(front)


# -- the body budget (lean) --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("front", ["lean"], indirect=True)
async def test_the_body_budget_refuses_at_the_head_and_as_a_chunked_body_grows(front: Front) -> None:
    """The per-process share has a floor of two bodies of the bound, so the budget is shrunk in place."""
    lean = lean_only(front)
    capacity, lean.budget.capacity = lean.budget.capacity, 1_000_000
    try:
        raw = _declared(2_000_000)
        reply = await exchange(front, raw, limit_s=AT_ONCE_S + 1)
        problems = head_problems(front, HeadCase("2 MB declared", raw, 503), reply)
        assert not problems, f"{problems}: got {reply.show()}"
        assert reply.finals[0].headers["retry-after"] == "1"
        # A chunked body declares nothing: it is refused as it passes the budget.
        async with dial(front) as sock:
            await send(sock, raw_request(JSON, "Transfer-Encoding: chunked"))
            piece = b"%x\r\n%b\r\n" % (128 * 1024, b"a" * 128 * 1024)
            for _ in range(16):
                if not await send(sock, piece):
                    break
            reply = await receive(sock, limit_s=3.0)
        (answer,) = reply.finals
        assert answer.status == 503 and answer.headers["retry-after"] == "1", reply.show()
        assert answer.headers["connection"] == "close" and reply.closed, reply.show()
        assert front.served() == 0
        await nothing_held(front)
    finally:
        lean.budget.capacity = capacity
    await served_normally(front)


# -- the fuzz (lean) ---------------------------------------------------------------------------------------------------

#: Fuzzed connections: each reads until the server closes it, or this long without a byte (unless the answers
#: owed are known: then until they have come, :data:`FUZZ_LIMIT_S` at most).
FUZZ_QUIET_S = 0.3
FUZZ_LIMIT_S = 3.0
FUZZ_EXAMPLES = 100

#: Headers a request may carry without changing whether it is served.
_HARMLESS = st.one_of(
    st.sampled_from(["Accept: */*", "X-Request-Id: fuzz", "Connection: keep-alive", "Expect: 100-continue"]),
    st.builds(
        "{}: {}".format,
        st.from_regex(r"X-[A-Za-z0-9-]{1,12}", fullmatch=True),
        st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=30),
    ),
)
_ANY_HEADER = st.one_of(
    _HARMLESS,
    st.sampled_from(
        [
            f"Authorization: Bearer {API_KEY}",
            "Authorization: Bearer wrong",
            JSON,
            "Connection: close",
            "Transfer-Encoding: chunked",
            "Content-Length: 3",
            "Host: another",
        ]
    ),
    st.builds(
        "{}: {}".format, st.text(st.characters(min_codepoint=1, max_codepoint=255), max_size=12), st.text(max_size=12)
    ),
)
_BODIES = st.one_of(
    st.just(BODY),
    st.binary(max_size=200),
    st.builds(lambda text: json.dumps({"text": text}).encode(), st.text(max_size=50)),
)


@dataclass(frozen=True)
class Fuzzed:
    raw: bytes
    closes: bool | None
    """A valid generation request with the key: whether its connection closes after its answer; ``None``:
    any other request, valid or not, served or not."""


def _framed(line: str, headers: list[str], body: bytes, framing: str) -> bytes:
    if framing == "length":
        headers = [*headers, f"Content-Length: {len(body)}"]
    elif framing == "chunked":
        headers = [*headers, "Transfer-Encoding: chunked"]
        body = chunked(body) if body else b"0\r\n\r\n"
    elif framing in ("short", "long"):
        headers = [*headers, f"Content-Length: {max(0, len(body) + (-3 if framing == 'short' else 3))}"]
    return ("\r\n".join([line, *headers]) + "\r\n\r\n").encode("latin-1", "replace") + body


@st.composite
def _valid_request(draw: st.DrawFn) -> Fuzzed:
    """A generation request the router serves: 200 from a worker in mode ``ok``, whatever its body."""
    version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.1", "HTTP/1.0"]))
    path = draw(st.sampled_from(["/generate", "/generate?x=1"]))
    headers = ["Host: router", f"Authorization: Bearer {API_KEY}", JSON, *draw(st.lists(_HARMLESS, max_size=3))]
    # HTTP/1.0 knows no chunked coding (a request with it is refused, RFC 9112 section 6.1).
    framing = "length" if version == "HTTP/1.0" else draw(st.sampled_from(["length", "length", "chunked"]))
    raw = _framed(f"POST {path} {version}", headers, draw(_BODIES), framing)
    kept = "Connection: keep-alive" in headers if version == "HTTP/1.0" else True
    return Fuzzed(raw, not kept)


@st.composite
def _any_request(draw: st.DrawFn) -> Fuzzed:
    method = draw(st.sampled_from(["POST", "POST", "GET", "PUT", "DELETE", "POTS"]))
    path = draw(st.sampled_from(["/generate", "/generate?x=1", "/health", "/nope", "/generate/../x", "*"]))
    version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/1.1 x", "HTTP/1.10"]))
    headers = ["Host: router", *draw(st.lists(_ANY_HEADER, max_size=5))]
    framing = draw(st.sampled_from(["length", "chunked", "none", "short", "long"]))
    return Fuzzed(_framed(f"{method} {path} {version}", headers, draw(_BODIES), framing), None)


_MUTATIONS: st.SearchStrategy[list[tuple[str, int, bytes]]] = st.one_of(
    st.just([]),
    st.lists(
        st.tuples(
            st.sampled_from(["insert", "truncate", "repeat line"]),
            st.integers(0, 10**6),
            st.sampled_from([b"\r", b"\n", b"\x00", b" ", b"\t", b"\r\n", b":", b"\r\n\r\n", b"\xff"]),
        ),
        min_size=1,
        max_size=3,
    ),
)


def _mutate(raw: bytes, mutations: list[tuple[str, int, bytes]]) -> bytes:
    for kind, at, byte in mutations:
        at %= len(raw) + 1
        if kind == "insert":
            raw = raw[:at] + byte + raw[at:]
        elif kind == "truncate":
            raw = raw[:at]
        else:  # the line around ``at``, given twice
            start = raw.rfind(b"\r\n", 0, at) + 2
            end = raw.find(b"\r\n", at)
            if start >= 2 and end > start:
                raw = raw[:end] + b"\r\n" + raw[start:end] + raw[end:]
    return raw


def _most_answers(raw: bytes) -> int:
    """No request is complete before its head's empty line (however its lines end); one refusal may follow."""
    return raw.count(b"\n\n") + raw.count(b"\n\r\n") + 1


def _owed(requests: list[Fuzzed]) -> int | None:
    """The answers owed to valid requests sent as they are: up to the first whose connection closes after it."""
    if any(r.closes is None for r in requests):
        return None
    closing = [i for i, r in enumerate(requests) if r.closes]
    return closing[0] + 1 if closing else len(requests)


def _fuzz_one(host: str, port: int, raw: bytes, owed: int | None) -> tuple[bytes, bool]:
    """``raw`` on a new blocking connection (this runs in a thread); what came back, and whether it closed."""
    with socket.create_connection((host, port), timeout=5) as sock:
        try:
            sock.sendall(raw)
        except (ConnectionResetError, BrokenPipeError):
            pass
        data = b""
        deadline = time.monotonic() + FUZZ_LIMIT_S
        sock.settimeout(FUZZ_QUIET_S if owed is None else FUZZ_LIMIT_S)
        while time.monotonic() < deadline:
            if owed is not None and len(finals(parse_answers(data, False))) >= owed:
                return data, False
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                return data, False
            except ConnectionResetError:
                return data, True
            if not chunk:
                return data, True
            data += chunk
        return data, False


def _fuzz_problems(raw: bytes, data: bytes, closed: bool, owed: int | None) -> Iterator[str]:
    try:
        answers = parse_answers(data, closed)
    except (AssertionError, ValueError, IndexError) as exc:
        yield f"answer not HTTP ({exc!r}): {data[:300]!r}"
        return
    for answer in answers:
        if answer.status >= 500 and not (answer.status == 503 and "retry-after" in answer.headers):
            yield f"{answer.status}: {answer.body[:200]!r}"
    statuses = [a.status for a in finals(answers)]
    if len(statuses) > _most_answers(raw):
        yield f"{len(statuses)} answers, more than the {_most_answers(raw)} possible"
    if owed is not None and statuses != [200] * owed:
        yield f"answers {statuses} to {owed} valid requests; got {data[:300]!r}"


@pytest.mark.parametrize("front", ["lean"], indirect=True)
async def test_fuzzed_request_bytes_are_never_a_5xx_never_overanswered_and_leave_nothing_held(front: Front) -> None:
    """Hypothesis draws one to four requests, valid ones and any others (methods, paths, versions, headers,
    framings, bodies), then may mutate the bytes (inserted CR, LF, NUL, spaces; truncations; repeated lines).
    Each draw goes on a fresh connection: no 5xx but the budget's 503, never more final answers than heads
    sent (plus one refusal), and valid requests sent as they are each answered 200, in one answer each. Every
    problem is collected, so one run reports them all. Hypothesis draws in a thread, with blocking sockets,
    while the router serves on this loop."""
    lean = lean_only(front)
    problems: list[str] = []

    @generate_only(FUZZ_EXAMPLES)
    @hypothesis.given(
        requests=st.lists(st.one_of(_valid_request(), _any_request()), min_size=1, max_size=4), mutations=_MUTATIONS
    )
    def drive(requests: list[Fuzzed], mutations: list[tuple[str, int, bytes]]) -> None:
        raw = _mutate(b"".join(r.raw for r in requests), mutations)
        owed = None if mutations else _owed(requests)
        data, closed = _fuzz_one(front.host, front.port, raw, owed)
        problems.extend(f"{p}\n  sent {raw[:400]!r}" for p in _fuzz_problems(raw, data, closed, owed))

    await asyncio.wait_for(asyncio.to_thread(drive), 90)
    assert not problems, "\n".join(problems)
    await recovered(front)
    assert lean.budget.held == 0
