"""Admin broadcast: send one admin call to every live worker, concurrently.

The rules (seed 000, Router Behavior):

- targets are all workers that are not dead, disabled ones included;
- a *fenced* operation records its targets in the journal, disables them for
  the whole broadcast, and restores each one's previous ``disabled`` flag only
  if every target succeeded; otherwise every target stays disabled (fail
  closed) and the journal keeps the entry until an operator resolves it;
- a worker succeeded when it answered 2xx and its body does not say
  ``success: false`` (or ``status: "error"``);
- admin POSTs are never retried: a second ``update_weights_*`` could apply twice.

The building blocks (:meth:`AdminBroadcaster.fan_out`, :meth:`fence`) are
public so rank assignment and the two-phase barrier compose them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import aiohttp

from router.gateway.admin.admin_http import AdminHttpClient, HttpProtocolError
from router.contract.errors import Conflict, Unavailable
from router.gateway.fleet.health import WorkerProber
from router.gateway.admin.journal import UpdateJournal
from router.gateway.metrics import RouterMetrics
from router.gateway.admin.operations import Operation
from router.contract.fleet import BroadcastResponse, WorkerResult
from router.gateway.fleet.registry import Worker, WorkerRegistry
from router.gateway.admin.update_gate import UpdateGate

log = logging.getLogger(__name__)

RESOLVE_HINT = (
    "re-enable each worker with PUT /workers/{id} {\"disabled\": false} once it is repaired, "
    "or POST /weight_update_journal/resolve {\"acknowledge\": true}"
)


def decode_body(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return raw.decode("utf-8", errors="replace")


def body_says_failed(body: Any) -> bool:
    return isinstance(body, dict) and (body.get("success") is False or body.get("status") == "error")


@dataclass(slots=True)
class AdminCall:
    """What to send: method, path, query string, headers, and a body per worker."""

    method: str
    path: str
    headers: dict[str, str]
    query: str = ""
    body: bytes | None = None
    body_for: Callable[[Worker], bytes] | None = None
    timeout_s: float = 60.0

    def data(self, worker: Worker) -> bytes | None:
        return self.body_for(worker) if self.body_for is not None else self.body


@dataclass
class Fence:
    """Targets taken out of routing for one update; settle exactly once."""

    path: str
    targets: list[Worker]
    previous: dict[str, bool]
    journal: UpdateJournal
    settled: bool = field(default=False)

    def succeed(self) -> None:
        """Known-good outcome: restore every target's previous flag and drop the journal entry."""
        if self._settle():
            for w in self.targets:
                w.disabled = self.previous[w.id]
            self.journal.clear()

    def fail(self, failed_ids: Sequence[str], reason: str) -> None:
        """Uncertain outcome: every target stays disabled until an operator resolves it."""
        if self._settle():
            for w in self.targets:
                w.disabled = True
            self.journal.fail(failed_ids, reason)
            log.error("%s failed (%s); %d target(s) kept disabled", self.path, reason, len(self.targets))

    def _settle(self) -> bool:
        if self.settled:
            return False
        self.settled = True
        for w in self.targets:
            w.update_holds = max(0, w.update_holds - 1)
        return True


@dataclass(slots=True)
class Outcome:
    """A finished broadcast: HTTP status and body for the caller."""

    status: int
    response: BroadcastResponse

    @property
    def ok(self) -> bool:
        return self.response.success


