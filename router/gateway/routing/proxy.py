"""``/generate`` through the router: pick a worker, forward, stream back.

- Only eligible workers are candidates: routable (healthy, not disabled) and on a
  fleet version the request's weight-version policy admits (``--version-policy``,
  the ``X-Version-Policy`` header; :mod:`router.gateway.routing.version_policy`). With
  none the caller gets 503 with the reason at once; a bad policy is a 400.
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
  byte for byte. The answer's headers say the version the router knew the worker
  on when it picked it (``X-Weight-Version``); a buffered ``/generate`` answer whose
  ``meta_info`` says otherwise, or spans several versions, also gets
  ``X-Mixed-Weight-Versions: true`` (:mod:`router.gateway.routing.stamping`).
- At a pause broadcast, a request whose version policy the version being published would leave behind
  is dropped: aborted on its worker and answered 409 saying why (:mod:`router.gateway.routing.stale`).
- Every call to a worker goes through the gateway's one worker client
  (:class:`~router.gateway.upstream.WorkerClient`): streamed answers from its pool bounded by
  ``--max-connections``, aborts as whole answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import TypeVar

from pydantic import ValidationError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from router.contract import version_policy as policy_grammar
from router.contract.errors import ApiError, Unavailable
from router.contract.generate import INSTANCE_HEADER
from router.contract.version_policy import VersionPolicy
from router.contract.vllm_tokens import REQUEST_ID_HEADER
from router.gateway.config import RouterConfig
from router.gateway.engines import serves
from router.gateway.fleet.adapter_versions import NO_ADAPTERS, family_of
from router.gateway.fleet.registry import Worker, WorkerRegistry
from router.gateway.metrics import RouterMetrics
from router.gateway.routing import stale, version_policy
from router.gateway.routing.adapter_names import renamed_body
from router.gateway.routing.affinity import SessionAffinity, session_key
from router.gateway.routing.caller import Caller, StreamStalled
from router.gateway.routing.policy import Policy
from router.gateway.routing.prepare import AbortCall, Prepare, sglang_prepare
from router.gateway.routing.stale import StaleRequests, Ticket, staleness_bound
from router.gateway.routing.stamping import answer_mixes_versions, stamp_headers
from router.gateway.tasks import TaskSet
from router.gateway.upstream import NotAdmitted, UpstreamError, UpstreamResponse, WorkerClient, mime_type

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({502, 503, 504})
#: What the caller's HTTP server takes back from the handler (:mod:`router.gateway.routing.caller`).
A = TypeVar("A")

#: Where the router's one session table puts a session, when another process owns it: (key, candidates,
#: retry) → one of the candidates, or ``None`` when it did not answer (:mod:`router.gateway.data_planes.session_pins`).
SessionPlacer = Callable[[str, Sequence[Worker], bool], Awaitable[Worker | None]]
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
        placer: SessionPlacer | None = None,
        affinity: SessionAffinity | None = None,
    ):
        self._cfg = config
        self._placer = placer if config.session_affinity else None
        """With data-plane processes: the control process's table places sessions, so no two processes
        pin one session apart; this process's own table is used only when it does not answer."""
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
        self._stall_s = config.stream_stall_timeout_s
        self._stop = stop_after_attempt(1 + config.max_retries)
        self._wait = wait_exponential_jitter(initial=config.retry_initial_backoff_s, max=config.retry_max_backoff_s)
        self._retry_on = retry_if_exception_type(_Retryable)
        self._version_policy = policy_grammar.parse_version_policy(config.version_policy)
        """The router's default, parsed once: a request without the header costs no parse."""
        self._affinity = affinity
        if self._affinity is None and config.session_affinity:
            self._affinity = SessionAffinity.from_config(config, metrics.affinity)
        self.stale = StaleRequests(registry, self._send_abort, metrics.stale_aborts, tasks)
        """The requests a pause may drop as stale (:mod:`router.gateway.routing.stale`)."""

    def request_policy(self, caller: Caller[object]) -> tuple[VersionPolicy, bool]:
        """The request's weight-version policy: its header when it sent one (400 when bad), else the router's;
        and whether it sent one."""
        value = caller.header(policy_grammar.POLICY_HEADER)
        if value is None:
            value = caller.header(policy_grammar.SMG_POLICY_HEADER)
        return version_policy.policy_from_headers(value, self._version_policy), value is not None

    def pick(
        self,
        policy: VersionPolicy = policy_grammar.LATEST_ONLY,
        tried: set[str] | frozenset[str] = frozenset(),
        session: str | None = None,
        path: str | None = None,
    ) -> Worker:
        """One worker for a request under ``policy`` whose engine serves ``path``, not among ``tried``; 503
        (with who holds what) when none."""
        candidates = self._candidates(policy, tried, path)
        if session is not None and self._affinity is not None:
            return self._affinity.choose(session, candidates, retry=bool(tried))
        return self._policy.choose(candidates)

    async def pick_for(
        self,
        policy: VersionPolicy,
        tried: set[str] | frozenset[str] = frozenset(),
        session: str | None = None,
        path: str | None = None,
    ) -> Worker:
        """:meth:`pick`, with a session placed by the session table's owner when that is another process."""
        if session is None or self._placer is None or self._affinity is None:
            return self.pick(policy, tried, session, path)
        candidates = self._candidates(policy, tried, path)
        placed = await self._placer(session, candidates, bool(tried))
        if placed is not None:
            return placed
        self._metrics.affinity.local_placements += 1
        return self._affinity.choose(session, candidates, retry=bool(tried))

    def _candidates(self, policy: VersionPolicy, tried: set[str] | frozenset[str], path: str | None) -> list[Worker]:
        """The workers a request may go to; 503 (with who holds what) when none."""
        candidates = version_policy.candidates(self._registry, policy, tried, self._metrics.filtered, path)
        if not candidates:
            if path is not None:
                version_policy.refuse_unserved_route(self._registry, path)
            self._metrics.refused_by_policy(policy.kind)
            raise version_policy.refusal(self._registry, policy, describe_fleet(self._registry))
        return candidates

    def _upstream_headers(self, caller: Caller[object]) -> dict[str, str]:
        """What the caller said about its body; its ``Authorization`` is never forwarded."""
        headers = {"Content-Type": caller.header("Content-Type") or "application/json"}
        accept = caller.header("Accept")
        if accept is not None:
            headers["Accept"] = accept
        request_id = caller.header(REQUEST_ID_HEADER)
        if request_id:
            headers[REQUEST_ID_HEADER] = request_id
        if self._worker_auth is not None:
            headers["Authorization"] = self._worker_auth
        return headers

    async def handle(self, caller: Caller[A], path: str = "/generate", prepare: Prepare = sglang_prepare) -> A:
        policy, explicit = self.request_policy(caller)
        bound = staleness_bound(policy, explicit)
        raw = await caller.read()
        ready = prepare(raw, caller)
        body, abort, fields = ready.body, ready.abort, ready.fields
        named = self._registry.adapters.resolve(fields) if fields is not None else NO_ADAPTERS
        adapters = named.names
        if named.renamed:  # it named an adapter without its version: the worker is told which one serves it
            body = renamed_body(body, named.renamed)
        if adapters:
            policy = replace(policy, adapters=adapters)
            self._registry.adapters.started(adapters)  # an unload waits for these to end
            for name in adapters:
                self._metrics.adapter_requests.labels(family_of(name)).inc()
        try:
            headers = self._upstream_headers(caller)
            session = None if self._affinity is None else session_key(caller.header, fields)
            # The first attempt runs bare (no retry machinery): that is nearly every request.
            worker = await self.pick_for(policy, session=session, path=path)
            try:
                return await self._attempt(caller, worker, path, body, headers, abort, policy, bound)
            except _Retryable as exc:
                first = exc
            return await self._retry(caller, path, body, headers, abort, first, session, policy, bound)
        finally:
            if adapters:
                self._registry.adapters.ended(adapters)

    async def _retry(
        self,
        caller: Caller[A],
        path: str,
        body: bytes,
        headers: dict[str, str],
        abort: AbortCall | None,
        first: _Retryable,
        session: str | None,
        policy: VersionPolicy = policy_grammar.LATEST_ONLY,
        bound: int | None = None,
    ) -> A:
        """The first attempt failed before any byte reached the caller: back off, then other workers
        (a session's pin follows the request to the worker that serves it)."""
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
                        worker = await self.pick_for(policy, tried, session, path)
                    except Unavailable:
                        break  # every routable worker was tried
                    tried.add(worker.id)
                    try:
                        return await self._attempt(caller, worker, path, body, headers, abort, policy, bound)
                    except _Retryable as exc:
                        last = exc
                        raise
        except _Retryable as exc:
            last = exc
        return self._give_up(caller, last)

    def _give_up(self, caller: Caller[A], last: _Retryable) -> A:
        if last.body:
            headers = {"Content-Type": last.content_type or "application/json", WORKER_HEADER: last.worker.id}
            return caller.answer(last.status, last.body, headers)
        raise ApiError(502, f"worker {last.worker.id} ({last.worker.url}) failed: {last.reason}")

    async def _attempt(
        self,
        caller: Caller[A],
        worker: Worker,
        path: str,
        body: bytes,
        headers: dict[str, str],
        abort: AbortCall | None,
        policy: VersionPolicy = policy_grammar.LATEST_ONLY,
        bound: int | None = None,
    ) -> A:
        """One try on ``worker``. ``bound``: the staleness bound a pause judges the request by (``None``: it is
        never dropped, and not tracked)."""
        worker.inflight += 1
        # What the router knows the worker serves, and which process serves it, as it picked it. The answer is
        # checked against this process, not against the worker's state when the answer arrives: a snapshot or a
        # probe may have learnt of a restarted process meanwhile, and that process's answer is not the one picked.
        version, instance = worker.weight_version, worker.instance_id
        upstream: UpstreamResponse | None = None
        ticket = None if bound is None else self.stale.open(worker, policy, bound, abort)
        try:
            try:
                upstream = await self._workers.stream(
                    "POST",
                    worker.url,
                    path,
                    body,
                    headers,
                    timeout_s=self._cfg.request_timeout_s,
                    admit=partial(_still_admits, self._registry, policy, worker, instance),
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
            if restarted is not None and instance is not None and restarted != instance:
                # Another process than the one picked answered: it came back with its boot weights. Its answer is
                # dropped, and the worker is pending until a weight update reaches the new process.
                if worker.instance_id == instance:
                    worker.instance_id = restarted
                    if self._on_restarted is not None:
                        self._on_restarted(worker)
                await self._read_before_relay(worker, upstream)
                reason = f"worker {worker.id} restarted since its last probe; not serving the fleet's weights"
                raise _Retryable(worker, reason, "restarted", 503, json.dumps({"error": {"message": reason}}).encode())
            return await self._relay(caller, worker, upstream, abort, version, path == "/generate", ticket)
        except asyncio.CancelledError:
            if ticket is not None and ticket.stale is not None and ticket.take_cancel():
                # Dropped at a pause (the drop sends its abort): the caller is told why, nothing is relayed.
                headers = {"Content-Type": "application/json", WORKER_HEADER: worker.id}
                return caller.answer(stale.STALE_STATUS, ticket.stale.body(), headers)
            # The caller disconnected (handler cancelled): stop the work on the worker too.
            self._abort_on_worker(worker, abort)
            raise
        finally:
            self.stale.close(ticket)
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
        self,
        caller: Caller[A],
        worker: Worker,
        upstream: UpstreamResponse,
        abort: AbortCall | None,
        version: str | None = None,
        check_mixed: bool = False,
        ticket: Ticket | None = None,
    ) -> A:
        ctype = upstream.header("Content-Type") or "application/json"
        if not ctype.startswith("text/event-stream"):
            data = await self._read_before_relay(worker, upstream)
            headers = {"Content-Type": ctype, WORKER_HEADER: worker.id}
            mixed = check_mixed and ctype.startswith("application/json") and answer_mixes_versions(data, version)
            stamp_headers(headers, version, mixed)
            return caller.answer(upstream.status, data, headers)
        # A stream's headers go before its first token: they say the version of the worker picked.
        headers = {"Content-Type": ctype, "Cache-Control": "no-cache", WORKER_HEADER: worker.id}
        stamp_headers(headers, version, False)
        out = await caller.stream(upstream.status, headers, self._stall_s)
        try:
            async for chunk in upstream.chunks():
                await out.write(chunk)
        except asyncio.CancelledError:
            if ticket is None or ticket.stale is None or not ticket.take_cancel():
                raise
            # Dropped at a pause after its head went out: the stream ends with the reason as its last event.
            with contextlib.suppress(ConnectionResetError):
                await out.write(b"data: " + ticket.stale.body() + b"\n\n")
                await out.end()
            return out.answer
        except ConnectionResetError as exc:  # aiohttp's ClientConnectionResetError too: the caller went away
            if isinstance(exc, StreamStalled):  # or stopped reading: cut off by the stall bound
                log.info("stream to a caller that stopped reading cut after %gs (worker %s)", self._stall_s, worker.id)
                self._metrics.stream_stalls.inc()
            self._abort_on_worker(worker, abort)
            return out.answer
        except (TimeoutError, UpstreamError) as exc:
            # Bytes already went out: no retry; end the stream and say why.
            log.warning("stream from %s broke: %r", worker.id, exc)
            error = json.dumps({"error": {"message": f"worker {worker.id} stream broke: {type(exc).__name__}"}})
            await out.write(f"data: {error}\n\n".encode())
            return out.answer
        try:
            await out.end()
        except ConnectionResetError:
            pass  # the caller hung up after the last event: the worker already finished, nothing to abort
        return out.answer

    def _abort_on_worker(self, worker: Worker, abort: AbortCall | None) -> None:
        """Stop the request on its worker: the abort route where its engine serves one (vLLM's OpenAI routes
        have none: vLLM ends a request whose connection closed, as the router's does here)."""
        if abort is None or not serves(worker, abort.endpoint.path):
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
            log.info("aborted %s on %s (%d)", abort.label, worker.id, answer.status)


def _still_admits(registry: WorkerRegistry, policy: VersionPolicy, worker: Worker, instance: str | None) -> bool:
    """At the first byte: the worker still serves ``policy`` and is still the process it was picked as."""
    return worker.instance_id == instance and version_policy.admits(registry, policy, worker)
