"""The trainer's whole weight-sync cycle through one router URL.

    group init (once per group) -> pause -> prepare -> broadcast -> complete -> verify -> continue

The tensors themselves never pass through here: the caller supplies
``broadcast(bucket_index)``, which sends one bucket over the process group
(the torch sender lives with the worker package), and, for the first sync,
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
broadcast, refuses the group from then on), so the group is rebuilt: an update
session the router may still hold (broadcast failed after a ready prepare) is
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
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Literal, Sequence

from router.trainer.calls import RouterCallError, RouterCalls

log = logging.getLogger(__name__)

Progress = Callable[[str, dict[str, Any]], None]


class SyncError(RuntimeError):
    """A sync stage failed. ``results`` holds the router's per-worker results when it gave any."""

    def __init__(self, stage: str, message: str, *, cause: BaseException | None = None, weights_uncertain: bool):
        self.stage = stage
        self.cause = cause
        self.weights_uncertain = weights_uncertain
        self.results: list[dict[str, Any]] = cause.results if isinstance(cause, RouterCallError) else []
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
    group_name: str = "weight_update_group"
    backend: str | None = None
    timeout_s: float | None = None
    leave: Callable[[], None] | None = None


@dataclass
class SyncReport:
    protocol: str
    num_buckets: int
    weight_version: str | None
    world_size: int | None
    seconds: float
    stage_seconds: dict[str, float] = field(default_factory=dict)
    checksums: dict[str, Any] = field(default_factory=dict)
    rank_checksums: dict[str, list[str]] = field(default_factory=dict)
    """Each worker's per-rank checksums from the verify step (what ``expected_checksum`` is compared with)."""
    fleet_identical: bool | None = None
    matches_expected: bool | None = None
    group_init: Any = None
    """The router's answer to the group init (per-worker ``ranks``), on the sync that created the group."""


def _log_progress(stage: str, info: dict[str, Any]) -> None:
    log.info("weight sync: %s %s", stage, info)


