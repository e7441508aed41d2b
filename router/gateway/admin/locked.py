"""The one shape of every admin operation on the fleet.

::

    acquire the update lock (serialized operations; 503 past --admin-lock-timeout-s)
      → pick the live targets (503 when there are none)
      → fence them: journal, then disable (fenced operations)
      → fan out (an interrupted fan-out fails the fence closed)
      → settle: restore the fence when every target succeeded, else fail closed
      → end: release the lock, record the metrics

Each step's time is kept (:class:`~router.gateway.admin.timings.PhaseTimes`): the answer says it
(``timings``, ``Server-Timing``), and so do the log line and the metrics.

:class:`AdminRun` is that shape; :meth:`AdminRun.open` runs it as a context, and
:meth:`AdminRun.end` is the only place an operation releases the update lock. A ready
prepare (and vLLM's ``/start_weight_update``) keeps the lock past its own HTTP call
(:meth:`AdminRun.keep_lock`): the held update owns it then, and the run that ends
that update (complete, abort, finish or expiry) adopts it and releases it in its own ``end``.

Whoever holds the lock holds a :class:`LockHold`: :meth:`LockHold.take` and
:meth:`LockHold.release` are the only places the update gate is acquired and released, by an
:class:`AdminRun` and by discovery's registry changes (:mod:`router.gateway.discovery.reconcile`,
which apply between updates).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from router.contract.admin import OPERATION_HEADER
from router.contract.base import WireRequest, WireResponse
from router.contract.errors import Unavailable
from router.contract.fleet_answers import WorkerResult
from router.contract.fleet_status import LastUpdate
from router.contract.weight_digest import VerifyUpdates
from router.gateway.admin.answers import Outcome, fleet_answer, summarize
from router.gateway.admin.expectation import NOTHING_SAID, Expectation
from router.gateway.admin.fanout import AdminCall, FanOut
from router.gateway.admin.fence import RESOLVE_HINT, Fence
from router.gateway.admin.floor import refuse_below_floor
from router.gateway.admin.journal import UpdateJournal
from router.gateway.admin.operations import Operation
from router.gateway.admin.stale_at_pause import StaleAtPause
from router.gateway.admin.timings import PhaseTimes
from router.gateway.admin.update_gate import UpdateGate
from router.gateway.admin.verdicts import judge
from router.gateway.admin.verify import Digest, digests_view, read_digests
from router.gateway.admin.verify import judge as judge_digests
from router.gateway.engines import refuse_unserved
from router.gateway.fleet.groups import WeightGroups
from router.gateway.fleet.registry import Worker, WorkerRegistry
from router.gateway.fleet.weights import agreed_checksum
from router.gateway.health import WorkerProber
from router.gateway.metrics import RouterMetrics

log = logging.getLogger(__name__)

Req = TypeVar("Req", bound=WireRequest)
Resp = TypeVar("Resp", bound=WireResponse)


class FenceBarrier(Protocol):
    async def confirm(self, why: str) -> None:
        """Return once every process that routes requests has applied the registry's fences; raise
        :class:`~router.contract.errors.Unavailable` (``why`` first) when one has not in time."""
        ...

    def announce(self) -> None:
        """The registry's routing state changed: start telling every routing process now, without waiting."""
        ...


class _OneProcess:
    """One router process: the proxy reads the registry itself, so a fence holds once it is set."""

    async def confirm(self, why: str) -> None:
        return None

    def announce(self) -> None:
        return None


ONE_PROCESS: FenceBarrier = _OneProcess()


