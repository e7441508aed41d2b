"""The scheduler-thread steps of every weight update (disk, distributed, and later sources).

Each function runs on one rank's scheduler thread, between forward steps, and
returns a typed :class:`~worker.engine.results.OpResult`; the event-loop side that
sequences them is :class:`worker.update_pipeline.UpdatePipeline`. Together they are one
transaction:

    check → take → apply (atomic, with rollback; or streamed bucket by bucket) → commit | fail

The ``effect`` of every payload (:class:`~worker.engine.results.Checked`,
:class:`~worker.engine.results.Taken`, :class:`~worker.engine.results.Applied`,
:class:`~worker.engine.results.Committed`, :class:`~worker.engine.results.Ended`) says what
the step left the weights as: ``intact``, ``updated`` or ``partial``
(:data:`~worker.engine.weight_state.WeightsEffect`); a result without one counts as ``partial``
(:func:`~worker.engine.results.effect_of`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from router.dataplane.buckets import NamedTensors
from worker.engine.admin_ops import active_requests_message
from worker.engine.model_worker import RollbackFailed, WeightUpdateError
from worker.engine.results import Applied, Checked, Committed, Ended, OpResult, Taken
from worker.engine.scheduler import Scheduler
from worker.engine.weight_state import WeightState


def refusal(s: Scheduler, *, abort_all: bool, allow_frozen: bool = False) -> str | None:
    """Why an update must not start now, or ``None``: nothing is changed either way.

    ``allow_frozen``: requests frozen by an ``in_place`` pause may stay (vLLM's ``keep``: they
    resume after the update with the KV computed so far)."""
    if s.worker.weights_released:
        return "weights are released; call /resume_memory_occupation before updating them"
    frozen = allow_frozen and s.is_paused and s.pause_mode == "in_place"
    if s.active_request_count and not abort_all and not frozen:
        return active_requests_message(s.active_request_count, "update weights")
    return None


def check(s: Scheduler, *, abort_all: bool) -> OpResult[Checked]:
    """Refuse at once what would be refused anyway (before a checkpoint is read or a receive posted)."""
    why = refusal(s, abort_all=abort_all)
    return OpResult(why is None, why or "ok", Checked(num_paused_requests=s.num_waiting))


def take(s: Scheduler, *, abort_all: bool, hold: bool, allow_frozen: bool = False) -> OpResult[Taken]:
    """Make the worker ready to be written: abort requests if asked; with ``hold``, stop generation
    (an ``in_place`` pause; with nothing active it only holds queued requests back)."""
    why = refusal(s, abort_all=abort_all, allow_frozen=allow_frozen)
    if why is not None:
        return OpResult(False, why, Taken())
    aborted = s.abort_all("Aborted: weights are being updated") if abort_all else []
    paused_by_update = False
    if hold and not s.is_paused:
        s.pause("in_place")
        paused_by_update = True
    return OpResult(True, "", Taken(aborted_rids=aborted, paused_by_update=paused_by_update))


def apply_atomic(s: Scheduler, named: NamedTensors, *, abort_all: bool, require_complete: bool) -> OpResult[Applied]:
    """Write every tensor in this one step; on failure the previous weights stay (or, if even
    restoring failed, the weights are partial). Requests that arrived since ``take`` are
    aborted first when ``abort_all`` (their answers carry the previous ``weight_version``)."""
    why = refusal(s, abort_all=abort_all)
    if why is not None:
        return OpResult(False, why, Applied("intact"))
    aborted = s.abort_all("Aborted: weights are being updated") if abort_all else []
    try:
        s.worker.apply_atomic(named, require_complete=require_complete)
    except WeightUpdateError as exc:
        return OpResult(False, str(exc), Applied("intact", num_aborted=len(aborted)))
    except RollbackFailed as exc:
        return OpResult(False, str(exc), Applied("partial", num_aborted=len(aborted)))
    return OpResult(True, "", Applied("updated", num_aborted=len(aborted)))


def apply_streamed(
    s: Scheduler, named: NamedTensors, failed: threading.Event, verify: Callable[[], None] | None = None
) -> int:
    """Streaming: write one received bucket (the update's later buckets are refused once it ``failed``).

    ``verify`` runs first (the bucket's checksum): if it raises, nothing of the bucket is
    written and the update has ``failed``, so buckets queued after it are refused too."""
    if failed.is_set():
        raise RuntimeError("the update already failed; bucket not applied")
    if verify is not None:
        try:
            verify()
        except Exception:
            failed.set()
            raise
    return s.worker.apply_streamed(named)


@dataclass(frozen=True, slots=True)
class CommitOptions:
    """What a successful update does after its weights are written."""

    names: tuple[str, ...]
    """The tensors the update wrote (for leaving ``partial`` once all are rewritten)."""
    whole: bool = False
    """Every tensor of the model was written (a disk reload): the weights are whole again."""
    weight_version: str | None = None
    flush_cache: bool = False
    lift_hold: bool = False
    """Un-pause if this update paused generation (and the weights are whole)."""
    keep_pause: bool = False
    """Pause ``in_place`` afterwards if generation is not paused (``update_weights_from_disk``)."""
    empty_cache: bool = False
    checksum: bool = False
    token_step: int | None = None
    model_path: str | None = None
    load_format: str | None = None


def commit(s: Scheduler, opts: CommitOptions) -> OpResult[Committed]:
    """Record a successful write: weight state, version, flush, pause; optionally the checksum."""
    w = s.worker
    effect = w.ledger.committed(opts.names, whole=opts.whole)
    if opts.model_path is not None:
        w.model_path = opts.model_path
        w.load_format = opts.load_format
    if opts.token_step is not None:
        w.token_step = opts.token_step
    if opts.weight_version is not None:
        w.weight_version = opts.weight_version
    data = Committed(effect, w.weight_version)
    if opts.flush_cache:
        ok, reason = s.flush_cache()
        if not ok:
            return OpResult(False, f"Weights were updated, but the cache was not flushed: {reason}", data)
    if opts.empty_cache:
        w.empty_device_cache()
    if opts.lift_hold and w.ledger.servable:
        lift_hold(s)
    if opts.keep_pause and not s.is_paused:
        s.pause("in_place")
    if opts.checksum:
        data.checksum = w.weights_checksum()
    data.is_paused = s.is_paused
    data.num_paused_requests = s.num_waiting
    return OpResult(True, "", data)


def fail(s: Scheduler, *, lift: bool) -> OpResult[Ended]:
    """An update ended without commit: a streaming one that wrote buckets leaves the weights partial
    (generation stays held); one that wrote nothing lifts its hold when ``lift``."""
    effect = s.worker.ledger.writing_failed()
    if effect == "intact" and lift:
        lift_hold(s)
    return OpResult(True, "", Ended(effect, weights_partial=s.worker.weights_partial))


def mark_partial(s: Scheduler) -> OpResult[Ended]:
    """SGLang's single-phase sync failed midway: earlier calls of the same sync may have written buckets."""
    if s.worker.ledger.state is WeightState.RELEASED:
        return OpResult(True, "", Ended("intact"))
    return OpResult(True, "", Ended(s.worker.ledger.mark_partial()))


def lift_hold(s: Scheduler) -> None:
    """Lift the ``in_place`` pause an update put on generation."""
    if s.is_paused and s.pause_mode == "in_place":
        s.continue_generation()
