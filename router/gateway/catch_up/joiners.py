"""Late joiners catch up from a peer (``--sync-joiners peer``): a pending worker loads the fleet's weights
from a worker that verifiably holds them, then takes traffic, without waiting for the trainer's next sync.

Who qualifies (:meth:`JoinerSync.eligible`): a worker that is healthy, not disabled (an operator's flag
or a fence), not removed or departed, whose weights are whole (``serving``: not ``partial``,
``writing`` or ``released``, which need the trainer's full rewrite or a resume), whose process is known
(``instance_id``), which no broadcast holds, which no unresolved journal entry names (its weights are
uncertain until an operator vouches for them), and which holds no recorded fleet entry: it joined or
restarted since the last weight change, or its label changed behind the router. Loading the latest
entry's weights repairs each of those. A worker that holds an *older* entry (left behind by a targeted
update) is stale, not pending, and is left where the caller put it. Nothing happens before the first
weight change through the router (there is no record: every worker's boot weights are the fleet's).

One catch-up, in order::

    pick a source      a routable worker verified on the latest entry, not the joiner; the least loaded,
                       one that has not failed this joiner first
    take the lock      the admin update lock, waiting at most LOCK_WAIT_S: a fleet update in progress
                       wins, the catch-up is tried again on a later scan (an update that arrives during
                       a catch-up waits for it, within its own --admin-lock-timeout-s)
    check again        eligibility, the latest entry and the source's holding, under the lock
    load               POST /update_weights_from_peer on the joiner (source_url, the latest label, the
                       entry's checksum when recorded), bounded by the endpoint's budget
    verify             success; weight_version is the fleet's label; source_instance_id is the process the
                       router recorded as the holder; the checksum equals the entry's when recorded; the
                       joiner's metadata read again shows the same process serving that label, whole
    record             FleetWeights.caught_up: the joiner holds the latest entry (refused when the fleet
                       moved on), so it becomes routable; data planes follow with the next snapshot

A joiner that cannot load from a peer (vLLM and SGLang serve no peer route this router drives) loads the
fleet's checkpoint instead, when the fleet's weights came from one (:mod:`.from_path`), and is checked
against a holder of the same engine before it is recorded.

Invariants: the joiner receives no traffic before it is recorded (it is pending throughout, and
the router records it only after the verification above); a failed load leaves its old weights (the
sink is atomic) and it stays pending with the reason in ``GET /workers`` (``catch_up``); nothing is
journalled or fenced, because a joiner that is not recorded is never routed to whatever it holds.
Failures back off exponentially per worker (:func:`~router.gateway.catch_up.scan.backoff_s`), reset
when its process changes. With ``--max-rejoin-attempts K`` a worker process whose K-th catch-up failed is
*retired*: not tried again, pending (so out of routing), its ``catch_up`` saying why (``retired after K failed
catch-up attempts: <the last error>``) in ``GET /workers`` and ``omni-router status``. A replica that keeps
failing to load stops taking the update lock and a source's bandwidth every back-off. Retirement lasts as long
as the process: a restart (a new ``instance_id``) counts from zero again, and so does a worker that an update
brought to recorded weights meanwhile (it needs no catch-up any more); being unhealthy, fenced or held by an
update for a while does not end it. One catch-up runs at a time fleet-wide: each holds the update lock,
and a source streams its whole model to one sink at once. It runs only in the control process (the
app of :func:`~router.gateway.app.create_app`) and, with ``--leader-election``, only while this
replica's gate is open: a standby changes no worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Self

from aiohttp import web
from pydantic import ValidationError

from router.contract import endpoints as ep
from router.contract.fleet import CatchUpStatus
from router.contract.peer import UpdateWeightsFromPeerRequest, UpdateWeightsFromPeerResult
from router.gateway import keys
from router.gateway.admin.locked import AdminContext
from router.gateway.catch_up import from_path
from router.gateway.catch_up.scan import Backoff, ScanLoop, Tries
from router.gateway.catch_up.scan import backoff_s as backoff_s  # part of this module's interface
from router.gateway.engines import engine_of, serves
from router.gateway.engines.base import EngineCall
from router.gateway.fleet.registry import Worker
from router.gateway.fleet.weights import FleetWeights
from router.gateway.leader.gate import LeaderGate
from router.gateway.tasks import running
from router.gateway.upstream import WorkerClient

log = logging.getLogger(__name__)

#: ``holder`` of the update lock while a catch-up holds it (in a 503 another operation gets).
LOCK_HOLDER = "catch-up from a peer"


class CatchUpFailed(Exception):
    """One catch-up failed; the message says why (shown in ``GET /workers``)."""


class NothingToDo(Exception):
    """Under the lock the worker no longer qualifies (the fleet moved it, or it changed): no attempt is counted."""


@dataclass(slots=True, kw_only=True)
class _Tries(Tries):
    """A worker's failed attempts, for the process they were made on, and the sources that failed it."""

    instance_id: str | None
    failed_sources: set[str] = field(default_factory=set)