class _Background:
    """A blocking router call on a daemon thread, so that the calling thread can meanwhile
    do its own part of the rendezvous the call waits on (join the group, send a bucket)."""

    def __init__(self, fn: Callable[[], Any]):
        self._value: Any = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._value = fn()
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller's thread
                self._error = exc

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def result(self, on_timeout: str) -> Any:
        """The call's answer once :meth:`wait` returned; its error, or ``TimeoutError(on_timeout)``, raised."""
        if self._error is not None:
            raise self._error
        if self._thread.is_alive():
            raise TimeoutError(on_timeout)
        return self._value


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
        pause_mode: str = "retract",
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
        self._group_init: Any = None
        # From a ready prepare until the router has answered complete: the router
        # holds an update session (and its admin lock) for this group.
        self._session_open = False

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
        joined = self.client.joined_groups
        if self.group.group_name in joined:
            return None
        world = int(self.client.get_world_size()["world_size"]) + 1
        g = self.group
        init = _Background(
            lambda: self.client.init_weights_update_group(
                g.master_address, g.master_port, world, group_name=g.group_name, backend=g.backend, timeout_s=g.timeout_s
            )
        )
        try:
            g.join(world)
        finally:
            init.wait((g.timeout_s or 900) + 120)
        self._group_init = init.result("router did not answer /init_weights_update_group in time")
        joined.add(g.group_name)
        return world

    def _single_phase(self, buckets: Sequence[dict[str, Any]], broadcast: Callable[[int], None]) -> None:
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            update = _Background(
                lambda b=bucket, last=last: self.client.update_weights_from_distributed(
                    b["names"], b["dtypes"], b["shapes"], group_name=self.group.group_name, load_format=self.load_format,
                    weight_version=self.weight_version if last else None, flush_cache=last, timeout_s=self.timeout_s,
                )
            )  # fmt: skip
            broadcast(i)
            update.wait((self.timeout_s or 1800) + 120)
            update.result(f"router did not answer update_weights_from_distributed for bucket {i}")
            self.progress("bucket", {"index": i, "of": len(buckets)})

    def _two_phase_send(self, n: int, broadcast: Callable[[int], None]) -> None:
        for i in range(n):
            broadcast(i)
            self.progress("bucket", {"index": i, "of": n})

    # ------------------------------------------------------------------ the cycle

    def run(self, buckets: Sequence[dict[str, Any]], broadcast: Callable[[int], None]) -> SyncReport:
        start = time.perf_counter()
        world = self._stage("init_group", self.ensure_group, uncertain=False)
        self._stage("pause", lambda: self.client.pause_generation(self.pause_mode), uncertain=False)
        try:
            complete = self._update(buckets, broadcast)
        except SyncError as exc:
            self._rebuild_group_after(exc)
            if not exc.weights_uncertain:
                self._resume_after_clean_failure()
            raise
        report = SyncReport(
            protocol=self.protocol, num_buckets=len(buckets), weight_version=self.weight_version,
            world_size=world, seconds=0.0, stage_seconds=self._stages, group_init=self._group_init,
        )  # fmt: skip
        if isinstance(complete, dict):
            report.checksums = dict(complete.get("checksums") or {})
        if self.verify:
            self._stage("verify", lambda: self._verify(report), uncertain=True)
        self._stage("continue", self.client.continue_generation, uncertain=True)
        report.seconds = round(time.perf_counter() - start, 4)
        return report

    def _update(self, buckets: Sequence[dict[str, Any]], broadcast: Callable[[int], None]) -> Any:
        """prepare -> broadcast -> complete (two phase; returns complete's answer) or the single-phase calls."""
        if self.protocol == "single_phase":
            self._stage("broadcast", lambda: self._single_phase(buckets, broadcast), uncertain=True)
            return None
        prepare = partial(
            self.client.prepare_weights_update, buckets, group_name=self.group.group_name,
            load_format=self.load_format, weight_version=self.weight_version, atomic=self.atomic, timeout_s=self.timeout_s,
        )  # fmt: skip
        self._stage("prepare", lambda: self._session_call(prepare, opens=True), uncertain=False)
        self._stage("broadcast", lambda: self._two_phase_send(len(buckets), broadcast), uncertain=True)
        complete = partial(
            self.client.complete_weights_update, group_name=self.group.group_name,
            weight_version=self.weight_version, return_checksum=self.verify or None, timeout_s=self.timeout_s,
        )  # fmt: skip
        return self._stage("complete", lambda: self._session_call(complete, opens=False), uncertain=True)

    def _session_call(self, call: Callable[[], Any], *, opens: bool) -> Any:
        """Prepare (``opens``) or complete, tracking whether the router may hold an update session."""
        try:
            answer = call()
        except RouterCallError as exc:
            # An answer means the router decided: a failed prepare releases everything,
            # and complete ends the session whatever its outcome. No answer (refused,
            # timed out) leaves it unknown: the session may be open.
            self._session_open = exc.status is None
            raise
        self._session_open = opens
        return answer

    def _rebuild_group_after(self, error: SyncError) -> None:
        """End the router's session, have everyone leave the group, forget it (best effort, recorded)."""
        g, done = self.group, error.recovery
        if self._session_open:
            done["abort_weights_update"] = _attempt(lambda: self.client.abort_weights_update(g.group_name))
            self._session_open = False
        done["destroy_weights_update_group"] = _attempt(lambda: self.client.destroy_weights_update_group(g.group_name))
        if g.leave is not None:
            done["leave"] = _attempt(g.leave)
        self.client.joined_groups.discard(g.group_name)
        log.warning(
            "weight sync failed at %s; group %r torn down, the next sync initializes it again: %s",
            error.stage, g.group_name, done,
        )  # fmt: skip

    def _verify(self, report: SyncReport) -> None:
        checked = self.client.weights_checker("checksum")
        report.checksums = dict(checked.get("checksums") or report.checksums)
        report.rank_checksums = ranks = {w: list(v) for w, v in (checked.get("rank_checksums") or {}).items()}
        report.fleet_identical = bool(checked.get("identical"))
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


def _attempt(fn: Callable[[], Any]) -> str:
    """Run one clean-up step; its outcome as a line, never an exception (the sync's error is what counts)."""
    try:
        answer = fn()
    except RouterCallError as exc:
        return f"failed: {exc}"
    except Exception as exc:  # noqa: BLE001 - the caller's leave; recorded, not raised
        return f"failed: {type(exc).__name__}: {exc}"
    message = answer.get("message") if isinstance(answer, dict) else None
    return f"ok: {message}" if message and message != "ok" else "ok"
