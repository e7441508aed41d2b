"""vLLM's weight-transfer API through the router: one fleet update from its start to its finish.

A vLLM trainer (TRL, open-instruct, SkyRL, AReaL) syncs with ``/start_weight_update``, one or more
``/update_weights`` (each paired with a broadcast over the weight-transfer group, or carrying
shared-memory handles) and ``/finish_weight_update``. Through the router the calls make one fleet
update, held like a prepared two-phase update (:class:`~router.gateway.sync.held.HeldUpdates`):

- *start* takes the admin update lock, journals and fences every live target and opens the update
  on each. It is refused (409 with ``group_changes``) when the fleet no longer matches the group the
  last ``/init_weight_transfer_engine`` built, before anything is fenced. When some target cannot
  open it, the ones that did close it again (a finish with nothing written) and nothing is held.
  Otherwise the update holds the lock, the fence and the journal entry until its finish.
- each *update_weights* goes to every target still in the update at once (the trainer broadcasts
  right after sending it, so every worker must be receiving) and is answered once all answered. A
  worker that fails it leaves the update: it is reported, gets no further call of this update and
  stays fenced after the finish. The update then takes no further ``/update_weights`` (a broadcast
  can no longer reach every rank of the group), only the finish; when no worker is left in it, the
  router ends it at once. The answer is the workers' own 4xx when every one refused, else 502.
- *finish* commits on the workers still in the update, restores the targets that succeeded in every
  call of it, keeps the others fenced and records the fleet's weights and version.
- ``/update_weights`` or ``/finish_weight_update`` with no update open is a 409 that touches no
  worker. An update nobody finishes ends after its window (start's ``timeout_s``, else the workers'
  receive default; each ``/update_weights`` extends it, as on the workers) plus one margin, or sooner
  once no target can finish it (every one failed, restarted or stopped answering), and fails closed.

Answers keep vLLM's ``message`` (a vLLM client reads it and the HTTP status) beside the router's
envelope, with ``update_open`` and the workers kept ``fenced``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from router.contract.admin import HealthStatus
from router.contract.base import WireResponse
from router.contract.budget import DEFAULT_RECEIVE_TIMEOUT_S
from router.contract.errors import Conflict
from router.contract.fleet_answers import WeightTransferFleetAnswer, WorkerResult
from router.contract.vllm import (
    VLLM_GROUP_NAME,
    FinishWeightUpdateRequest,
    StartWeightUpdateRequest,
    UpdateWeightsRequest,
    VllmResult,
)
from router.gateway.admin.answers import Outcome, fleet_answer, summarize
from router.gateway.admin.expectation import NOTHING_SAID, Expectation
from router.gateway.admin.fanout import AdminCall
from router.gateway.admin.fence import RESOLVE_HINT
from router.gateway.admin.locked import AdminRun
from router.gateway.admin.operations import FINISH, START, UPDATE
from router.gateway.admin.verdicts import judge, refused_untouched
from router.gateway.fleet.registry import Worker
from router.gateway.sync.held import HeldUpdate, HeldUpdates


@dataclass(kw_only=True)
class OpenUpdate(HeldUpdate):
    """A vLLM update between its start and its finish."""

    failed: dict[str, str] = field(default_factory=dict)
    """Workers that left the update (id → why): no further call of it reaches them; they stay fenced."""
    written: set[str] = field(default_factory=set)
    """Workers an ``/update_weights`` of this update may have written into."""
    chunks: int = 0
    """``/update_weights`` calls every worker still in the update took."""
    window_s: float
    """The update's window (start's ``timeout_s``, else the workers' receive default)."""

    def receiving(self) -> list[Worker]:
        return [w for w in self.targets if w.id not in self.failed]