def retired_detail(attempts: int, last_error: str) -> str:
    """Why a retired worker is no longer caught up, as ``GET /workers`` and ``omni-router status`` say it."""
    return f"retired after {attempts} failed catch-up attempts: {last_error}"


class JoinerSync(ScanLoop):
    """The scan loop and one catch-up at a time (see the module docstring)."""

    scan_name = "catch-up scan"
    lock_holder = LOCK_HOLDER
    _backoff: Backoff[_Tries]

    def __init__(
        self,
        ctx: AdminContext,
        workers: WorkerClient,
        *,
        headers: dict[str, str],
        leader: LeaderGate | None = None,
        max_attempts: int | None = None,
    ):
        """``max_attempts``: failed catch-ups after which a worker process is retired (``None``: never)."""
        super().__init__(ctx, workers, headers=headers, leader=leader)
        self._backoff.limit = max_attempts

    @classmethod
    def from_app(cls, app: web.Application) -> Self:
        """The loop over the app's fleet, retiring a worker after ``--max-rejoin-attempts`` failures."""
        sync = super().from_app(app)
        sync._backoff.limit = app[keys.CONFIG].max_rejoin_attempts
        return sync

    def new_backoff(self) -> Backoff[_Tries]:
        # The wall clock: a failed catch-up's next try is shown in ``GET /workers`` as a time of day.
        return Backoff(lambda worker: _Tries(instance_id=worker.instance_id), clock=time.time)

    def retired(self, worker: Worker) -> bool:
        """Whether ``worker``'s process used up its catch-ups. A retirement ends (is forgotten) once the worker
        runs another process or holds recorded weights: then it is looked at afresh."""
        tries = self._backoff.get(worker.id)
        if tries is None or not self._backoff.exhausted(worker.id):
            return False
        restarted = worker.instance_id is not None and worker.instance_id != tries.instance_id
        if not restarted and self._ctx.registry.fleet.verified_sequence(worker.id, worker) is None:
            return True
        self._backoff.forget(worker.id)
        worker.catch_up = None
        log.info(
            "worker %s %s: its catch-ups are counted from zero again",
            worker.id,
            f"restarted (process {worker.instance_id})" if restarted else "holds recorded weights",
        )
        return False

    def eligible(self, worker: Worker) -> bool:
        """Whether ``worker`` is pending for want of the fleet's latest weights and may load them."""
        registry = self._ctx.registry
        fleet = registry.fleet
        if fleet.record is None:
            return False
        if worker.health != "healthy" or worker.disabled or worker.removed or worker.departed is not None:
            return False
        if worker.weight_state != "serving" or worker.instance_id is None or worker.update_holds > 0:
            return False
        if self._ctx.journal.names(worker.id):
            return False
        return fleet.verified_sequence(worker.id, worker) is None

    def holders(self, joiner: Worker) -> list[Worker]:
        """Routable holders of the latest entry other than ``joiner``: untried first, then the least loaded."""
        registry = self._ctx.registry
        fleet = registry.fleet
        tried = self._backoff.get(joiner.id)
        failed = tried.failed_sources if tried is not None else set()
        found = [
            w
            for w in registry.workers()
            if w.id != joiner.id
            and registry.is_routable(w)
            and fleet.verified_sequence(w.id, w) == fleet.latest_sequence
        ]
        return sorted(found, key=lambda w: (w.id in failed, w.inflight + w.inflight_elsewhere))

    def sources(self, joiner: Worker) -> list[Worker]:
        """The holders ``joiner`` can load from as a peer: both serve the peer routes (omni-worker's)."""
        if not serves(joiner, ep.UPDATE_WEIGHTS_FROM_PEER.path):
            return []
        return [w for w in self.holders(joiner) if (engine := engine_of(w)) is not None and engine.peer_source]

    def path_plan(self, joiner: Worker) -> list[EngineCall] | None:
        """How ``joiner`` loads the fleet's weights from their checkpoint when no peer can give them."""
        record = self._ctx.registry.fleet.record
        return None if record is None else from_path.steps(joiner, record.latest)

    async def scan(self) -> None:
        """Catch up the first worker whose turn it is."""
        if self.standby:
            return
        now = self._backoff.now()
        for worker in self._ctx.registry:
            if self.retired(worker):
                continue  # kept whatever it is now: a process that used up its attempts is not tried again
            if not self.eligible(worker):
                self._backoff.forget(worker.id)
                worker.catch_up = None
                continue
            tries = self._backoff.get(worker.id)
            if tries is not None and tries.instance_id != worker.instance_id:
                self._backoff.restart(worker)
            if not self._backoff.due(worker.id, now):
                continue
            sources = self.sources(worker)
            if sources:
                await self.catch_up(worker, sources[0])
                return  # one at a time: the next scan takes the next worker
            if self.path_plan(worker) is not None:
                await self.catch_up(worker, None)
                return

    async def catch_up(self, joiner: Worker, source: Worker | None) -> bool:
        """Load ``joiner`` from ``source`` (``None``: from the fleet's checkpoint) and record it; False (with the
        reason kept) when it did not."""
        lock = await self.take_lock()
        if lock is None:
            return False  # a fleet update holds the lock: it may move the fleet on; look again next scan
        started = time.perf_counter()
        outcome, copied = "failure", 0
        tries = self._backoff.entry(joiner)
        try:
            if source is None:
                await self._load_path(joiner, tries.attempts)
            else:
                copied = await self._load(joiner, source, tries.attempts)
            outcome = "success"
        except NothingToDo:
            outcome = "skipped"
            joiner.catch_up = None
        except CatchUpFailed as exc:
            self._backoff.failed(joiner, tries.attempts)
            if source is not None:
                tries.failed_sources.add(source.id)
            self._failed(joiner, source, tries, str(exc))
        finally:
            lock.release()
            seconds = time.perf_counter() - started
            self._ctx.metrics.observe_catch_up(outcome, seconds)
        if outcome == "success":
            self._backoff.forget(joiner.id)
            joiner.catch_up = None
            log.info(
                "worker %s (%s) caught up from %s: weight_version %r, %d bytes in %.2fs",
                joiner.id,
                joiner.url,
                f"{source.id} ({source.url})" if source is not None else "the fleet's checkpoint",
                joiner.weight_version,
                copied,
                seconds,
            )
        return outcome == "success"

    def _failed(self, joiner: Worker, source: Worker | None, tries: _Tries, error: str) -> None:
        """Show a failed catch-up in the joiner's ``catch_up``: retried later, or retired at the limit."""
        retired = self._backoff.exhausted(joiner.id)
        joiner.catch_up = CatchUpStatus(
            state="retired" if retired else "failed",
            source=source.id if source is not None else None,
            attempts=tries.attempts,
            last_error=error,
            next_try_at=None if retired else tries.next_try_at,
            detail=retired_detail(tries.attempts, error) if retired else None,
        )
        origin = source.id if source is not None else "the fleet's checkpoint"
        if retired:
            log.error(
                "catch-up of worker %s from %s failed (attempt %d): retired, not tried again until it restarts: %s",
                joiner.id,
                origin,
                tries.attempts,
                error,
            )
            return
        log.warning(
            "catch-up of worker %s from %s failed (attempt %d, next in %.0fs): %s",
            joiner.id,
            origin,
            tries.attempts,
            tries.next_try_at - time.time(),
            error,
        )

    async def _load(self, joiner: Worker, source: Worker, attempts: int) -> int:
        """Under the lock: check again, load, verify, record; the bytes copied, or :class:`CatchUpFailed`."""
        fleet = self._ctx.registry.fleet
        record = fleet.record
        if record is None or not self.eligible(joiner):
            raise NothingToDo
        holder = record.holders.get(source.id)
        if (
            holder is None
            or not self._ctx.registry.is_routable(source)
            or fleet.verified_sequence(source.id, source) != record.latest.sequence
        ):
            raise NothingToDo  # the source left or fell behind: the next scan picks another
        entry = record.latest
        instance = joiner.instance_id
        try:
            request = UpdateWeightsFromPeerRequest(
                source_url=source.url, weight_version=entry.weight_version, checksum=entry.checksum
            )
        except ValidationError as exc:
            raise CatchUpFailed(f"cannot ask for the fleet's weights: {exc.errors()[0]['msg']}") from None
        joiner.catch_up = CatchUpStatus(state="copying", source=source.id, attempts=attempts)
        joiner.update_holds += 1  # a slow probe while it loads is not a failure; metadata is read below
        try:
            answer = await self._workers.call(joiner.url, ep.UPDATE_WEIGHTS_FROM_PEER, request, headers=self._headers)
        finally:
            joiner.update_holds -= 1
        body = answer.value
        if body is None or not body.success:
            raise CatchUpFailed(f"{ep.UPDATE_WEIGHTS_FROM_PEER.path} failed: {_why(answer.error, answer.body)}")
        _verify(body, entry.weight_version, holder.instance_id, entry.checksum)
        if not await self._ctx.prober.refresh_metadata(joiner):
            raise CatchUpFailed("it did not answer /model_info after the load")
        if joiner.instance_id != instance:
            raise CatchUpFailed("its process changed during the load")
        await _record(fleet, joiner, entry.sequence)
        return body.bytes_received

    async def _load_path(self, joiner: Worker, attempts: int) -> None:
        """Under the lock: check again, load the fleet's checkpoint, verify, record (:mod:`.from_path`)."""
        fleet = self._ctx.registry.fleet
        record = fleet.record
        plan = self.path_plan(joiner)
        if record is None or plan is None or not self.eligible(joiner):
            raise NothingToDo
        entry = record.latest
        instance = joiner.instance_id
        joiner.catch_up = CatchUpStatus(state="copying", source=None, attempts=attempts)
        joiner.update_holds += 1  # a slow probe while it loads is not a failure; metadata is read below
        try:
            await from_path.load(self._workers, joiner, plan, self._headers)
        except from_path.PathLoadFailed as exc:
            raise CatchUpFailed(f"loading {entry.source_path}: {exc}") from None
        finally:
            joiner.update_holds -= 1
        if not await self._ctx.prober.refresh_metadata(joiner):
            raise CatchUpFailed("it did not answer its metadata routes after the load")
        if joiner.instance_id != instance:
            raise CatchUpFailed("its process changed during the load")
        if entry.weight_version is not None and joiner.weight_version != entry.weight_version:
            raise CatchUpFailed(
                f"it serves {joiner.weight_version!r} after the load, the fleet {entry.weight_version!r}"
            )
        for holder in self.holders(joiner):
            same = await from_path.same_weights(self._workers, joiner, holder, self._headers)
            if same is False:
                raise CatchUpFailed(f"its checksums differ from {holder.id}'s, which holds the fleet's weights")
            if same:
                break
        await _record(fleet, joiner, entry.sequence)


