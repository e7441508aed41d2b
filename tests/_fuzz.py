"""Fuzzing a live server from its own ``GET /openapi.json`` (schemathesis + hypothesis).

Every operation the server describes is exercised with cases schemathesis generates from
its pydantic wire models: valid ones (positive) and ones that break the schema (negative),
plus structural garbage the schema cannot describe (deep nesting, huge fields, bodies
that are not JSON objects). A new route is fuzzed as soon as it is in a route table.

Loopback only: before a case is sent, every field that names an address to connect to
(``master_address``, worker ``url``, a peer's ``source_url``) is rewritten to a 127.0.0.0/8 address, and every
wait the caller controls (``timeout_s``, ``timeout``, ``max_new_tokens``, ``max_tokens``, ``n``,
batch sizes) is capped, so no case connects outside this machine and none runs long.
"""

from __future__ import annotations

import json
import random
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import hypothesis
import hypothesis.errors
import schemathesis
import urllib3
from schemathesis import GenerationMode

from tests._hypothesis import generate_only
from tests._router_fixtures import auth
from tests.procs import http_json

#: One case slower than this is a hang.
HANG_S = 30.0
#: Bounds put on the fields that make a server wait or work. A group join finds no rank 0 at a
#: generated address and waits out its whole ``timeout_s`` (polling the address meanwhile): half a
#: second takes it through the same polling and the same failure as any longer wait would.
CAPS = {"timeout_s": 0.5, "timeout": 1.0, "max_new_tokens": 8, "max_tokens": 8, "max_completion_tokens": 8, "n": 2}
MAX_BATCH = 4
#: Operations that wait for a peer: a body without ``timeout_s`` (or with null) gets this bound.
WAITING_PATHS = frozenset(
    {
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/prepare_weights_update",
        "/complete_weights_update",
        "/start_weight_update",
        "/update_weights_from_peer",
    }
)
#: vLLM's routes carry their wait inside a nested object.
NESTED_WAITS = {"/init_weight_transfer_engine": "init_info", "/update_weights": "update_info"}


def loopback_url(rng: random.Random) -> str:
    return f"http://127.0.0.{rng.randint(2, 250)}:{rng.randint(1, 65535)}"


def make_safe(value: Any, rng: random.Random, *, path: str = "") -> Any:
    """``value`` with every address rewritten into 127.0.0.0/8 and every wait capped (in place for dicts)."""
    if isinstance(value, list):
        return [make_safe(v, rng) for v in value[: MAX_BATCH * 4]]
    if not isinstance(value, dict):
        return value
    for key in list(value):
        item = value[key]
        if key == "master_address" and isinstance(item, str):
            value[key] = f"127.0.0.{rng.randint(1, 250)}"
        elif key in ("url", "source_url") and isinstance(item, str):
            value[key] = loopback_url(rng)
        elif key in CAPS and isinstance(item, (int, float)) and not isinstance(item, bool) and item > CAPS[key]:
            value[key] = type(item)(CAPS[key])
        elif key in ("text", "input_ids", "prompt", "messages") and isinstance(item, list):
            value[key] = item[:MAX_BATCH]
        else:
            value[key] = make_safe(item, rng)
    if path in WAITING_PATHS and value.get("timeout_s") is None:
        # Absent or null both mean the server's default wait (minutes for a group join): cap it.
        value["timeout_s"] = CAPS["timeout_s"]
    nested = NESTED_WAITS.get(path)
    if nested is not None and isinstance(value.get(nested), dict) and value[nested].get("timeout_s") is None:
        value[nested]["timeout_s"] = CAPS["timeout_s"]
    if path == "/generate" and isinstance(value.get("sampling_params"), (dict, list)):
        params = value["sampling_params"]
        for sp in params if isinstance(params, list) else [params]:
            if isinstance(sp, dict) and not isinstance(sp.get("max_new_tokens"), int):
                sp.setdefault("max_new_tokens", CAPS["max_new_tokens"])
    elif path == "/generate" and "sampling_params" not in value:
        value["sampling_params"] = {"max_new_tokens": CAPS["max_new_tokens"]}
    # vLLM's token route: no ``max_tokens`` in its sampling params is "whatever the context leaves" too.
    params = value.get("sampling_params")
    if path == "/inference/v1/generate" and isinstance(params, dict) and not isinstance(params.get("max_tokens"), int):
        params["max_tokens"] = CAPS["max_tokens"]
    # OpenAI's routes: no bound (absent or null) means "whatever the context leaves", a thousand tokens here.
    bounded = isinstance(value.get("max_completion_tokens"), int) or isinstance(value.get("max_tokens"), int)
    if path.startswith("/v1/") and not bounded:
        value["max_tokens"] = CAPS["max_tokens"]
    return value