@dataclass(slots=True)
class AdminContext:
    """What every admin operation works with (one per app)."""

    registry: WorkerRegistry
    gate: UpdateGate
    journal: UpdateJournal
    metrics: RouterMetrics
    fanout: FanOut
    prober: WorkerProber
    groups: WeightGroups
    barrier: FenceBarrier = field(default_factory=lambda: ONE_PROCESS)
    """Every process that routes has applied a fence (the data planes' acknowledgement)."""
    last_update: LastUpdate | None = None
    """The last weight change's operation and phases (``omni-router status``)."""
    verify_updates: VerifyUpdates = "off"
    """``changed``: a weight change that left a target's weights as they were fails on it (:mod:`.verify`)."""
    stale: StaleAtPause | None = None
    """What a pause drops first: the requests the next version makes stale (:mod:`.stale_at_pause`)."""
    min_routable_workers: float = 0.0
    """``--min-routable-workers``: the floor a weight sync must leave able to serve (:mod:`.floor`)."""

    def refuse_below_floor(self, op: Operation[Any, Any], only: Collection[str] | None = None) -> None:
        """409 when ``op`` starts a weight sync that fewer workers than the floor could take (:mod:`.floor`)."""
        refuse_below_floor(self.registry, self.journal, self.min_routable_workers, op, only)

    def live_targets(self, only: Collection[str] | None = None, *, serving: str | None = None) -> list[Worker]:
        """Every live worker, or those of ``only`` (a targeted call's ids) still live: 503 when there are none.

        A retired worker (:attr:`Worker.retired`) is left out of a fleet-wide call: it failed every catch-up the
        router gave it, so it would fail the fleet's update too, and it serves nothing until its process
        restarts. A call that names it (``?workers=``) still reaches it.

        ``serving``: the admin route the call sends; 400 when a target's engine does not serve it (a fleet of
        several engines uses the routes every engine in it serves), before anything is locked or sent."""
        targets = self.registry.live()
        if only is not None:
            targets = [w for w in targets if w.id in only]
            if not targets:
                raise Unavailable(f"none of the {len(only)} targeted worker(s) is live")
        else:
            targets = [w for w in targets if not w.retired]
        if not targets:
            raise Unavailable(f"no live workers to broadcast to ({len(self.registry)} registered, all dead or retired)")
        if serving is not None:
            refuse_unserved(targets, serving)
        return targets

    async def refresh_versions(self, workers: Sequence[Worker]) -> None:
        """Read each worker's ``weight_version`` and ``tp_size`` again (after a change, or when unknown)."""
        await asyncio.gather(*(self.prober.refresh_metadata(w) for w in workers))


class LockHold:
    """The admin update lock, held by one operation, one held update or one registry change; released once."""

    def __init__(self, gate: UpdateGate) -> None:
        self._gate = gate
        self._held = True

    @classmethod
    async def take(cls, gate: UpdateGate, holder: str, *, timeout_s: float | None = None) -> LockHold:
        """Wait for the lock as ``holder``: 503 (:class:`Unavailable`) past ``timeout_s`` (default: the gate's)."""
        await gate.acquire(holder, timeout_s)
        return cls(gate)

    def release(self) -> None:
        if self._held:
            self._held = False
            self._gate.release()


