"""``/generate`` through the router: pick a worker, forward, stream back.

- Only routable workers (healthy, not disabled) are candidates; with none the
  caller gets 503 with the reason at once.
- A failure *before the first response byte* (connection refused or reset,
  or a 502/503/504 from the worker) is retried on another worker with
  exponential backoff and jitter. Once bytes have reached the caller nothing
  is retried.
- The worker picked is checked again right before the request's first byte is
  written (no await in between): one fenced or taken out of routing meanwhile
  gets nothing, and the request goes to another worker. So once a fence is
  in the registry, no new request reaches its targets.
- If the caller goes away, the request is aborted on its worker
  (``POST /abort_request`` with the contract's ``AbortRequest``, waiting as long as that route's
  budget gives the router); a rid is assigned when the caller gave none. vLLM's
  ``/inference/v1/generate`` is aborted by its own id instead (``POST /abort_requests``), and
  gets a ``request_id`` when it has none.
- The worker's body (``meta_info.weight_version`` included) is passed through
  byte for byte.
- Every call to a worker goes through the gateway's one worker client
  (:class:`~router.gateway.upstream.WorkerClient`): streamed answers from its pool bounded by
  ``--max-connections``, aborts as whole answers.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from aiohttp import web
from pydantic import ValidationError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from router.contract import endpoints as ep
from router.contract.endpoints import Endpoint
from router.contract.errors import ApiError, Unavailable
from router.contract.generate import INSTANCE_HEADER
from router.contract.vllm_tokens import REQUEST_ID_HEADER, REQUEST_ID_PREFIX
from router.gateway.config import RouterConfig
from router.gateway.fleet.registry import Worker, WorkerRegistry
from router.gateway.metrics import RouterMetrics
from router.gateway.routing.policy import Policy
from router.gateway.tasks import TaskSet
from router.gateway.upstream import NotAdmitted, UpstreamError, UpstreamResponse, WorkerClient, mime_type

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({502, 503, 504})
WORKER_HEADER = "X-Omni-Worker"


class _Retryable(Exception):
    """An attempt failed before any byte reached the caller."""

    def __init__(
        self,
        worker: Worker,
        reason: str,
        kind: str,
        status: int = 502,
        body: bytes = b"",
        content_type: str | None = None,
    ):
        super().__init__(reason)
        self.kind = kind
        self.worker = worker
        self.reason = reason
        self.status = status
        self.body = body
        self.content_type = content_type


def describe_fleet(registry: WorkerRegistry) -> str:
    workers = list(registry)
    if not workers:
        return "no workers are registered"
    disabled = sum(w.disabled for w in workers)
    counts = {s: sum(w.health == s for w in workers) for s in ("healthy", "unhealthy", "dead")}
    pending = [w for w in workers if registry.pending_reason(w) is not None]
    reason = f" ({pending[0].id}: {registry.pending_reason(pending[0])})" if pending else ""
    return (
        f"no routable worker: {len(workers)} registered, {counts['healthy']} healthy, "
        f"{counts['unhealthy']} unhealthy, {counts['dead']} dead, {disabled} disabled, "
        f"{len(pending)} pending{reason}"
    )


#: Router-assigned rids: a random per-process prefix and a fixed-width counter, so no rid is a prefix of
#: another (workers abort by prefix) and none costs a system call (``uuid4`` reads ``os.urandom``).
_RID_PREFIX = f"omni-{secrets.token_hex(8)}"
_rid_counter = itertools.count()


def _new_rid() -> str:
    return f"{_RID_PREFIX}{next(_rid_counter):012x}"


def prepare_payload(raw: bytes) -> tuple[bytes, Any, bool]:
    """Return (body to send, rid to abort with, stream?). Injects a rid when none was given.

    A body that carries its rid is forwarded as it came. An injected rid is spliced in after the
    opening brace instead of re-encoding the whole body; a body where that is not a plain byte
    splice (``"rid": null`` present, ``{}``, not UTF-8 or a byte-order mark) is re-encoded.
    """
    try:
        payload = json.loads(raw) if raw else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        return raw, None, False  # the worker answers 400 with its own message
    if not isinstance(payload, dict):
        return raw, None, False
    stream = payload.get("stream") is True
    rid = payload.get("rid")
    if rid is not None:
        return raw, rid, stream
    base = _new_rid()
    text = payload.get("text")
    if text is not None:
        batch = len(text) if isinstance(text, list) else None
    else:
        ids = payload.get("input_ids")
        batch = len(ids) if isinstance(ids, list) and ids and isinstance(ids[0], list) else None
    # Abort by prefix: every assigned rid starts with ``base``.
    assigned: str | list[str] = base if batch is None else [f"{base}-{i}" for i in range(batch)]
    start = len(raw) - len(raw.lstrip())
    if payload and "rid" not in payload and raw[start : start + 1] == b"{":
        return raw[: start + 1] + b'"rid": ' + json.dumps(assigned).encode() + b", " + raw[start + 1 :], base, stream
    payload["rid"] = assigned
    return json.dumps(payload).encode(), base, stream


def prepare_tokens_payload(raw: bytes, header_id: str | None) -> tuple[bytes, str | None]:
    """vLLM's ``/inference/v1/generate``: (body to send, the id its worker runs it as). The worker names
    it ``generate-tokens-<X-Request-Id | request_id>``; a body with neither (or an empty one) gets a
    ``request_id`` spliced in (re-encoded where that is not a plain byte splice), so the router can abort it."""
    try:
        payload = json.loads(raw) if raw else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        return raw, None  # the worker answers 400 with its own message
    if not isinstance(payload, dict):
        return raw, None
    if header_id:
        return raw, REQUEST_ID_PREFIX + header_id
    given = payload.get("request_id")
    if isinstance(given, str) and given:
        return raw, REQUEST_ID_PREFIX + given
    if given is not None and given != "":
        return raw, None  # not an id: the worker refuses the body
    base = _new_rid()
    start = len(raw) - len(raw.lstrip())
    if payload and "request_id" not in payload and raw[start : start + 1] == b"{":
        return raw[: start + 1] + b'"request_id": ' + json.dumps(base).encode() + b", " + raw[start + 1 :], (
            REQUEST_ID_PREFIX + base
        )
    payload["request_id"] = base
    return json.dumps(payload).encode(), REQUEST_ID_PREFIX + base


@dataclass(frozen=True, slots=True)
class AbortCall:
    """How to stop a request on its worker once its caller went away: one call of a contract abort route."""

    endpoint: Endpoint[Any, Any]
    fields: dict[str, Any]
    """The abort request's fields: validated as ``endpoint.request`` only when an abort is sent, never
    for the requests that finish (nearly all of them)."""
    label: str


#: How a route's body is made ready to forward: (body, how to abort it, or None when there is nothing to abort).
Prepare = Callable[[bytes, web.Request], tuple[bytes, AbortCall | None]]


def sglang_prepare(raw: bytes, _request: web.Request) -> tuple[bytes, AbortCall | None]:
    """``/generate`` and the OpenAI routes: a ``rid`` (assigned when missing), aborted by prefix."""
    body, rid, _ = prepare_payload(raw)
    return body, None if rid is None else AbortCall(ep.ABORT_REQUEST, {"rid": rid}, f"rid {rid}")


def tokens_prepare(raw: bytes, request: web.Request) -> tuple[bytes, AbortCall | None]:
    """vLLM's ``/inference/v1/generate``: aborted by its id (``/abort_requests``: the call and its choices)."""
    body, request_id = prepare_tokens_payload(raw, request.headers.get(REQUEST_ID_HEADER))
    return body, None if request_id is None else AbortCall(
        ep.ABORT_REQUESTS, {"request_ids": [request_id]}, f"request {request_id}"
    )


