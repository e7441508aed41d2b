"""The trainer's whole weight-sync cycle through one router URL.

    group init (when the group is new or the fleet outgrew it) -> pause -> prepare -> broadcast -> complete -> verify -> continue

The tensors themselves never pass through here: the caller supplies
``broadcast(bucket_index)``, which sends one bucket over the process group
(:class:`~router.trainer.sender.TrainerWeightSender`), and, for the first sync,
``GroupSpec.join(world_size)``, which creates the trainer's rank-0 side of the
group. Both run on the calling thread; HTTP calls that must be in flight at
the same time (group init, single-phase updates) run on a background thread.

Failure handling, by stage:
- init, pause or prepare fails: no weights changed; generation is resumed
  (if it was paused) and :class:`SyncError` is raised.
- broadcast, complete or verify fails: the fleet's weights are uncertain;
  generation stays paused, the router keeps disabled every worker that cannot
  vouch for its weights (an atomic update dropped before complete changes
  nothing, so those workers come back), and :class:`SyncError` carries the
  per-worker results.

A failure at prepare, broadcast or complete also leaves the group out of
lockstep (a worker whose prepared receive was dropped, or that missed part of a
broadcast, refuses the group from then on), so the group is rebuilt: a prepared
update the router may still hold (broadcast failed after a ready prepare) is
ended with ``/abort_weights_update`` rather than left to expire with the admin
lock held; the workers leave the group (``/destroy_weights_update_group``); the
trainer leaves it (``GroupSpec.leave``); and the client forgets it, so the next
sync initializes it again. Each of these is best effort; what was done is in
:attr:`SyncError.recovery` and the log. Verify and continue failures keep the
group: every broadcast matched.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

from pydantic import BaseModel, Field

from router.contract import endpoints as ep
from router.contract.budget import HOP_MARGIN_S
from router.contract.endpoint import Endpoint
from router.contract.fleet_answers import CompleteFleetAnswer, GroupInitFleetAnswer, WorkerResult
from router.contract.weight_sync import DEFAULT_GROUP_NAME, BucketMetadata
from router.trainer.calls import RouterCallError, RouterCalls
from router.trainer.rendezvous import alongside

log = logging.getLogger(__name__)

Progress = Callable[[str, dict[str, Any]], None]


class SyncError(RuntimeError):
    """A sync stage failed. ``results`` holds the router's per-worker results when it gave any."""

    def __init__(self, stage: str, message: str, *, cause: BaseException | None = None, weights_uncertain: bool):
        self.stage = stage
        self.cause = cause
        self.weights_uncertain = weights_uncertain
        self.results: list[WorkerResult[Any]] = cause.results if isinstance(cause, RouterCallError) else []
        self.recovery: dict[str, str] = {}
        """What the client did to the group after this failure, step -> outcome
        (``abort_weights_update``, ``destroy_weights_update_group``, ``leave``); empty when nothing."""
        super().__init__(f"weight sync failed at {stage}: {message}")


@dataclass
class GroupSpec:
    """Where the weight-update group meets, and how the trainer joins and leaves it as rank 0.

    ``join(world_size)`` is called whenever the group is (re)initialized: on the
    first sync, and on the sync after one that failed past the join. ``leave()``
    closes the trainer's side (e.g. ``TrainerWeightSender.close``) when such a
    failure tears the group down, so that the next ``join`` starts clean.
    """

    master_address: str
    master_port: int
    join: Callable[[int], None]
    group_name: str = DEFAULT_GROUP_NAME
    backend: str | None = None
    timeout_s: float | None = None
    leave: Callable[[], None] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    """Set the moment the router refuses the group init: a ``join`` that watches it
    (``TrainerWeightSender.join(cancel=group.cancel)``) gives up at once instead of
    waiting out its timeout for workers that will not come."""


class SyncReport(BaseModel):
    """What one :meth:`WeightSync.run` did (``model_dump(mode="json")`` for a log line or a file)."""

    protocol: str
    num_buckets: int
    weight_version: str | None
    world_size: int | None
    seconds: float = 0.0
    stage_seconds: dict[str, float] = Field(default_factory=dict)
    checksums: dict[str, str | None] = Field(default_factory=dict)
    """Each worker's checksum of the weights it holds (engine-level, from the verify step)."""
    rank_checksums: dict[str, list[str]] = Field(default_factory=dict)
    """Each worker's per-rank checksums from the verify step (what ``expected_checksum`` is compared with)."""
    fleet_identical: bool | None = None
    matches_expected: bool | None = None
    group_init: GroupInitFleetAnswer | None = None
    """The router's answer to the group init (per-worker ``ranks``), on the sync that created the group."""
    group_rebuilt: str | None = None
    """Why this sync rebuilt the group first (the fleet changed since it was built), if it did."""