class AdminRun(Generic[Req, Resp]):
    """One admin operation on the fleet, from the lock to the metrics (see the module docstring): its calls
    send a ``Req`` and each worker answers a ``Resp``."""

    def __init__(
        self,
        op: Operation[Req, Resp],
        ctx: AdminContext,
        *,
        name: str | None = None,
        lock: LockHold | None = None,
        timings: PhaseTimes | None = None,
    ) -> None:
        self.op = op
        self.ctx = ctx
        self.name = name or op.name
        self.fence: Fence | None = None
        self.outcome = "error"
        self.kept: tuple[str, ...] = ()
        """The targets :meth:`settle` kept fenced."""
        self._lock = lock
        self._kept = False
        self._ended = False
        self.timings = timings if timings is not None else PhaseTimes()
        """Where the operation spent its time (from before its lock was requested)."""
        self.id = uuid.uuid4().hex[:12]
        """The operation's id in the router's log and on every call to a worker (:data:`OPERATION_HEADER`);
        the caller's ``X-Request-Id`` when it sent one."""
        self._sent = False

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        op: Operation[Req, Resp],
        ctx: AdminContext,
        *,
        name: str | None = None,
        adopt: LockHold | None = None,
        only: Collection[str] | None = None,
    ) -> AsyncIterator[AdminRun[Req, Resp]]:
        """Run one operation: take the lock if ``op`` is serialized (or ``adopt`` a held update's), end on exit.

        A weight sync's start is held against ``--min-routable-workers`` again once the lock is taken (``only``:
        a targeted call's ids): the fleet may have thinned while the call waited, and nothing is fenced or sent
        yet, so a refusal here still changes nothing.

        Whatever escapes the body fails an unsettled fence closed: any target may
        already have started applying the call.
        """
        lock = adopt
        timings = PhaseTimes()
        if lock is None and op.locked:
            with timings.phase("lock_wait"):
                lock = await LockHold.take(ctx.gate, name or op.name)
        run = cls(op, ctx, name=name, lock=lock, timings=timings)
        try:
            if adopt is None:
                ctx.refuse_below_floor(op, only)
            yield run
        except BaseException:
            if run.fence is not None and not run.fence.settled:
                run.fence.fail_now(f"{run.name} interrupted")
            raise
        finally:
            run.end()

    async def fence_targets(self, targets: Sequence[Worker]) -> Fence | None:
        """Journal and disable ``targets`` if this operation is fenced (refuses with 409/503, changing nothing).

        The fence holds once every process that routes requests has applied it (the barrier):
        if one has not within its bound, the fence is lowered again and the call refused, before
        anything is sent to a worker."""
        if not self.op.fenced:
            return self.fence
        fence = Fence.take_out(targets, self.op.path, self.ctx.journal)
        # Both must hold before anything is sent, and neither needs the other: they run at once. The journal's
        # write goes to its thread first (one turn of the loop), so its file system calls run while the
        # barrier builds and sends the routing snapshot.
        started = time.perf_counter()
        written = asyncio.ensure_future(fence.write_journal())
        written.add_done_callback(lambda _: self.timings.add("journal_write", time.perf_counter() - started))
        try:
            await asyncio.sleep(0)
            await self.ctx.barrier.confirm(f"{self.op.path} refused")
            self.timings.add("fence_barrier", time.perf_counter() - started)
        except BaseException:
            await _undo(fence, written)
            raise
        try:
            await written
        except BaseException:
            fence.put_back()  # nothing written, nothing sent
            raise
        self.fence = fence
        return self.fence

    async def fan_out(self, targets: Sequence[Worker], call: AdminCall[Req, Resp]) -> list[WorkerResult[Resp]]:
        given = call.headers.get(OPERATION_HEADER)
        if given is not None:
            self.id = given
        else:
            call.headers = {**call.headers, OPERATION_HEADER: self.id}
        if not self._sent:
            self._sent = True
            log.info("admin %s %s: to %d worker(s)", self.id, self.name, len(targets))
        with self.timings.phase("fan_out"):
            results = await self.ctx.fanout.to_all(targets, call)
        if results:
            self.timings.add("slowest_worker", max(r.elapsed_ms for r in results) / 1000.0)
        return results

    async def settle(
        self, results: Sequence[WorkerResult[Resp]], *, uncertain: Collection[str] = (), **fields: Any
    ) -> Outcome[Resp]:
        """The caller's answer, and the fence settled worker by worker (:mod:`~router.gateway.admin.verdicts`).

        ``uncertain``: workers whose state an earlier step of the same update (or a join this call
        attempted) may have changed: a failure of theirs is never a refusal that changed nothing, so
        they stay fenced. When every target answers 501, nothing can have changed and the fence is
        restored. The workers kept fenced are in :attr:`kept` afterwards.
        """
        if self.fence is not None:
            self._fail_departed(results)
        failed = [r for r in results if not r.success]
        not_implemented = bool(results) and all(r.status_code == 501 for r in results)
        verdict = judge(self.op, results)
        doubtful = [r.worker for r in failed if r.worker in uncertain and r.worker not in verdict.kept]
        kept = () if not_implemented else (*verdict.kept, *doubtful)
        all_refused = verdict.all_refused and not doubtful
        self.kept = kept
        # The control effect first: once the fence is lowered a probe may read the workers, and one the router
        # paused must not look paused behind its back.
        self.ctx.registry.observe_control(self.op.path, (r.worker for r in results if r.success))
        if self.fence is not None:
            with self.timings.phase("settle"):
                await self.fence.settle(
                    kept, summarize([r for r in failed if r.worker in kept]), announce=self.ctx.barrier.announce
                )
        self.outcome = "success" if not failed else "refused" if all_refused else "failure"
        if not failed:
            return Outcome(200, fleet_answer(self.op, results, "ok", **fields), self.timings)
        if not_implemented:
            message = f"{self.op.path} is not implemented by the workers"
            answer = fleet_answer(self.op, results, message, error={"message": message}, **fields)
            return Outcome(501, answer, self.timings)
        if all_refused:
            reasons = {r.reason() for r in results}
            message = (
                reasons.pop() if len(reasons) == 1 else f"every worker refused {self.op.path}: {summarize(failed)}"
            )
            answer = fleet_answer(self.op, results, message, error={"message": message}, **fields)
            return Outcome(verdict.refusal_status, answer, self.timings)
        message = f"{len(failed)} of {len(results)} worker(s) failed {self.op.path}: {summarize(failed)}"
        if kept:
            message += (
                f". {len(kept)} target(s) whose weights may differ from the fleet's stay disabled (fail closed): "
                f"{', '.join(kept)}; {RESOLVE_HINT}"
            )
        return Outcome(502, fleet_answer(self.op, results, message, **fields), self.timings)

    def checks_change(self, expect: Expectation) -> bool:
        """Whether this operation's targets must show changed weights afterwards (``--verify-updates changed``)."""
        return self.ctx.verify_updates == "changed" and self.op.loads_weights and expect.change == "changed"

    async def read_digests(self, workers: Sequence[Worker], headers: dict[str, str]) -> dict[str, Digest]:
        """Each worker's weights' digest (:func:`~router.gateway.admin.verify.read_digests`), timed as verification."""
        with self.timings.phase("verification"):
            return await read_digests(self.ctx.fanout, workers, headers)

    async def verify(
        self,
        results: Sequence[WorkerResult[Resp]],
        expect: Expectation,
        before: Mapping[str, Digest] | None,
        headers: dict[str, str],
        *,
        reported: Mapping[str, Digest] | None = None,
    ) -> dict[str, Any]:
        """Fail each target that answered the weight change but does not hold what it should (:mod:`.verify`);
        the answer's fields that say so (each target's ``digests``), or none when nothing was to be checked.

        ``reported``: each target's digest as its answer said it, in the caller's scheme (the two-phase
        complete's checksum of what it applied); the caller's digest is compared with it instead of the
        engine checker's, which only shows a change."""
        if not self.op.changes_weights or (expect.checksum is None and before is None):
            return {}
        answered = [w for w in (self.ctx.registry.find(r.worker) for r in results if r.success) if w is not None]
        if reported is None:
            read = await self.read_digests(answered, headers)
            judge_digests(results, read, expect, before)
            return {"digests": digests_view(read)}
        judge_digests(results, reported, expect, None)
        if before is not None and expect.change == "changed":
            # The engine's checker, before and after, shows the change (no digest expected of it).
            judge_digests(results, await self.read_digests(answered, headers), NOTHING_SAID, before)
        return {"digests": digests_view(reported)}

    async def record_weight_change(
        self,
        targets: Sequence[Worker],
        results: Sequence[WorkerResult[WireResponse]],
        *,
        source_path: str | None = None,
        relabel_of: Collection[str] | None = None,
    ) -> None:
        """After a weight change (timed as this operation's ``verification``): the targets that succeeded now
        hold a new fleet version (read back from them); targets that failed are pending until an update brings
        them there, and workers the change did not target keep the version they held (one version staler).
        ``source_path``: the checkpoint the change loaded (:func:`~router.gateway.fleet.weights.checkpoint_of`);
        ``relabel_of``: see :meth:`~router.gateway.fleet.weights.FleetWeights.changed`."""
        with self.timings.phase("verification"):
            succeeded = {r.worker for r in results if r.success}
            done = [w for w in targets if w.id in succeeded]
            if done:
                await self.ctx.refresh_versions(done)
                checksum = agreed_checksum(r.body for r in results if r.success)
                targeted = {w.id for w in targets}
                await self.ctx.registry.fleet.changed(
                    ((w.id, w.weights) for w in done),
                    targets=targeted,
                    checksum=checksum,
                    bystanders=((w.id, w.weights) for w in self.ctx.registry if w.id not in targeted and not w.is_dead),
                    source_path=source_path,
                    relabel_of=relabel_of,
                )

    def _fail_departed(self, results: Sequence[WorkerResult[WireResponse]]) -> None:
        """A target whose pod left the fleet during the update did not succeed, whatever it answered."""
        for r in results:
            worker = self.ctx.registry.find(r.worker)
            if r.success and worker is not None and worker.departed is not None:
                r.success = False
                r.error = f"its pod left the fleet during {self.op.path} ({worker.departed})"

    def keep_lock(self) -> LockHold:
        """Hand the lock to a held update: this run ends without releasing it."""
        if self._lock is None:
            raise RuntimeError(f"{self.name} holds no lock to keep")
        self._kept = True
        return self._lock

    def end(self) -> None:
        """Release the lock (unless kept) and record the metrics; the only place an operation does either."""
        if self._ended:
            return
        self._ended = True
        if self._lock is not None and not self._kept:
            self._lock.release()
        timings = self.timings
        timings.finish()
        seconds = timings.seconds()
        self.ctx.metrics.observe_admin(self.name, self.outcome, seconds["total"], seconds)
        if self.op.changes_weights and self._sent:
            self.ctx.last_update = LastUpdate(
                operation=self.name,
                operation_id=self.id,
                outcome=self.outcome,
                ended_at=time.time(),
                timings=timings.milliseconds(),
            )
        if self._sent:
            log.info(
                "admin %s %s: %s in %.0f ms (%s)",
                self.id,
                self.name,
                self.outcome,
                seconds["total"] * 1000.0,
                timings.log_fields(),
            )


async def _undo(fence: Fence, written: asyncio.Future[None]) -> None:
    """The fence did not hold everywhere: nothing was sent. Every target back as it was, the journal cleared
    (once its write is over: it may have been made durable meanwhile)."""
    try:
        await written
    except BaseException:
        fence.put_back()
        return
    await fence.succeed()
