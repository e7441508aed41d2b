"""Weight-sync steps that touch the model: every method runs on the scheduler thread.

They run between forward steps (submitted with ``scheduler.submit_admin``), so
they see a consistent set of requests and never race a forward pass.

``weights_partial`` bookkeeping: once an update failed after changing some
tensors, the model is a mix of two versions. It becomes whole again only when
every checkpoint tensor has been rewritten by successful updates since then
(or a disk reload, which the worker's own path handles); this class tracks the
names rewritten so far.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

import torch

from worker.engine.admin_ops import check_update_allowed
from worker.engine.model_worker import ModelWorker
from worker.engine.scheduler import Scheduler
from worker.model import digest_named_tensors
from router.dataplane.buckets import NamedTensors


@dataclass(frozen=True)
class Admission:
    """The result of :meth:`ModelApplier.admit`: an error, or how the scheduler was prepared."""

    error: Optional[str] = None
    paused_by_update: bool = False
    partial_before: bool = False


@dataclass(frozen=True)
class FinishResult:
    """The outcome of :meth:`ModelApplier.finish` (``checksum`` when one was asked for)."""

    success: bool
    message: str = ""
    checksum: Optional[str] = None


class ModelApplier:
    """Lifecycle checks, bucket applies and finalisation for one rank."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self._rewritten: Optional[set[str]] = None
        #: Buckets of the current update written into the model (streaming), counted
        #: before the copy: a copy that fails midway has changed weights too.
        self.buckets_applied = 0

    @property
    def worker(self) -> ModelWorker:
        return self.scheduler.worker

    def admit(self, *, abort_all: bool, hold: bool) -> Admission:
        """Refuse while weights are released or requests hold KV (unless aborting them);
        with ``hold``, stop generation for the update (an ``in_place`` pause with nothing
        active only holds queued requests back)."""
        s, w = self.scheduler, self.worker
        allowed = check_update_allowed(s, abort_all)
        if not allowed.success:
            return Admission(error=allowed.message)
        if abort_all:
            s.abort_all("Aborted: weights are being updated")
        paused_by_update = False
        if hold and not s.is_paused:
            s.pause("in_place")
            paused_by_update = True
        self.buckets_applied = 0
        return Admission(paused_by_update=paused_by_update, partial_before=w.weights_partial)

    def release_hold(self) -> None:
        if self.scheduler.is_paused and self.scheduler.pause_mode == "in_place":
            self.scheduler.continue_generation()

    def apply_bucket(self, named: NamedTensors, failed: threading.Event) -> int:
        """Streaming: copy one received bucket into the model (views are not kept)."""
        if failed.is_set():
            raise RuntimeError("the update already failed; bucket not applied")
        w = self.worker
        w.weights_partial = True
        self.buckets_applied += 1
        count = w.model.load_weights(named)
        w.synchronize()  # the receive thread reuses the buffer as soon as this returns
        return count

    def finish(self, *, names: list[str], staged: NamedTensors, atomic: bool, abort_all: bool,
               weight_version: Optional[str], flush_cache: bool, resume: bool, partial_before: bool,
               checksum: bool) -> FinishResult:
        """After a successful receive: apply staged buckets (atomic), then clear the
        partial flag, set the version, flush, lift this update's hold, checksum."""
        s, w = self.scheduler, self.worker
        if atomic:
            admitted = self.admit(abort_all=abort_all, hold=False)
            if admitted.error is not None:
                return FinishResult(False, f"received weights not applied (previous weights kept): {admitted.error}")
            try:
                self._apply_with_rollback(staged)
            except Exception as exc:  # noqa: BLE001 - reported to the caller; weights restored
                return FinishResult(False, f"applying the received weights failed, previous weights kept: {exc}")
            prior = w.weights_partial
        else:
            prior = partial_before
        w.weights_partial = self._still_partial(prior, names)
        if weight_version is not None:
            w.weight_version = weight_version
        if flush_cache:
            ok, reason = s.flush_cache()
            if not ok:
                return FinishResult(False, f"Weights were updated, but the cache was not flushed: {reason}")
        if resume and not w.weights_partial:
            self.release_hold()
        digest = digest_named_tensors(w.model.iter_checkpoint_tensors())[1] if checksum else None
        return FinishResult(True, "", digest)

    def after_failure(self, atomic: bool) -> bool:
        """A failed receive: atomic changed nothing; streaming may have applied some
        buckets (the flag is already raised) and stays paused. Returns ``weights_partial``."""
        w = self.worker
        if not atomic and w.weights_partial:
            self._rewritten = set()
        return bool(w.weights_partial)

    def after_abort(self, *, resume: bool) -> tuple[int, bool]:
        """A prepared update dropped by ``/abort_weights_update`` (its later applies are
        already refused). Returns (buckets it applied, ``weights_partial``).

        Nothing applied: generation goes back to how the update found it (``resume``
        lifts the update's own hold). Something applied: like a failed streaming
        update, the worker stays paused and partial."""
        applied = self.buckets_applied
        if applied:
            return applied, self.after_failure(atomic=False)
        if resume:
            self.release_hold()
        return 0, bool(self.worker.weights_partial)

    def mark_partial(self) -> None:
        """Single-phase failure: earlier buckets of this sync may already be applied."""
        self.worker.weights_partial = True
        self._rewritten = set()

    def _still_partial(self, prior: bool, names: list[str]) -> bool:
        if not prior:
            self._rewritten = None
            return False
        rewritten = self._rewritten if self._rewritten is not None else set()
        rewritten.update(names)
        if set(self.worker.model.checkpoint_spec()) <= rewritten:
            self._rewritten = None
            return False
        self._rewritten = rewritten
        return True

    def _apply_with_rollback(self, staged: NamedTensors) -> None:
        """Load ``staged``; on failure restore exactly the tensors it may have overwritten."""
        w = self.worker
        views = dict(w.model.iter_checkpoint_tensors())
        backup = [(views[name], views[name].to("cpu", copy=True)) for name, _ in staged if name in views]
        try:
            w.model.load_weights(staged)
            w.synchronize()
        except Exception:
            with torch.no_grad():
                for view, old in backup:
                    view.copy_(old)
            w.synchronize()
            raise

