"""An update held across several HTTP calls, and the one place that holds it.

A ready ``/prepare_weights_update`` (until its complete or abort) and vLLM's
``/start_weight_update`` (until its finish) each become a :class:`HeldUpdate`: it owns the
admin update lock (a :class:`~router.gateway.admin.locked.LockHold` its opening run kept),
the fence on its targets and their journal entry. :class:`HeldUpdates` keeps at most one
(it owns the lock, so no other can begin) and guarantees that it ends exactly once:

- the call that ends it normally detaches it first, then ends it in an
  :class:`~router.gateway.admin.locked.AdminRun` that adopts its lock;
- nobody ends it: once its life has passed (its receive window plus one margin of the
  timeout budget, or ``--update-session-timeout-s``) the router ends it itself, failing closed;
- it cannot succeed any more: its targets' ``/health`` is read every :data:`RECEIVE_POLL_S`,
  and once no target can still complete it (each one failed, restarted, lost the update or
  stopped answering for :data:`UNANSWERED_POLLS` polls) the router ends it at once instead of
  holding the lock until expiry; a later call is told why. Only omni-worker's ``/health`` says
  whether its receive or update is alive: a vLLM or SGLang target that answers may still complete.

A call at work inside the update without ending it holds :attr:`HeldUpdate.calls`; the
router's own end waits for it (each such call is bounded by its own wait).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from router.contract.admin import HealthStatus
from router.contract.budget import HOP_MARGIN_S
from router.gateway.admin.fence import Fence
from router.gateway.admin.locked import AdminContext, LockHold
from router.gateway.admin.verify import Digest
from router.gateway.engines import engine_of
from router.gateway.fleet.registry import Worker
from router.gateway.tasks import TaskSet

log = logging.getLogger(__name__)

#: How often a prepared update reads its targets' ``/health`` to see whether any receive can still succeed.
RECEIVE_POLL_S = 1.0
#: Consecutive unanswered polls after which a target counts as unable to complete (it died or hung).
UNANSWERED_POLLS = 3


@dataclass
class HeldUpdate:
    """An update that holds the admin update lock, the fence on its targets and their journal entry
    across several HTTP calls (a ready prepare to its complete; vLLM's start to its finish)."""

    group_name: str
    lock: LockHold
    fence: Fence
    targets: list[Worker]
    instances: dict[str, str | None]
    """Each target's process instance when the update began: another one later has lost the update."""
    receive_deadline: float
    """``time.monotonic()`` past which the workers stop receiving (the update's window from its start)."""
    expires_at: float = 0.0
    """``time.monotonic()`` past which the router ends it (set when it is held; a call may extend it)."""
    started: float = field(default_factory=time.monotonic)
    expiry: asyncio.Task[None] | None = None
    calls: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held by a call that works inside the update without ending it; the expiry waits for it."""
    before: dict[str, Digest] | None = None
    """Each target's weights' digest when the update began (``--verify-updates changed``)."""

    def receive_left_s(self) -> float:
        return max(self.receive_deadline - time.monotonic(), 0.0)


H = TypeVar("H", bound=HeldUpdate)


class HeldUpdates(Generic[H]):
    """At most one held update at a time (it owns the lock, so no other can begin): hold it, hand it to
    the call that ends it, or end it when it expires or can no longer succeed."""

    #: How a held update is named in messages.
    what = "held update"
    #: The call that ends a held update normally (named when it expires without one).
    ending_call = "its end"

    def __init__(
        self, ctx: AdminContext, tasks: TaskSet, *, prepared_life_s: float | None, service_headers: dict[str, str]
    ):
        self._ctx = ctx
        self._tasks = tasks
        #: Overrides the life of a held update (``--update-session-timeout-s``); by default its window + one margin.
        self._prepared_life_s = prepared_life_s
        # The router's own credentials, for calls no caller is waiting on (expiry).
        self._service_headers = service_headers
        self.held: H | None = None
        #: Why the router itself ended the last held update of each group (told to a late call).
        self._ended: dict[str, str] = {}

    def _life_s(self, window_s: float) -> float:
        """How long the router holds an update whose workers receive for ``window_s``."""
        return self._prepared_life_s if self._prepared_life_s is not None else window_s + HOP_MARGIN_S

    def _hold(self, held: H, window_s: float) -> None:
        """``held`` owns the lock and the fence from now on, until a call ends it or it expires."""
        held.expires_at = time.monotonic() + self._life_s(window_s)
        held.expiry = self._tasks.spawn(self._expire(held), name=f"held-update-{held.group_name}")
        self.held = held

    def _ended_note(self, group: str) -> str:
        return f"; the router ended the last one itself: {self._ended[group]}" if group in self._ended else ""

    def _detach(self, held: H) -> None:
        self.held = None
        if held.expiry is not None and held.expiry is not asyncio.current_task():
            held.expiry.cancel()

    async def _expire(self, held: H) -> None:
        """End ``held`` at its expiry, or as soon as no target can complete it any more."""
        unanswered = dict.fromkeys(held.instances, 0)
        reason: str | None = None
        while reason is None:
            left = held.expires_at - time.monotonic()
            if left <= 0:
                reason = f"expired after {time.monotonic() - held.started:.0f}s without {self.ending_call}"
                break
            await asyncio.sleep(min(RECEIVE_POLL_S, left))
            if self.held is not held:
                return
            if held.calls.locked():
                continue  # a call is at work inside the update: its answer says how the targets fare
            answers = await asyncio.gather(*(self._ctx.prober.health(w) for w in held.targets))
            if self.held is not held:
                return
            if held.calls.locked():
                continue
            reason = self._cannot_complete(held, answers, unanswered)
        # A call at work inside the update ends first (each is bounded by its own wait).
        async with held.calls:
            if self.held is not held:
                return
            log.warning("%s of group %s ended by the router: %s; failing closed", self.what, held.group_name, reason)
            self._ended[held.group_name] = reason
            self._detach(held)
            await self._end_by_router(held)

    async def _end_by_router(self, held: H) -> None:
        """End ``held`` after its expiry (or once it cannot succeed), failing closed."""
        raise NotImplementedError

    def _cannot_complete(self, held: H, answers: list[HealthStatus | None], unanswered: dict[str, int]) -> str | None:
        """Why no target can complete ``held`` any more, or ``None`` while one still can."""
        why: list[str] = []
        for worker, status in zip(held.targets, answers, strict=True):
            if status is None:
                unanswered[worker.id] += 1
                if unanswered[worker.id] < UNANSWERED_POLLS:
                    return None
                why.append(f"{worker.id}: no answer to {unanswered[worker.id]} health probes")
                continue
            unanswered[worker.id] = 0
            engine = engine_of(worker)
            if engine is None or not engine.reports_update_state:
                return None  # it answers, and its health says nothing of the update: it may still complete
            known = held.instances[worker.id]
            stuck = (
                "its process restarted"
                if known is not None and status.instance_id != known
                else self._stuck(held, worker, status)
            )
            if stuck is None:
                return None
            why.append(f"{worker.id}: {stuck}")
        return "no worker can complete it (" + "; ".join(why) + ")"

    def _stuck(self, held: H, worker: Worker, status: HealthStatus) -> str | None:
        """Why ``worker`` (answering, same process) can no longer complete ``held``, or ``None``."""
        return None