class WeightTransfer(HeldUpdates[OpenUpdate]):
    """``/start_weight_update``, ``/update_weights`` and ``/finish_weight_update`` for the whole fleet."""

    what = "weight update"
    ending_call = "/finish_weight_update"

    async def start(self, req: StartWeightUpdateRequest, headers: dict[str, str]) -> Outcome[VllmResult]:
        self._refuse_second()
        async with AdminRun.open(START, self._ctx) as run:
            group = self._group()
            self._ended.pop(group, None)
            targets = self._ctx.live_targets(serving=START.path)
            self._ctx.groups.check(group, targets)
            before = await run.read_digests(targets, headers) if self._ctx.verify_updates == "changed" else None
            fence = await run.fence_targets(targets)
            assert fence is not None  # start is fenced
            call = AdminCall(START, "POST", req, headers, timeout_s=START.router_wait(req))
            results = await run.fan_out(targets, call)
            if not all(r.success for r in results):
                return await self._close_opened(run, targets, results, headers)
            window = req.timeout_s if req.timeout_s is not None else DEFAULT_RECEIVE_TIMEOUT_S
            held = OpenUpdate(
                group_name=group,
                lock=run.keep_lock(),
                fence=fence,
                targets=targets,
                instances={w.id: w.instance_id for w in targets},
                receive_deadline=time.monotonic() + window,
                window_s=window,
                before=before,
            )
            self._hold(held, window)
            run.outcome = "success"
            message = f"weight update started on all {len(results)} worker(s)"
            return Outcome(200, fleet_answer(START, results, message, update_open=True))

    async def update(self, req: UpdateWeightsRequest, headers: dict[str, str]) -> Outcome[VllmResult]:
        held = self._open_update(UPDATE.path)
        if held.failed:
            raise Conflict(
                f"this weight update failed on {_listing(held.failed)}; it takes no further /update_weights: "
                "call /finish_weight_update to end it (the workers still in it commit, the others stay fenced). "
                "No worker was contacted",
                update_open=True,
                fenced=sorted(held.failed),
            )
        if held.calls.locked():
            raise Conflict("an /update_weights of this update is still in flight; send the next one after its answer")
        async with held.calls, AdminRun.open(UPDATE, self._ctx) as run:
            targets = held.receiving()
            # Each call extends the update's window on the workers (by its own timeout_s, else the
            # window start set), and so the router's hold; the workers receive until that deadline.
            window = req.update_info.timeout_s if req.update_info.timeout_s is not None else held.window_s
            now = time.monotonic()
            held.receive_deadline = max(held.receive_deadline, now + window)
            held.expires_at = max(held.expires_at, now + self._life_s(window))
            bound = held.receive_left_s()
            call = AdminCall(UPDATE, "POST", req, headers, timeout_s=UPDATE.endpoint.budget.router_wait(bound))
            results = await run.fan_out(targets, call)
            failed = [r for r in results if not r.success]
            held.written.update(r.worker for r in results if r.success or not refused_untouched(UPDATE, r))
            if not failed:
                held.chunks += 1
                run.outcome = "success"
                message = f"weights received and loaded by all {len(results)} worker(s)"
                return Outcome(200, fleet_answer(UPDATE, results, message, update_open=True))
            for r in failed:
                status = r.status_code if r.status_code is not None else "no response"
                held.failed[r.worker] = f"its /update_weights failed ({status}): {r.reason()[:300]}"
            verdict = judge(UPDATE, results)
            run.outcome = "refused" if verdict.all_refused else "failure"
            message = (
                f"{len(failed)} of {len(results)} worker(s) failed /update_weights: {summarize(failed)}. "
                f"{', '.join(r.worker for r in failed)} left the update and stay fenced ({RESOLVE_HINT})"
            )
            open_still = bool(held.receiving())
            if open_still:
                message += "; the update takes no further /update_weights: call /finish_weight_update"
            else:
                # Nobody can finish it any more: end it now rather than hold the lock until it expires.
                self._detach(held)
                reason = f"every worker left it ({_listing(held.failed)})"
                self._ended[held.group_name] = reason
                await self._end_by_router(held)
                message += "; no worker is left in the update, so the router ended it"
            answer = fleet_answer(UPDATE, results, message, update_open=open_still, fenced=sorted(held.failed))
            if verdict.all_refused:
                # Every worker refused it: their own 4xx (the trainer's broadcast found no receiver).
                assert isinstance(answer, WeightTransferFleetAnswer)
                return Outcome(verdict.refusal_status, answer.failed(message))
            return Outcome(502, answer)

    async def finish(
        self, req: FinishWeightUpdateRequest, headers: dict[str, str], expect: Expectation = NOTHING_SAID
    ) -> Outcome[VllmResult]:
        held = self._open_update(FINISH.path)
        if held.calls.locked():
            raise Conflict("an /update_weights of this update is still in flight; finish after its answer")
        self._detach(held)
        async with AdminRun.open(FINISH, self._ctx, adopt=held.lock) as run:
            run.fence = held.fence
            call = AdminCall(FINISH, "POST", req, headers, timeout_s=FINISH.router_wait(req))
            answered = {r.worker: r for r in await run.fan_out(held.receiving(), call)}
            results = [answered[w.id] if w.id in answered else _left_update(w, held.failed[w.id]) for w in held.targets]
            checked = await run.verify(results, expect, held.before if run.checks_change(expect) else None, headers)
            # A worker that took chunks of this update and did not commit them may hold a mix of weights.
            outcome = await run.settle(results, uncertain=held.written | held.failed.keys(), **checked)
            await run.record_weight_change(held.targets, results)
            answer = outcome.answer
            assert isinstance(answer, WeightTransferFleetAnswer)
            answer.fenced = list(run.kept)
            record = self._ctx.registry.fleet.record
            if outcome.status == 200:
                answer.message = f"weight update finished on all {len(results)} worker(s) ({held.chunks} chunk(s))"
                answer.weight_version = record.weight_version if record is not None else None
            return outcome

    # ------------------------------------------------------------------ internals

    def _group(self) -> str:
        """The group vLLM's updates go over: the one the last ``/init_weight_transfer_engine`` built."""
        return self._ctx.groups.latest("vllm") or VLLM_GROUP_NAME

    def _refuse_second(self) -> None:
        if self.held is not None:
            raise Conflict(
                "a weight update is already open; finish it with /finish_weight_update first", update_open=True
            )

    def _open_update(self, path: str) -> OpenUpdate:
        held = self.held
        if held is None:
            note = self._ended_note(self._group())
            raise Conflict(
                f"no weight update is open{note}; {path} needs one: call /start_weight_update first. "
                "No worker was contacted",
                update_open=False,
            )
        return held

    async def _close_opened(
        self,
        run: AdminRun[StartWeightUpdateRequest, VllmResult],
        targets: list[Worker],
        results: list[WorkerResult[VllmResult]],
        headers: dict[str, str],
    ) -> Outcome[VllmResult]:
        """Some target could not open the update: the ones that did close it again, with nothing written.
        A worker stays fenced if it gave no usable answer or could not close its update."""
        fence = run.fence
        assert fence is not None
        opened_ids = {r.worker for r in results if r.success}
        opened = [w for w in targets if w.id in opened_ids]
        close = FinishWeightUpdateRequest(flush_cache=False)
        call = AdminCall(FINISH, "POST", close, headers, timeout_s=FINISH.router_wait(close))
        closes = await self._ctx.fanout.to_all(opened, call) if opened else []
        failed = [r for r in results if not r.success]
        unclosed = [c for c in closes if not c.success]
        kept = [r.worker for r in failed if not refused_untouched(START, r)] + [c.worker for c in unclosed]
        unsettled: list[WorkerResult[WireResponse]] = [*(r for r in failed if r.worker in kept), *unclosed]
        await fence.settle(kept, summarize(unsettled))
        message = f"{len(failed)} of {len(results)} worker(s) could not start the update: {summarize(failed)}"
        if not opened and not kept:
            # Every target refused before opening anything: nothing changed anywhere.
            run.outcome = "refused"
            statuses = {r.status_code for r in failed}
            status = statuses.pop() if len(statuses) == 1 and None not in statuses else 400
            answer = fleet_answer(START, results, message, success=False, error={"message": message})
            return Outcome(status or 400, answer)
        run.outcome = "failure"
        if opened:
            message += f"; the {len(opened) - len(unclosed)} worker(s) that had started it closed it again"
        if kept:
            message += f"; {', '.join(kept)} stay disabled (fail closed)"
        return Outcome(502, fleet_answer(START, results, message, success=False, fenced=kept))

    async def _end_by_router(self, held: OpenUpdate) -> None:
        """Fail the update closed: its workers may hold any part of it, so every target stays fenced."""
        async with AdminRun.open(FINISH, self._ctx, name="weight_update_ended", adopt=held.lock) as run:
            run.fence = held.fence
            await held.fence.fail(self._ended.get(held.group_name, "ended by the router"))
            run.outcome = "failure"

    def _stuck(self, held: OpenUpdate, worker: Worker, status: HealthStatus) -> str | None:
        if worker.id in held.failed:
            return held.failed[worker.id]
        if status.weight_update is None:
            return "holds no open weight update (it ended on the worker)"
        return None


def _left_update(worker: Worker, why: str) -> WorkerResult[VllmResult]:
    """The finish's result for a worker that had left the update: not sent, not committed."""
    return WorkerResult[VllmResult](
        worker=worker.id, url=worker.url, success=False, error=f"not finished: {why}", elapsed_ms=0.0
    )


def _listing(failed: dict[str, str]) -> str:
    return "; ".join(f"{wid} ({why})" for wid, why in failed.items())