def _log_progress(stage: str, info: dict[str, Any]) -> None:
    log.info("weight sync: %s %s", stage, info)


def _guard_s(endpoint: Endpoint[Any, Any], timeout_s: float | None, client: RouterCalls) -> float:
    """How long to wait for a background call: a guard only, since the call's own HTTP timeout (after the
    tries through a failover of the router's leader, if any) fires first."""
    wait = endpoint.budget.client_wait(timeout_s, lock_wait_s=client.lock_wait_s)
    return wait + client.failover_budget_s + HOP_MARGIN_S


class WeightSync:
    """One configured sync; :meth:`run` performs it. Joined groups are remembered per client
    (``client.joined_groups``)."""

    def __init__(
        self,
        client: RouterCalls,
        *,
        group: GroupSpec,
        protocol: Literal["two_phase", "single_phase"] = "two_phase",
        load_format: str | None = None,
        weight_version: str | None = None,
        pause_mode: Literal["abort", "retract", "in_place"] = "retract",
        atomic: bool | None = None,
        timeout_s: float | None = None,
        verify: bool = True,
        expected_checksum: str | None = None,
        progress: Progress | None = None,
    ):
        if protocol not in ("two_phase", "single_phase"):
            raise ValueError(f"protocol must be 'two_phase' or 'single_phase', got {protocol!r}")
        self.client = client
        self.group = group
        self.protocol = protocol
        self.load_format = load_format
        self.weight_version = weight_version
        self.pause_mode = pause_mode
        self.atomic = atomic
        self.timeout_s = timeout_s
        self.verify = verify
        self.expected_checksum = expected_checksum
        self.progress = progress or _log_progress
        self._stages: dict[str, float] = {}
        self._group_init: GroupInitFleetAnswer | None = None
        self._rebuild_reason: str | None = None
        # From a ready prepare until the router has answered complete: the router holds a
        # prepared update (and its admin lock) for this group.
        self._router_holds_update = False

    # ------------------------------------------------------------------ stages

    def _stage(self, name: str, fn: Callable[[], Any], *, uncertain: bool) -> Any:
        start = time.perf_counter()
        self.progress(name, {"state": "start"})
        try:
            value = fn()
        except RouterCallError as exc:
            raise SyncError(name, exc.message, cause=exc, weights_uncertain=uncertain) from exc
        except SyncError:
            raise
        except Exception as exc:  # the caller's broadcast or join
            raise SyncError(name, f"{type(exc).__name__}: {exc}", cause=exc, weights_uncertain=uncertain) from exc
        self._stages[name] = round(time.perf_counter() - start, 4)
        self.progress(name, {"state": "done", "seconds": self._stages[name]})
        return value

    def ensure_group(self) -> int | None:
        """Initialize the group unless it exists and still matches the fleet; returns the new world size.

        A group the router reports as outgrown (a worker joined, left, died or
        restarted since it was built), or no longer knows, is torn down and built
        again with the fleet's current world size, so a trainer loop survives
        scale-up and pod restarts unchanged.
        """
        joined = self.client.joined_groups
        g = self.group
        fleet = self.client.get_world_size()
        if g.group_name in joined:
            view = fleet.group(g.group_name)
            if view is not None and view.matches_fleet:
                return None
            why = "; ".join(view.changes) if view is not None else "the router has no record of it"
            self._rebuild_reason = why
            left: dict[str, str] = {}
            self._leave_group(left)
            log.warning(
                "weight-update group %r no longer matches the fleet (%s): left it (%s), rebuilding",
                g.group_name,
                why,
                left,
            )
        elif fleet.group(g.group_name) is not None:
            # The router still records a group of this name that this client does not hold: a trainer process
            # that restarted, or a failed sync whose clean-up was refused while its journal entry was pending.
            # Its workers still hold it and would refuse to build one of the same name: they leave it first.
            outcome = _attempt(lambda: self.client.destroy_weights_update_group(g.group_name))
            log.warning(
                "weight-update group %r left over on the workers: left it (%s), rebuilding", g.group_name, outcome
            )
        world = fleet.world_size + 1
        g.cancel.clear()
        self._group_init = alongside(
            lambda: self.client.init_weights_update_group(
                g.master_address,
                g.master_port,
                world,
                group_name=g.group_name,
                backend=g.backend,
                timeout_s=g.timeout_s,
            ),
            lambda: g.join(world),
            timeout_s=_guard_s(ep.INIT_WEIGHTS_UPDATE_GROUP, g.timeout_s, self.client),
            what="/init_weights_update_group",
            remote_failed=g.cancel,
        )
        joined.add(g.group_name)
        return world

    def _single_phase(self, buckets: Sequence[BucketMetadata], broadcast: Callable[[int], None]) -> None:
        guard = _guard_s(ep.UPDATE_WEIGHTS_FROM_DISTRIBUTED, self.timeout_s, self.client)
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            alongside(
                partial(
                    self.client.update_weights_from_distributed,
                    bucket,
                    group_name=self.group.group_name,
                    load_format=self.load_format,
                    weight_version=self.weight_version if last else None,
                    flush_cache=last,
                    timeout_s=self.timeout_s,
                ),
                partial(broadcast, i),
                timeout_s=guard,
                what=f"update_weights_from_distributed of bucket {i}",
                settle_on_failure=False,
            )
            self.progress("bucket", {"index": i, "of": len(buckets)})

    def _two_phase_send(self, n: int, broadcast: Callable[[int], None]) -> None:
        for i in range(n):
            broadcast(i)
            self.progress("bucket", {"index": i, "of": n})

    # ------------------------------------------------------------------ the cycle

    def run(self, buckets: Sequence[BucketMetadata], broadcast: Callable[[int], None]) -> SyncReport:
        start = time.perf_counter()
        # A model passes as it is; an untyped caller's dict (the shape the wire takes) is still validated into one.
        metas = [BucketMetadata.model_validate(b) for b in buckets]
        world = self._stage("init_group", self.ensure_group, uncertain=False)
        self._stage("pause", lambda: self.client.pause_generation(self.pause_mode), uncertain=False)
        try:
            complete = self._update(metas, broadcast)
        except SyncError as exc:
            self._rebuild_group_after(exc)
            if not exc.weights_uncertain:
                self._resume_after_clean_failure()
            raise
        report = SyncReport(
            protocol=self.protocol,
            num_buckets=len(metas),
            weight_version=self.weight_version,
            world_size=world,
            stage_seconds=self._stages,
            group_init=self._group_init,
            group_rebuilt=self._rebuild_reason,
        )
        if complete is not None:
            report.checksums = dict(complete.checksums)
        if self.verify:
            self._stage("verify", lambda: self._verify(report, complete), uncertain=True)
        self._stage("continue", self.client.continue_generation, uncertain=True)
        report.seconds = round(time.perf_counter() - start, 4)
        return report

    def _update(
        self, buckets: Sequence[BucketMetadata], broadcast: Callable[[int], None]
    ) -> CompleteFleetAnswer | None:
        """prepare -> broadcast -> complete (two phase; returns complete's answer) or the single-phase calls."""
        if self.protocol == "single_phase":
            self._stage("broadcast", lambda: self._single_phase(buckets, broadcast), uncertain=True)
            return None
        prepare = partial(
            self.client.prepare_weights_update,
            buckets,
            group_name=self.group.group_name,
            load_format=self.load_format,
            weight_version=self.weight_version,
            atomic=self.atomic,
            timeout_s=self.timeout_s,
        )
        self._stage("prepare", lambda: self._prepared_call(prepare, holds=True), uncertain=False)
        self._stage("broadcast", lambda: self._two_phase_send(len(buckets), broadcast), uncertain=True)
        complete = partial(
            self.client.complete_weights_update,
            group_name=self.group.group_name,
            weight_version=self.weight_version,
            return_checksum=self.verify or None,
            timeout_s=self.timeout_s,
            # The router then publishes the update only if every worker holds these weights.
            expected_checksum=self.expected_checksum,
        )
        answer: CompleteFleetAnswer = self._stage(
            "complete", lambda: self._prepared_call(complete, holds=False), uncertain=True
        )
        return answer

    def _prepared_call(self, call: Callable[[], Any], *, holds: bool) -> Any:
        """Prepare (``holds``) or complete, tracking whether the router may hold a prepared update."""
        try:
            answer = call()
        except RouterCallError as exc:
            # An answer means the router decided: a failed prepare releases everything,
            # and complete ends the prepared update whatever its outcome. No answer
            # (refused, timed out) leaves it unknown: the update may still be held.
            self._router_holds_update = exc.status is None
            raise
        self._router_holds_update = holds
        return answer

    def _leave_group(self, done: dict[str, str]) -> None:
        """The workers and the trainer leave the group and the client forgets it (best effort, recorded in ``done``)."""
        g = self.group
        done["destroy_weights_update_group"] = _attempt(lambda: self.client.destroy_weights_update_group(g.group_name))
        if g.leave is not None:
            done["leave"] = _attempt(g.leave)
        self.client.joined_groups.discard(g.group_name)

    def _rebuild_group_after(self, error: SyncError) -> None:
        """End the router's prepared update, have everyone leave the group, forget it (best effort, recorded)."""
        g, done = self.group, error.recovery
        if self._router_holds_update:
            done["abort_weights_update"] = _attempt(lambda: self.client.abort_weights_update(g.group_name))
            self._router_holds_update = False
        self._leave_group(done)
        log.warning(
            "weight sync failed at %s; group %r torn down, the next sync initializes it again: %s",
            error.stage,
            g.group_name,
            done,
        )

    def _verify(self, report: SyncReport, complete: CompleteFleetAnswer | None) -> None:
        """The workers hold what the trainer sent: read back with ``/weights_checker``, or, for a fleet with
        workers that cannot read their weights back in the trainer's scheme (vLLM's are re-laid-out as they
        load), the checksums each rank reported of what it loaded (``complete`` with ``return_checksum``)."""
        try:
            checked = self.client.weights_checker("checksum")
        except RouterCallError as exc:
            if complete is None or not _unserved(exc):
                raise
            report.rank_checksums = ranks = _applied_checksums(complete)
            report.fleet_identical = (
                bool(ranks) and all(ranks.values()) and len({frozenset(v) for v in ranks.values()}) == 1
            )
        else:
            report.checksums = dict(checked.worker_checksums) or report.checksums
            report.rank_checksums = ranks = {w: list(v) for w, v in checked.rank_checksums.items()}
            report.fleet_identical = bool(checked.identical)
        if not report.fleet_identical:
            raise SyncError("verify", f"workers hold different weights: {report.checksums}", weights_uncertain=True)
        if self.expected_checksum is not None:
            report.matches_expected = bool(ranks) and all(set(v) == {self.expected_checksum} for v in ranks.values())
            if not report.matches_expected:
                raise SyncError(
                    "verify", f"rank checksums {ranks} != trainer's {self.expected_checksum}", weights_uncertain=True
                )

    def _resume_after_clean_failure(self) -> None:
        try:
            self.client.continue_generation()
        except RouterCallError as exc:
            log.warning("could not resume generation after a failed sync: %s", exc)


def _unserved(exc: RouterCallError) -> bool:
    """The router refused the call because some worker's engine does not serve it (nothing was sent)."""
    return exc.status == 400 and exc.error is not None and "unserved" in (exc.error.model_extra or {})


def _applied_checksums(complete: CompleteFleetAnswer) -> dict[str, list[str]]:
    """Each worker's per-rank checksums of the weights it applied, as its complete reported them."""
    applied: dict[str, list[str]] = {}
    for result in complete.results:
        body = result.body
        if body is None:
            applied[result.worker] = []
        elif body.rank_checksums:
            applied[result.worker] = [r.checksum for r in body.rank_checksums]
        else:
            applied[result.worker] = [body.checksum] if body.checksum else []
    return applied


def _attempt(fn: Callable[[], Any]) -> str:
    """Run one clean-up step; its outcome as a line, never an exception (the sync's error is what counts)."""
    try:
        answer = fn()
    except RouterCallError as exc:
        return f"failed: {exc}"
    except Exception as exc:
        return f"failed: {type(exc).__name__}: {exc}"
    message = getattr(answer, "message", None)
    return f"ok: {message}" if message and message != "ok" else "ok"