@dataclass
class Answer:
    status: int
    body: Any
    seconds: float


class Client:
    """Blocking HTTP calls over kept-alive connections (``urllib3``'s pool, one per server).

    A fuzz run makes thousands of calls (cases, state reads, restores); a connection set up per
    call costs the client and the server more than most answers do. The pool checks a kept
    connection before reusing it (one the server has closed is replaced), and nothing is retried:
    a request dropped without an answer is the server's doing, and raises."""

    def __init__(self) -> None:
        self._pool = urllib3.PoolManager(num_pools=4, maxsize=1, retries=False)

    def send(
        self,
        method: str,
        url: str,
        *,
        data: bytes | None,
        headers: dict[str, str],
        timeout: float = HANG_S + 30,
    ) -> Answer:
        start = time.monotonic()
        try:
            resp = self._pool.request(
                method, url, body=data, headers=headers, timeout=urllib3.Timeout(connect=10, read=timeout)
            )
        except urllib3.exceptions.TimeoutError:
            raise TimeoutError(f"{method} {url}: no answer within {timeout:.0f}s") from None
        end = time.monotonic()
        raw, status = resp.data, resp.status
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw[:200].decode(errors="replace")
        return Answer(status, body, end - start)

    def call(
        self, method: str, url: str, body: Any = None, *, headers: dict[str, str], timeout: float = 10
    ) -> tuple[int, Any]:
        """A JSON call (``body`` encoded when given): ``(status, parsed answer)``."""
        data = None if body is None else json.dumps(body).encode()
        answer = self.send(
            method, url, data=data, headers={**headers, "Content-Type": "application/json"}, timeout=timeout
        )
        return answer.status, answer.body

    def close(self) -> None:
        self._pool.clear()


@dataclass
class Tally:
    """What a fuzz run did, for the assertion and the README's figures."""

    cases: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    slowest_s: float = 0.0
    #: Which route each 5xx came from (``"502 POST /init_weights_update_group"``), for the summary.
    server_errors: Counter[str] = field(default_factory=Counter)

    def record(self, label: str, answer: Answer, detail: str, *, allowed_5xx: Callable[[int, Any], bool]) -> None:
        self.cases += 1
        self.statuses[answer.status] += 1
        self.slowest_s = max(self.slowest_s, answer.seconds)
        if answer.status >= 500:
            self.server_errors[f"{answer.status} {label}"] += 1
        where = f"{label}: {answer.status} after {answer.seconds:.1f}s for {detail[:300]}"
        if answer.seconds > HANG_S:
            self.problems.append(f"hang: {where}")
        if answer.status == 500:
            self.problems.append(f"500: {where} -> {str(answer.body)[:300]}")
        elif answer.status > 500 and not allowed_5xx(answer.status, answer.body):
            self.problems.append(f"unexpected {answer.status}: {where} -> {str(answer.body)[:300]}")
        elif 400 <= answer.status < 500 and not _has_error_message(answer.body):
            self.problems.append(f"4xx without error.message: {where} -> {str(answer.body)[:300]}")

    def summary(self) -> str:
        codes = ", ".join(f"{code}: {n}" for code, n in sorted(self.statuses.items()))
        errors = ", ".join(f"{where} x{n}" for where, n in sorted(self.server_errors.items()))
        return f"{self.cases} cases ({codes}); slowest {self.slowest_s:.1f}s; 5xx from: {errors or 'none'}"


def _has_error_message(body: Any) -> bool:
    return (
        isinstance(body, dict) and isinstance(body.get("error"), dict) and isinstance(body["error"].get("message"), str)
    )


def operations(doc: dict[str, Any]) -> list[Any]:
    schema = schemathesis.openapi.from_dict(doc)
    return [result.ok() for result in schema.get_all_operations()]


