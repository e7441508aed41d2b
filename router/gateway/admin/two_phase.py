"""The two-phase barrier through the router (seed 001): prepare on all, then complete on all.

``/prepare_weights_update`` answers ``ready`` only when every target is ready,
so the trainer never broadcasts to a group in which someone is not receiving.
If any target answers ``error`` (or not at all), the router tells the ready
ones to drop their receive (``POST /abort_weights_update {"group_name"}``)
and returns every worker's answer; no broadcast should follow.

Between a ready prepare and its complete the update is *in flight*: the
router keeps the admin update lock, the targets disabled and the journal
entry across the two HTTP calls (an update session). ``/complete_weights_update``
ends it: all succeed, with the expected bucket count, → targets restored;
otherwise they stay disabled. A session nobody completes expires after the
caller's ``timeout_s`` (plus a margin) and fails closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from router.gateway.admin.broadcast import AdminBroadcaster, AdminCall, Fence, Outcome, envelope, summarize
from router.contract.errors import Conflict
from router.gateway.admin.operations import ABORT_WEIGHTS_UPDATE, Operation, caller_timeout_s
from router.contract.fleet import CompleteResponse, PrepareResponse, WorkerResult
from router.contract.weight_sync import DEFAULT_GROUP_NAME
from router.gateway.fleet.registry import Worker
from router.gateway.tasks import TaskSet

log = logging.getLogger(__name__)

PREPARE = "/prepare_weights_update"
COMPLETE = "/complete_weights_update"
SESSION_MARGIN_S = 60.0
# Where a worker may report the checksum of the weights it applied.
CHECKSUM_KEYS = ("checksum", "per_engine_checksum", "per_gpu_checksum", "weights_checksum")


@dataclass
class UpdateSession:
    """An update between a ready prepare and its complete: it holds the admin lock and its fence."""

    group_name: str
    fence: Fence
    targets: list[Worker]
    expected_buckets: int | None
    started: float
    expiry: asyncio.Task[None] | None = None


def checksum_of(body: Any) -> str | None:
    if not isinstance(body, dict):
        return None
    for key in CHECKSUM_KEYS:
        value = body.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def group_of(data: dict[str, Any]) -> str:
    return str(data.get("group_name") or DEFAULT_GROUP_NAME)


def expected_buckets(data: dict[str, Any]) -> int | None:
    n = data.get("num_buckets")
    if isinstance(n, int) and not isinstance(n, bool):
        return n
    buckets = data.get("buckets")
    return len(buckets) if isinstance(buckets, list) else None


class TwoPhaseCoordinator:
    """Prepare / complete / abort for the whole fleet, with at most one session at a time."""

    def __init__(
        self,
        broadcaster: AdminBroadcaster,
        tasks: TaskSet,
        *,
        prepare_op: Operation,
        complete_op: Operation,
        default_timeout_s: float,
        service_headers: dict[str, str],
    ):
        self._b = broadcaster
        self._tasks = tasks
        self._prepare_op = prepare_op
        self._complete_op = complete_op
        self._default_timeout_s = default_timeout_s
        # The router's own credentials, for calls no caller is waiting on (session expiry).
        self._service_headers = service_headers
        self.session: UpdateSession | None = None

    async def prepare(self, data: dict[str, Any], raw: bytes, headers: dict[str, str]) -> Outcome:
        group = group_of(data)
        start = time.perf_counter()
        label = "error"
        await self._b.gate.acquire(self._prepare_op.name)
        keep_gate = False
        try:
            targets = self._b.live_targets()
            fence = self._b.fence(targets, PREPARE)
            call = AdminCall(method="POST", path=PREPARE, headers=headers, body=raw, timeout_s=self._prepare_op.timeout_for(data))
            results = await self._b.fan_out(targets, call, fence=fence, stage="prepare")
            for r in results:
                if r.success and not (isinstance(r.body, dict) and r.body.get("status") == "ready"):
                    r.success = False
            if all(r.success for r in results):
                life = self._session_life(data)
                session = UpdateSession(group, fence, targets, expected_buckets(data), time.monotonic())
                session.expiry = self._tasks.spawn(self._expire(session, life), name=f"update-session-{group}")
                self.session = session
                keep_gate = True
                label = "success"
                return Outcome(200, envelope(PREPARE, results, f"all {len(results)} worker(s) ready", PrepareResponse, status="ready"))
            label = "failure"
            return await self._release_after_failed_prepare(fence, targets, results, group, headers)
        finally:
            if not keep_gate:
                self._b.gate.release()
            self._b.metrics.observe_admin(self._prepare_op.name, label, time.perf_counter() - start)

    async def _release_after_failed_prepare(
        self, fence: Fence, targets: list[Worker], results: list[WorkerResult], group: str, headers: dict[str, str]
    ) -> Outcome:
        ready_ids = {r.worker for r in results if r.success}
        ready = [w for w in targets if w.id in ready_ids]
        aborts = await self._b.fan_out(ready, self._abort_call(group, headers)) if ready else []
        failed = [r for r in results if not r.success]
        message = f"{len(failed)} of {len(results)} worker(s) not ready: {summarize(failed)}; no broadcast may start"
        if all(a.success for a in aborts):
            # Nobody received anything and every started receive was dropped: weights untouched.
            fence.succeed()
            if ready:
                message += f"; the {len(ready)} ready worker(s) dropped their receive"
        else:
            bad = [a for a in aborts if not a.success]
            fence.fail([r.worker for r in failed] + [a.worker for a in bad], "prepare failed and a receive could not be dropped")
            message += f"; could not release {summarize(bad)}; all targets stay disabled (fail closed)"
        return Outcome(502, envelope(PREPARE, results, message, PrepareResponse, status="error", aborts=aborts))

    async def complete(self, data: dict[str, Any], raw: bytes, headers: dict[str, str]) -> Outcome:
        group = group_of(data)
        session = self.session
        if session is None or session.group_name != group:
            have = f"the open session is for group {session.group_name!r}" if session else "no update session is open"
            raise Conflict(f"no prepared weight update for group {group!r} ({have}); call /prepare_weights_update first")
        start = time.perf_counter()
        self._end_session(session)
        try:
            call = AdminCall(method="POST", path=COMPLETE, headers=headers, body=raw, timeout_s=self._complete_op.timeout_for(data))
            results = await self._b.fan_out(session.targets, call, fence=session.fence, stage="complete")
            counts = self._check_counts(results, session.expected_buckets)
            checksums = {r.worker: checksum_of(r.body) for r in results}
            values = set(checksums.values())
            outcome = self._b.settle(
                COMPLETE, results, session.fence, CompleteResponse, num_buckets_received=counts,
                checksums=checksums, checksums_match=None if None in values else len(values) == 1,
            )  # fmt: skip
            if outcome.ok:
                await self._b.refresh_versions(session.targets)
            self._b.metrics.observe_admin(self._complete_op.name, "success" if outcome.ok else "failure", time.perf_counter() - start)
            return outcome
        finally:
            self._b.gate.release()

    async def abort(self, data: dict[str, Any], headers: dict[str, str]) -> Outcome:
        """A caller gives up after a ready prepare: workers drop their receive.

        Known-good only if every worker confirms and none reports partially
        applied weights; otherwise the targets stay disabled.
        """
        group = group_of(data)
        session = self.session
        if session is None or session.group_name != group:
            raise Conflict(f"no prepared weight update for group {group!r} to abort")
        self._end_session(session)
        try:
            results = await self._b.fan_out(session.targets, self._abort_call(group, headers))
            partial = [r for r in results if isinstance(r.body, dict) and r.body.get("weights_partial") is True]
            for r in partial:
                r.success = False
            return self._b.settle(ABORT_WEIGHTS_UPDATE.path, results, session.fence)
        finally:
            self._b.gate.release()

    # ------------------------------------------------------------------ internals

    def _abort_call(self, group: str, headers: dict[str, str]) -> AdminCall:
        body = json.dumps({"group_name": group}).encode()
        return AdminCall(method="POST", path=ABORT_WEIGHTS_UPDATE.path, headers=headers, body=body, timeout_s=ABORT_WEIGHTS_UPDATE.timeout_s)

    def _session_life(self, data: dict[str, Any]) -> float:
        asked = caller_timeout_s(data)
        return self._default_timeout_s if asked is None else asked + SESSION_MARGIN_S

    def _end_session(self, session: UpdateSession) -> None:
        """Detach the session (the caller now owns releasing the gate)."""
        self.session = None
        if session.expiry is not None and session.expiry is not asyncio.current_task():
            session.expiry.cancel()

    @staticmethod
    def _check_counts(results: list[WorkerResult], expected: int | None) -> dict[str, int | None]:
        counts: dict[str, int | None] = {}
        for r in results:
            n = r.body.get("num_buckets_received") if isinstance(r.body, dict) else None
            counts[r.worker] = n if isinstance(n, int) else None
            if r.success and expected is not None and n != expected:
                r.success = False
                r.error = f"received {n} bucket(s), expected {expected}"
        return counts

    async def _expire(self, session: UpdateSession, life_s: float) -> None:
        await asyncio.sleep(life_s)
        if self.session is not session:
            return
        log.error("update session for group %s expired after %.0fs without complete; failing closed", session.group_name, life_s)
        self._end_session(session)
        try:
            await self._b.fan_out(session.targets, self._abort_call(session.group_name, self._service_headers))
        finally:
            session.fence.fail([w.id for w in session.targets], f"no /complete_weights_update within {life_s:.0f}s")
            self._b.gate.release()