def _why(error: str | None, body: UpdateWeightsFromPeerResult | None) -> str:
    if error:
        return error
    return body.message if body is not None and body.message else "no usable answer"


def _verify(body: UpdateWeightsFromPeerResult, label: str | None, holder: str, checksum: str | None) -> None:
    """The answer says the joiner loaded the fleet's label, from the recorded holder, with its checksum."""
    if label is not None and body.weight_version != label:
        raise CatchUpFailed(f"it loaded weight_version {body.weight_version!r}, the fleet's is {label!r}")
    if body.source_instance_id != holder:
        raise CatchUpFailed(
            f"the weights came from process {body.source_instance_id!r}, the recorded holder is {holder!r}"
        )
    if checksum is not None and body.checksum != checksum:
        raise CatchUpFailed(f"it loaded checksum {body.checksum!r}, the fleet's is {checksum!r}")


async def catch_up_ctx(app: web.Application) -> AsyncIterator[None]:
    """An aiohttp cleanup context: the scan loop for as long as the app runs (``--sync-joiners peer``)."""
    if app[keys.CONFIG].sync_joiners != "peer":
        yield
        return
    async with running(JoinerSync.from_app(app).run(), "catch-up-joiners"):
        yield


async def _record(fleet: FleetWeights, joiner: Worker, sequence: int) -> None:
    """Record ``joiner`` as a holder of entry ``sequence``, or :class:`CatchUpFailed`.

    The status is cleared in the same event-loop step that makes the joiner a holder (the record
    changes before the store is written), so ``GET /workers`` never shows a routable worker still
    "copying"; a refusal sets the failed status right after."""
    joiner.catch_up = None
    if not await fleet.caught_up(joiner.id, joiner.weights, sequence):
        raise CatchUpFailed(
            f"not recorded: the fleet moved past version {sequence}, or it reports "
            f"weight_version {joiner.weight_version!r} ({joiner.weight_state})"
        )