def passthrough(raw: bytes, _request: web.Request) -> tuple[bytes, AbortCall | None]:
    """A route whose answer needs no generation (``/tokenize``): forwarded as it came, nothing to abort."""
    return raw, None


class GenerateProxy:
    """Forward generation requests to routable workers."""

    def __init__(
        self,
        *,
        config: RouterConfig,
        registry: WorkerRegistry,
        policy: Policy,
        workers: WorkerClient,
        metrics: RouterMetrics,
        tasks: TaskSet,
        service_headers: dict[str, str],
        on_restarted: Callable[[Worker], None] | None = None,
    ):
        self._cfg = config
        self._on_restarted = on_restarted
        """Told when the instance check finds a worker restarted (a data plane tells its control process)."""
        self._registry = registry
        self._policy = policy
        self._workers = workers
        self._metrics = metrics
        self._tasks = tasks
        self._service_headers = service_headers
        self._worker_auth = service_headers.get("Authorization")  # the router's own worker key
        # The retry policy, built once: these strategies keep no state between calls.
        self._stop = stop_after_attempt(1 + config.max_retries)
        self._wait = wait_exponential_jitter(initial=config.retry_initial_backoff_s, max=config.retry_max_backoff_s)
        self._retry_on = retry_if_exception_type(_Retryable)

    def pick(self, tried: set[str] | frozenset[str] = frozenset()) -> Worker:
        candidates = self._registry.routable()
        if tried:
            candidates = [w for w in candidates if w.id not in tried]
        if not candidates:
            raise Unavailable(describe_fleet(self._registry))
        return self._policy.choose(candidates)

    def _upstream_headers(self, request: web.Request) -> dict[str, str]:
        """What the caller said about its body; its ``Authorization`` is never forwarded."""
        incoming = request.headers
        headers = {"Content-Type": incoming.get("Content-Type") or "application/json"}
        accept = incoming.get("Accept")
        if accept is not None:
            headers["Accept"] = accept
        request_id = incoming.get(REQUEST_ID_HEADER)
        if request_id:
            headers[REQUEST_ID_HEADER] = request_id
        if self._worker_auth is not None:
            headers["Authorization"] = self._worker_auth
        return headers

    async def handle(
        self, request: web.Request, path: str = "/generate", prepare: Prepare = sglang_prepare
    ) -> web.StreamResponse:
        raw = await request.read()
        body, abort = prepare(raw, request)
        headers = self._upstream_headers(request)
        # The first attempt runs bare (no retry machinery): that is nearly every request.
        worker = self.pick()
        try:
            return await self._attempt(request, worker, path, body, headers, abort)
        except _Retryable as exc:
            first = exc
        return await self._retry(request, path, body, headers, abort, first)

    async def _retry(
        self,
        request: web.Request,
        path: str,
        body: bytes,
        headers: dict[str, str],
        abort: AbortCall | None,
        first: _Retryable,
    ) -> web.StreamResponse:
        """The first attempt failed before any byte reached the caller: back off, then other workers."""
        tried = {first.worker.id}
        last = first
        retrying = AsyncRetrying(stop=self._stop, wait=self._wait, retry=self._retry_on, reraise=True)
        try:
            async for attempt in retrying:
                with attempt:
                    if attempt.retry_state.attempt_number == 1:
                        raise first  # the bare attempt's failure is the policy's attempt 1: it backs off from here
                    self._metrics.retries.labels(last.kind).inc()
                    try:
                        worker = self.pick(tried)
                    except Unavailable:
                        break  # every routable worker was tried
                    tried.add(worker.id)
                    try:
                        return await self._attempt(request, worker, path, body, headers, abort)
                    except _Retryable as exc:
                        last = exc
                        raise
        except _Retryable as exc:
            last = exc
        return self._give_up(last)

    def _give_up(self, last: _Retryable) -> web.Response:
        if last.body:
            resp = web.Response(
                status=last.status, body=last.body, content_type=last.content_type or "application/json"
            )
            resp.headers[WORKER_HEADER] = last.worker.id
            return resp
        raise ApiError(502, f"worker {last.worker.id} ({last.worker.url}) failed: {last.reason}")

    async def _attempt(
        self,
        request: web.Request,
        worker: Worker,
        path: str,
        body: bytes,
        headers: dict[str, str],
        abort: AbortCall | None,
    ) -> web.StreamResponse:
        worker.inflight += 1
        upstream: UpstreamResponse | None = None
        try:
            try:
                upstream = await self._workers.stream(
                    "POST",
                    worker.url,
                    path,
                    body,
                    headers,
                    timeout_s=self._cfg.request_timeout_s,
                    admit=partial(self._registry.is_routable, worker),
                )
            except NotAdmitted:
                # Fenced (or gone) between the pick and the first byte: nothing reached it; another worker may.
                raise _Retryable(
                    worker, f"worker {worker.id} left routing before the request was sent", "fenced"
                ) from None
            except (OSError, UpstreamError) as exc:  # TimeoutError and ConnectionError are OSErrors
                self._metrics.upstream_errors.labels(worker.id).inc()
                if self._registry.observe_probe(worker, False):
                    log.warning("worker %s is now %s after a failed request", worker.id, worker.health)
                raise _Retryable(worker, f"{type(exc).__name__}: {exc}", "connect") from None
            status = upstream.status
            if status in RETRY_STATUSES:
                data = await self._read_before_relay(worker, upstream)
                ctype = upstream.header("Content-Type")
                raise _Retryable(
                    worker, f"worker answered {status}", f"status_{status}", status, data, mime_type(ctype)
                )
            restarted = upstream.header(INSTANCE_HEADER)
            if restarted is not None and worker.instance_id is not None and restarted != worker.instance_id:
                # Another process than the last probe saw: it came back with its boot weights. Its answer is
                # dropped, and the worker is pending until a weight update reaches the new process.
                worker.instance_id = restarted
                if self._on_restarted is not None:
                    self._on_restarted(worker)
                await self._read_before_relay(worker, upstream)
                reason = f"worker {worker.id} restarted since its last probe; not serving the fleet's weights"
                raise _Retryable(worker, reason, "restarted", 503, json.dumps({"error": {"message": reason}}).encode())
            return await self._relay(request, worker, upstream, abort)
        except asyncio.CancelledError:
            # The caller disconnected (handler cancelled): stop the work on the worker too.
            self._abort_on_worker(worker, abort)
            raise
        finally:
            worker.inflight -= 1
            if upstream is not None:
                upstream.release()

    async def _read_before_relay(self, worker: Worker, upstream: UpstreamResponse) -> bytes:
        """A whole body before anything went to the caller: a failure here may still be retried."""
        try:
            return await upstream.read()
        except (UpstreamError, TimeoutError) as exc:
            raise _Retryable(worker, f"{type(exc).__name__}: {exc}", "reset") from None

    async def _relay(
        self, request: web.Request, worker: Worker, upstream: UpstreamResponse, abort: AbortCall | None
    ) -> web.StreamResponse:
        ctype = upstream.header("Content-Type") or "application/json"
        if not ctype.startswith("text/event-stream"):
            data = await self._read_before_relay(worker, upstream)
            return web.Response(
                status=upstream.status, body=data, headers={"Content-Type": ctype, WORKER_HEADER: worker.id}
            )
        resp = web.StreamResponse(
            status=upstream.status,
            headers={"Content-Type": ctype, "Cache-Control": "no-cache", WORKER_HEADER: worker.id},
        )
        await resp.prepare(request)
        try:
            async for chunk in upstream.chunks():
                await resp.write(chunk)
        except ConnectionResetError:  # aiohttp's ClientConnectionResetError too: the caller went away
            self._abort_on_worker(worker, abort)
            return resp
        except (TimeoutError, UpstreamError) as exc:
            # Bytes already went out: no retry; end the stream and say why.
            log.warning("stream from %s broke: %r", worker.id, exc)
            error = json.dumps({"error": {"message": f"worker {worker.id} stream broke: {type(exc).__name__}"}})
            await resp.write(f"data: {error}\n\n".encode())
            return resp
        try:
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the caller hung up after the last event: the worker already finished, nothing to abort
        return resp

    def _abort_on_worker(self, worker: Worker, abort: AbortCall | None) -> None:
        if abort is None:
            return
        self._metrics.client_aborts.inc()
        self._tasks.spawn(self._send_abort(worker, abort), name=f"abort-{worker.id}")

    async def _send_abort(self, worker: Worker, abort: AbortCall) -> None:
        try:
            request = abort.endpoint.request.model_validate(abort.fields)
        except ValidationError as exc:  # the worker refused such an id with the request itself
            log.warning("could not abort %s on %s: %d problem(s) in its id", abort.label, worker.id, exc.error_count())
            return
        answer = await self._workers.call(worker.url, abort.endpoint, request, headers=self._service_headers)
        if answer.status is None:
            log.warning("could not abort %s on %s: %s", abort.label, worker.id, answer.error)
        else:
            log.info("caller left; aborted %s on %s (%d)", abort.label, worker.id, answer.status)