def run_generated(
    op: Any,
    mode: GenerationMode,
    examples: int,
    execute: Callable[[Any], None],
) -> None:
    """Draw up to ``examples`` cases of ``op`` in ``mode`` and hand each to ``execute``.

    Hypothesis only generates here: the checks are made by ``execute`` and collected, so
    one run reports every problem, not the first one shrunk."""
    strategy = op.as_strategy(generation_mode=mode)

    @generate_only(examples)
    @hypothesis.given(case=strategy)
    def drive(case: Any) -> None:
        execute(case)

    try:
        drive()
    except hypothesis.errors.Unsatisfiable:
        pass  # nothing in this operation can be made invalid (a GET without parameters)


def case_request(case: Any, base_url: str, rng: random.Random) -> tuple[str, str, bytes | None, str]:
    """The (method, url, body bytes, description) of a generated case, made safe."""
    path = case.operation.path
    formatted = case.formatted_path
    query = dict(case.query or {})
    if "url" in query:
        query["url"] = loopback_url(rng)
    url = base_url + formatted
    if query:
        url += "?" + urllib.parse.urlencode({k: v if isinstance(v, str) else json.dumps(v) for k, v in query.items()})
    body = case.body
    data: bytes | None = None
    if case.method.upper() in ("POST", "PUT") and not isinstance(body, schemathesis.core.NotSet):
        if isinstance(body, bytes):  # a negative case that is not JSON at all
            data = body
        else:
            body = make_safe(body, rng, path=path)
            data = json.dumps(body, default=repr).encode()
    elif path == "/generate":
        data = None
    return case.method.upper(), url, data, f"{case.method.upper()} {formatted} {str(body)[:200]}"


def garbage_bodies(doc: dict[str, Any], doc_op: dict[str, Any]) -> list[tuple[str, bytes]]:
    """Bodies no schema describes: not JSON, not an object, nested past any limit, fields of megabytes."""
    cases = [
        ("not JSON", b"{'this': is not json"),
        ("invalid UTF-8", b'{"a": "\xff\xfe"}'),
        ("a JSON array", b"[1, 2, 3]"),
        ("a JSON string", b'"hello"'),
        ("NaN", b'{"x": NaN}'),
        ("nested 100000 deep", b"[" * 100_000 + b"]" * 100_000),
        ("object nested 5000 deep", b'{"a":' * 5000 + b"1" + b"}" * 5000),
        ("unbalanced 200000 brackets", b"{" * 200_000),
    ]
    props = _request_properties(doc, doc_op)
    for name, schema in props.items():
        kind = schema.get("type")
        if kind == "string" or "anyOf" in schema:
            cases.append((f"{name} of 5 MB", json.dumps({name: "x" * (5 * 1024 * 1024)}).encode()))
            break
    for name in props:
        cases.append((f"{name} as a 3000-item list", json.dumps({name: list(range(3000))}).encode()))
        break
    return cases


def _request_properties(doc: dict[str, Any], doc_op: dict[str, Any]) -> dict[str, Any]:
    content = doc_op.get("requestBody", {}).get("content", {}).get("application/json", {})
    schema = content.get("schema", {})
    ref = schema.get("$ref", "")
    if ref.startswith("#/components/schemas/"):
        schema = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    return schema.get("properties", {}) if isinstance(schema, dict) else {}


# -- a fuzz run over every operation of one server (tests/test_fuzz_api.py, tests/test_fuzz_worker_api.py) ----------

#: Cases per operation and generation mode: enough to reach every field, small enough for CI.
EXAMPLES = 10
#: Routes that answer 501 by design (none today: ``/update_weights_from_tensor`` answers 4xx/200).
NOT_IMPLEMENTED: tuple[str, ...] = ()


class FleetChecks(Protocol):
    """What :func:`run_fuzz` reads of a router's fleet (``_Fleet`` in tests/test_fuzz_api.py)."""

    settled: tuple[Any, ...] | None

    def state(self) -> tuple[Any, ...]: ...

    def fence_state(self) -> tuple[Any, ...]: ...