class AdminBroadcaster:
    """Fan-out, fencing and the generic locked broadcast."""

    def __init__(
        self,
        *,
        registry: WorkerRegistry,
        gate: UpdateGate,
        journal: UpdateJournal,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
        prober: WorkerProber,
        connect_timeout_s: float,
    ):
        self.registry = registry
        self.gate = gate
        self.journal = journal
        self.metrics = metrics
        self._session = session
        self._prober = prober
        self._connect_timeout_s = connect_timeout_s
        self._lean = AdminHttpClient()

    def close(self) -> None:
        self._lean.close()

    # ------------------------------------------------------------------ primitives

    async def call(self, worker: Worker, call: AdminCall) -> WorkerResult:
        start = time.perf_counter()
        status: int | None = None
        body: Any = None
        error: str | None = None
        try:
            status, raw = await self._send(worker, call)
            body = decode_body(raw)
        except (asyncio.TimeoutError, TimeoutError):
            error = f"no answer within {call.timeout_s:g}s"
        except (aiohttp.ClientError, OSError, HttpProtocolError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        elapsed_ms = round((time.perf_counter() - start) * 1000.0, 3)
        success = error is None and status is not None and 200 <= status < 300 and not body_says_failed(body)
        return WorkerResult(
            worker=worker.id, url=worker.url, success=success, status_code=status,
            body=body if error is None else None, error=error, elapsed_ms=elapsed_ms,
        )  # fmt: skip

    async def _send(self, worker: Worker, call: AdminCall) -> tuple[int, bytes]:
        path = call.path + (f"?{call.query}" if call.query else "")
        connect = min(self._connect_timeout_s, call.timeout_s)
        if worker.url.startswith("http://"):
            return await self._lean.request(
                call.method, worker.url, path, body=call.data(worker), headers=call.headers,
                timeout_s=call.timeout_s, connect_timeout_s=connect,
            )  # fmt: skip
        timeout = aiohttp.ClientTimeout(total=call.timeout_s, sock_connect=connect)
        async with self._session.request(call.method, worker.url + path, data=call.data(worker), headers=call.headers, timeout=timeout) as resp:
            return resp.status, await resp.read()

    async def fan_out(
        self, targets: Sequence[Worker], call: AdminCall, *, fence: Fence | None = None, stage: str = "broadcast"
    ) -> list[WorkerResult]:
        """Send ``call`` to every target at once; one result per target, in target order.

        If the fan-out is interrupted (cancelled, or an error escapes), ``fence``
        fails closed: any target may already have started applying the call.
        """
        try:
            return list(await asyncio.gather(*(self.call(w, call) for w in targets)))
        except BaseException:
            if fence is not None:
                fence.fail([w.id for w in targets], f"{stage} interrupted")
            raise

    def live_targets(self) -> list[Worker]:
        targets = self.registry.live()
        if not targets:
            raise Unavailable(f"no live workers to broadcast to ({len(self.registry)} registered, all dead)")
        return targets

    def require_no_pending_failure(self) -> None:
        pending = self.journal.pending
        if pending is not None:
            ids = ", ".join(t.id for t in pending.targets)
            raise Conflict(
                f"an earlier update ({pending.path}) did not finish cleanly: {pending.reason or pending.state}; "
                f"workers {ids} are kept disabled. {RESOLVE_HINT}",
                journal=pending.model_dump(),
            )

    def fence(self, targets: Sequence[Worker], path: str) -> Fence:
        """Journal the targets durably, then disable them. Raises (changing nothing) if either step cannot start."""
        self.require_no_pending_failure()
        self.journal.begin(path, [(w.id, w.url, w.disabled) for w in targets])
        previous = {w.id: w.disabled for w in targets}
        for w in targets:
            w.disabled = True
            w.update_holds += 1
        return Fence(path=path, targets=list(targets), previous=previous, journal=self.journal)

    async def refresh_versions(self, workers: Sequence[Worker]) -> None:
        await asyncio.gather(*(self._prober.refresh_metadata(w) for w in workers))

    # ------------------------------------------------------------------ the generic broadcast

    async def broadcast(self, op: Operation, call: AdminCall) -> Outcome:
        """Run one table route: lock if the route is locked, fence if it is fenced, fan out, settle."""
        start = time.perf_counter()
        outcome_label = "error"
        if op.locked:
            await self.gate.acquire(op.name)
        try:
            targets = self.live_targets()
            fence = self.fence(targets, op.path) if op.fenced else None
            results = await self.fan_out(targets, call, fence=fence)
            outcome = self.settle(op.path, results, fence)
            if outcome.ok and op.changes_weights:
                await self.refresh_versions(targets)
            outcome_label = "success" if outcome.ok else "failure"
            return outcome
        finally:
            if op.locked:
                self.gate.release()
            self.metrics.observe_admin(op.name, outcome_label, time.perf_counter() - start)

    def settle(
        self, path: str, results: list[WorkerResult], fence: Fence | None,
        model: type[BroadcastResponse] = BroadcastResponse, **fields: Any,
    ) -> Outcome:  # fmt: skip
        """Turn per-worker results into the caller's answer (a ``model`` with ``fields``) and settle the fence."""
        failed = [r for r in results if not r.success]
        not_implemented = bool(results) and all(r.status_code == 501 for r in results)
        if fence is not None:
            if not failed or not_implemented:
                fence.succeed()
            else:
                fence.fail([r.worker for r in failed], summarize(failed))
        if not failed:
            return Outcome(200, envelope(path, results, "ok", model, **fields))
        if not_implemented:
            return Outcome(501, envelope(path, results, f"{path} is not implemented by the workers", model, **fields))
        message = f"{len(failed)} of {len(results)} worker(s) failed {path}: {summarize(failed)}"
        if fence is not None:
            message += f". All {len(fence.targets)} target(s) stay disabled (fail closed); {RESOLVE_HINT}"
        return Outcome(502, envelope(path, results, message, model, **fields))


def summarize(failed: Sequence[WorkerResult]) -> str:
    parts = []
    for r in failed:
        if r.error is not None:
            why = r.error
        elif isinstance(r.body, dict):
            why = str(r.body.get("message") or r.body.get("error") or r.body)
        else:
            why = str(r.body)
        parts.append(f"{r.worker} ({r.status_code if r.status_code is not None else 'no response'}): {why[:300]}")
    return "; ".join(parts)


def envelope(
    path: str, results: list[WorkerResult], message: str, model: type[BroadcastResponse] = BroadcastResponse, **fields: Any
) -> BroadcastResponse:
    """The broadcast answer; routes with more to say pass a ``BroadcastResponse`` subclass and its fields."""
    return model(
        success=all(r.success for r in results), message=message, path=path, worker_count=len(results), results=results, **fields
    )
