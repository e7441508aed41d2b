"""The two-phase barrier through the router: prepare on all, then complete on all.

``/prepare_weights_update`` answers ``ready`` only when every target is ready,
so the trainer never broadcasts to a group in which someone is not receiving.
If any target answers ``error`` (or not at all), the router tells the ready
ones to drop their receive (``/abort_weights_update``) and returns every
worker's answer; no broadcast should follow.

Between a ready prepare and its complete the update is a :class:`PreparedUpdate`:
it owns the admin update lock, the fence on its targets and the journal entry,
across the two HTTP calls. ``/complete_weights_update`` ends it: every worker
succeeds with the announced bucket count → targets restored; otherwise they stay
disabled. ``/abort_weights_update`` ends it when the trainer will not broadcast.
A prepared update nobody ends expires once its receive window has passed (plus
one margin) and fails closed. It ends sooner when it cannot succeed any more: the
router reads its targets' ``/health`` every :data:`~router.gateway.sync.held.RECEIVE_POLL_S`, and once no
target can still complete (its receive ``failed``, its process restarted or lost
the update, or it stopped answering) the update is aborted and settled at once,
instead of holding the admin lock until expiry; a later complete or abort is told why. Each of the three ends runs as an
:class:`~router.gateway.admin.locked.AdminRun` that adopts the update's lock,
so the lock is released in that run's ``end``, like every other operation's.

The holding itself (lock, fence, journal, expiry and health polling) is
:class:`~router.gateway.sync.held.HeldUpdates`, which vLLM's start/update/finish
(:mod:`router.gateway.sync.weight_transfer`) shares.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from router.contract.admin import HealthStatus
from router.contract.base import WireResponse
from router.contract.budget import DEFAULT_RECEIVE_TIMEOUT_S
from router.contract.errors import Conflict
from router.contract.fleet_answers import WorkerResult
from router.contract.weight_sync import (
    AbortWeightsUpdateRequest,
    AbortWeightsUpdateResponse,
    CompleteWeightsUpdateRequest,
    CompleteWeightsUpdateResponse,
    PrepareWeightsUpdateRequest,
    PrepareWeightsUpdateResponse,
)
from router.gateway.admin.answers import Outcome, fleet_answer, summarize
from router.gateway.admin.expectation import NOTHING_SAID, Expectation
from router.gateway.admin.fanout import AdminCall
from router.gateway.admin.fence import Fence
from router.gateway.admin.locked import AdminRun
from router.gateway.admin.operations import ABORT, COMPLETE, PREPARE
from router.gateway.admin.verdicts import refused_untouched
from router.gateway.admin.verify import Digest
from router.gateway.fleet.registry import Worker
from router.gateway.sync.held import HeldUpdate, HeldUpdates

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class PreparedUpdate(HeldUpdate):
    """An update between a ready prepare and its end."""

    expected_buckets: int


class TwoPhaseCoordinator(HeldUpdates[PreparedUpdate]):
    """Prepare / complete / abort for the whole fleet, with at most one prepared update at a time."""

    what = "prepared update"
    ending_call = "complete"

    async def prepare(
        self, req: PrepareWeightsUpdateRequest, headers: dict[str, str]
    ) -> Outcome[PrepareWeightsUpdateResponse]:
        async with AdminRun.open(PREPARE, self._ctx) as run:
            self._ended.pop(req.group_name, None)
            targets = self._ctx.live_targets(serving=PREPARE.path)
            self._ctx.groups.check(req.group_name, targets)
            before = await run.read_digests(targets, headers) if self._ctx.verify_updates == "changed" else None
            fence = await run.fence_targets(targets)
            assert fence is not None  # prepare is fenced
            call = AdminCall(PREPARE, "POST", req, headers, timeout_s=PREPARE.router_wait(req))
            results = await run.fan_out(targets, call)
            if not all(r.success for r in results):
                run.outcome = "failure"
                return await self._drop_ready(fence, targets, results, req.group_name, headers)
            window = req.timeout_s if req.timeout_s is not None else DEFAULT_RECEIVE_TIMEOUT_S
            prepared = PreparedUpdate(
                group_name=req.group_name,
                lock=run.keep_lock(),
                fence=fence,
                targets=targets,
                expected_buckets=req.num_buckets,
                instances={w.id: w.instance_id for w in targets},
                receive_deadline=time.monotonic() + window,
                before=before,
            )
            self._hold(prepared, window)
            run.outcome = "success"
            return Outcome(200, fleet_answer(PREPARE, results, f"all {len(results)} worker(s) ready", status="ready"))

    async def _drop_ready(
        self,
        fence: Fence,
        targets: list[Worker],
        results: list[WorkerResult[PrepareWeightsUpdateResponse]],
        group: str,
        headers: dict[str, str],
    ) -> Outcome[PrepareWeightsUpdateResponse]:
        """Some target is not ready: the ready ones drop their receive. A worker stays fenced only if it
        gave no usable answer or could not drop its receive; a refusal touched nothing."""
        ready_ids = {r.worker for r in results if r.success}
        ready = [w for w in targets if w.id in ready_ids]
        aborts = await self._ctx.fanout.to_all(ready, self._abort_call(group, headers)) if ready else []
        failed = [r for r in results if not r.success]
        undropped = [a for a in aborts if not a.success]
        kept = [r.worker for r in failed if not refused_untouched(PREPARE, r)] + [a.worker for a in undropped]
        unsettled: list[WorkerResult[WireResponse]] = [*(r for r in failed if r.worker in kept), *undropped]
        reason = summarize(unsettled)
        await fence.settle(kept, reason)
        message = f"{len(failed)} of {len(results)} worker(s) not ready: {summarize(failed)}; no broadcast may start"
        if not ready and not kept:
            # Every target refused before starting anything: nothing changed anywhere.
            statuses = {r.status_code for r in failed}
            status = statuses.pop() if len(statuses) == 1 and None not in statuses else 400
            error = {"message": message}
            answer = fleet_answer(PREPARE, results, message, success=False, status="error", aborts=aborts, error=error)
            return Outcome(status or 400, answer)
        if ready:
            message += f"; the {len(ready) - len(undropped)} ready worker(s) dropped their receive"
        if kept:
            message += f"; {', '.join(kept)} stay disabled (fail closed)"
        return Outcome(502, fleet_answer(PREPARE, results, message, success=False, status="error", aborts=aborts))

    async def complete(
        self, req: CompleteWeightsUpdateRequest, headers: dict[str, str], expect: Expectation = NOTHING_SAID
    ) -> Outcome[CompleteWeightsUpdateResponse]:
        prepared = self._take(req.group_name, "call /prepare_weights_update first")
        async with AdminRun.open(COMPLETE, self._ctx, adopt=prepared.lock) as run:
            run.fence = prepared.fence
            # The workers wait for the rest of the receive window unless complete bounds its own wait.
            waits = req.timeout_s if req.timeout_s is not None else prepared.receive_left_s()
            if expect.checksum is not None and not req.return_checksum:
                # The caller's digest is compared with what each worker applied: have them say it.
                req = req.model_copy(update={"return_checksum": True})
            call = AdminCall(COMPLETE, "POST", req, headers, timeout_s=COMPLETE.endpoint.budget.router_wait(waits))
            results = await run.fan_out(prepared.targets, call)
            _check_counts(results, prepared.expected_buckets)
            checksums = {r.worker: r.body.checksum if r.body is not None else None for r in results}
            values = set(checksums.values())
            before = prepared.before if run.checks_change(expect) else None
            checked = await run.verify(results, expect, before, headers, reported=_reported(results))
            outcome = await run.settle(
                results, checksums=checksums, checksums_match=None if None in values else len(values) == 1, **checked
            )
            await run.record_weight_change(prepared.targets, results)
            return outcome

    async def abort(
        self, req: AbortWeightsUpdateRequest, headers: dict[str, str]
    ) -> Outcome[AbortWeightsUpdateResponse]:
        """A caller gives up after a ready prepare: workers drop their receive.

        Known-good only if every worker confirms and none reports partially
        applied weights; otherwise the targets stay disabled.
        """
        prepared = self._take(req.group_name, "nothing to abort")
        async with AdminRun.open(ABORT, self._ctx, adopt=prepared.lock) as run:
            run.fence = prepared.fence
            results = await run.fan_out(prepared.targets, self._abort_call(req.group_name, headers))
            for r in results:
                if r.body is not None and r.body.weights_partial:
                    r.success = False
            return await run.settle(results)

    # ------------------------------------------------------------------ internals

    def _take(self, group: str, hint: str) -> PreparedUpdate:
        """Detach the prepared update of ``group`` (the caller's run now ends it), or 409."""
        prepared = self.held
        if prepared is None or prepared.group_name != group:
            have = f"the prepared one is for group {prepared.group_name!r}" if prepared else "no update is prepared"
            raise Conflict(f"no prepared weight update for group {group!r} ({have}{self._ended_note(group)}); {hint}")
        self._detach(prepared)
        return prepared

    def _abort_call(
        self, group: str, headers: dict[str, str]
    ) -> AdminCall[AbortWeightsUpdateRequest, AbortWeightsUpdateResponse]:
        req = AbortWeightsUpdateRequest(group_name=group)
        return AdminCall(ABORT, "POST", req, headers, timeout_s=ABORT.router_wait(req))

    async def _end_by_router(self, held: PreparedUpdate) -> None:
        async with AdminRun.open(ABORT, self._ctx, name="prepared_update_ended", adopt=held.lock) as run:
            run.fence = held.fence
            # Workers that confirm the receive was dropped with nothing applied come back; the rest stay out.
            results = await run.fan_out(held.targets, self._abort_call(held.group_name, self._service_headers))
            await run.settle(results)
            run.outcome = "failure"

    def _stuck(self, held: PreparedUpdate, worker: Worker, status: HealthStatus) -> str | None:
        if status.receive is None:
            return "holds no prepared update"
        if status.receive == "failed":
            return "its receive failed"
        return None


def _check_counts(results: list[WorkerResult[CompleteWeightsUpdateResponse]], expected: int) -> None:
    """A worker that applied another number of buckets than announced did not succeed."""
    for r in results:
        body = r.body
        if r.success and body is not None and body.num_buckets_received != expected:
            r.success = False
            r.error = f"received {body.num_buckets_received} bucket(s), expected {expected}"


def _reported(results: list[WorkerResult[CompleteWeightsUpdateResponse]]) -> dict[str, Digest] | None:
    """Each worker's checksum of what it applied, as its complete reported it (the trainer's ``sent_checksum``
    scheme, whatever the engine); ``None`` when some worker reported none (then its engine's checker is read)."""
    reported: dict[str, Digest] = {}
    for r in results:
        body = r.body
        if body is None or not r.success:
            continue
        ranks = {c.checksum for c in body.rank_checksums} if body.rank_checksums else {body.checksum}
        if len(ranks) != 1 or None in ranks:
            return None
        (value,) = ranks
        reported[r.worker] = Digest(str(value).lower())
    return reported