def openapi_doc(url: str) -> dict[str, Any]:
    status, doc = http_json("GET", url + "/openapi.json", timeout=10)  # open: no key
    assert status == 200 and doc["openapi"].startswith("3.1"), doc
    return doc


def allowed_5xx(path: str, *, via_router: bool) -> Callable[[int, Any], bool]:
    def allowed(status: int, body: Any) -> bool:
        if status == 501:
            return path in NOT_IMPLEMENTED
        if not (isinstance(body, dict) and ("error" in body or "results" in body or "message" in body)):
            return False  # a 5xx must say why
        if via_router and status == 502:
            # The router blames a worker only with that worker's answer (or its silence) attached.
            return isinstance(body.get("results"), list)
        return status in (502, 503, 504)

    return allowed


def restore_worker(client: Client, url: str, model: str | None = None) -> None:
    for path in (
        "/finish_weight_update",
        "/destroy_weights_update_group",
        "/resume_memory_occupation",
        "/continue_generation",
    ):
        client.call("POST", url + path, {}, headers=auth(), timeout=30)
    if model is not None and client.call("GET", url + "/health", headers=auth())[1].get("weight_state") == "partial":
        client.call("POST", url + "/update_weights_from_disk", {"model_path": model}, headers=auth(), timeout=60)


def run_fuzz(client: Client, base: str, *, restore: Callable[[], None], fleet: FleetChecks | None) -> Tally:
    """Fuzz every operation of ``base``; ``fleet`` when ``base`` is its router (fences checked)."""
    doc = openapi_doc(base)
    rng = random.Random(0)
    tally = Tally()
    headers = {**auth(), "Content-Type": "application/json"}
    via_router = fleet is not None
    baseline = fleet.fence_state() if fleet is not None else None

    def execute(label: str, method: str, url: str, data: bytes | None, detail: str, path: str) -> None:
        try:
            answer = client.send(method, url, data=data, headers=headers)
        except TimeoutError:
            # A hang: name the case, so a failure says which request never got its answer.
            raise AssertionError(f"no answer within {HANG_S + 30:.0f}s: {label} {detail[:500]}") from None
        tally.record(label, answer, detail, allowed_5xx=allowed_5xx(path, via_router=via_router))
        # A failure, or a call other than a read that succeeded, may have changed anything: restore.
        # Through the router, a refusal or a read is restored too unless the state shows it changed
        # nothing a restore undoes (see _Fleet); a refusal that moved the fence is a problem besides.
        acted = answer.status >= 500 or (answer.status < 400 and method != "GET")
        if fleet is None:
            if acted:
                restore()
            return
        state = fleet.state() if not acted else None
        if state is not None and 400 <= answer.status < 500 and state[0] != baseline:
            tally.problems.append(f"a refusal changed the fleet: {label} {detail[:200]}: {baseline} -> {state[0]}")
        if acted or state != fleet.settled:
            restore()

    ops = operations(doc)
    # The next operation's cases are drawn on a thread while this one's are sent: the same cases in
    # the same order (drawing never depends on the answers), with the drawing's CPU time spent while
    # the server works instead of between its answers.
    with ThreadPoolExecutor(max_workers=1) as drawing:
        drawn = drawing.submit(draw_cases, ops[0]) if ops else None
        for index, op in enumerate(ops):
            assert drawn is not None
            cases = drawn.result()
            drawn = drawing.submit(draw_cases, ops[index + 1]) if index + 1 < len(ops) else None
            path, method = op.path, op.method.upper()
            label = f"{method} {path}"
            doc_op = doc["paths"][path][op.method.lower()]
            for mode, case in cases:
                m, url, data, detail = case_request(case, base, rng)
                execute(f"{label} [{mode.value}]", m, url, data, detail, path)
            if method in ("POST", "PUT") and "{" not in path:
                for what, raw in garbage_bodies(doc, doc_op):
                    execute(f"{label} [garbage]", method, base + path, raw, what, path)
    return tally


def draw_cases(op: Any, examples: int = EXAMPLES) -> list[tuple[GenerationMode, Any]]:
    """``op``'s cases, positive then negative, as :func:`run_generated` draws them."""
    cases: list[tuple[GenerationMode, Any]] = []
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        run_generated(op, mode, examples, lambda case, mode=mode: cases.append((mode, case)))
    return cases
