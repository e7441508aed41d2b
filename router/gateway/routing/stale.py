"""Requests in flight that a pause drops because the next version makes them stale.

A trainer pauses the fleet to publish a new weight version. A request still generating then
finishes (after the continue) on a fleet one version newer than the one it started on; if its
weight-version policy would no longer take the version it started on, its sample is of no use and
finishing it only costs the fleet. So at every pause broadcast the router aborts those requests on
their workers and answers their callers with why (:class:`StaleAbort`), before the pause reaches the
workers; the rest carry on as before.

**The rule.** A request carries its *start version*: the fleet sequence its worker was verified on
when the router sent it (the version its answer is stamped with, ``X-Weight-Version``). At a pause,
with ``next`` the sequence the next publish will take (the fleet's latest plus one), it is stale when
``start <= next - K``, where ``K`` (:func:`staleness_bound`) is:

- ``max-staleness:K``: ``K``, whether it came in ``X-Version-Policy`` or from ``--version-policy``;
- ``latest-only``: 0 (every request in flight is stale once the next version is out), but only when
  the request *asked* for it in its header: a request without the header under the router's default
  ``latest-only`` keeps today's behaviour (an ``in_place`` or ``retract`` pause holds it and it
  finishes after the continue);
- ``min-version:V`` and ``any``: never (publishing cannot take a version below ``V``).

Only requests with a bound are tracked (one set insert and removal each); the others cost nothing.

**How it is stopped.** The request's handler task is cancelled, which closes its connection to the
worker (every engine stops a request whose connection closed), and the request is aborted by its id
in its engine's own form, where the worker's engine serves that route: the ``AbortCall`` its route's
body was prepared with (:mod:`router.gateway.routing.prepare`: SGLang's and omni-worker's
``/abort_request`` with the ``rid``, vLLM's ``/abort_requests`` with the ``request_id``). The handler
sees the cancellation was the pause's (:meth:`Ticket.take_cancel`) and answers :class:`StaleAbort`
instead of relaying.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter

from router.contract.errors import error_body
from router.contract.version_policy import VersionPolicy
from router.gateway.engines import serves
from router.gateway.fleet.registry import Worker, WorkerRegistry
from router.gateway.routing.prepare import AbortCall
from router.gateway.tasks import TaskSet

log = logging.getLogger(__name__)

#: The caller's status when its request was dropped at a pause: the request conflicts with the fleet's next state.
STALE_STATUS = 409
#: ``error.type`` of that answer, for clients that tell it from other refusals.
STALE_ERROR_TYPE = "stale_request_aborted"

SendAbort = Callable[[Worker, AbortCall], Coroutine[Any, Any, None]]


def staleness_bound(policy: VersionPolicy, explicit: bool) -> int | None:
    """``K`` of the rule (module docstring): stale at a pause when ``start <= next - K``; ``None``: never.
    ``explicit``: the request sent its policy in a header (a default ``latest-only`` is never judged)."""
    if policy.kind == "max-staleness":
        return policy.staleness
    if policy.kind == "latest-only" and explicit:
        return 0
    return None


@dataclass(frozen=True, slots=True)
class StaleAbort:
    """Why a request was dropped: what its caller is told (409, or an error event ending its stream)."""

    policy: str
    bound: int
    start_sequence: int
    start_version: str | None
    next_sequence: int

    @property
    def message(self) -> str:
        behind = self.next_sequence - self.start_sequence
        return (
            f"aborted at a weight-update pause: this request started on fleet version {self.start_sequence} "
            f"({self.start_version!r}), {behind} version(s) behind the version being published "
            f"({self.next_sequence}), and its version policy {self.policy!r} drops a request {self.bound} or more "
            "versions behind at a pause: its output would be stale. Drop the sample, or send it again after the "
            "continue"
        )

    def body(self) -> bytes:
        return json.dumps(
            error_body(
                self.message,
                STALE_ERROR_TYPE,
                version_policy=self.policy,
                start_sequence=self.start_sequence,
                start_version=self.start_version,
                next_sequence=self.next_sequence,
            )
        ).encode()


@dataclass(eq=False, slots=True)
class Ticket:
    """One tracked request on one worker (see the module docstring)."""

    worker: Worker
    start: int
    start_version: str | None
    bound: int
    policy: str
    abort: AbortCall | None
    task: asyncio.Task[object] | None
    stale: StaleAbort | None = field(default=None)

    def take_cancel(self) -> bool:
        """In the handler, on ``CancelledError``: True when the cancellation was this pause's drop (it is then
        taken back, and the handler answers :attr:`stale`); False when the caller went away too, or only."""
        task = self.task
        if self.stale is None or task is None:
            return False
        task.uncancel()
        return task.cancelling() == 0


class StaleRequests:
    """The requests this process has in flight under a policy with a bound, and the drop at a pause."""

    def __init__(self, registry: WorkerRegistry, send_abort: SendAbort, aborted: Counter, tasks: TaskSet):
        self._registry = registry
        self._send_abort = send_abort
        self._tasks = tasks
        """Where the aborts run: one still unanswered at the bound goes on within its route's own budget."""
        self._aborted = aborted
        self._open: set[Ticket] = set()

    def open(self, worker: Worker, policy: VersionPolicy, bound: int, abort: AbortCall | None) -> Ticket | None:
        """Track a request about to be sent to ``worker`` (its start version is the worker's verified one now)."""
        start = self._registry.fleet.verified_sequence(worker.id, worker)
        if start is None:
            return None
        task: asyncio.Task[object] | None = asyncio.current_task()
        ticket = Ticket(worker, start, worker.weight_version, bound, policy.text, abort, task)
        self._open.add(ticket)
        return ticket

    def close(self, ticket: Ticket | None) -> None:
        if ticket is not None:
            self._open.discard(ticket)

    def __len__(self) -> int:
        return len(self._open)

    async def drop(self, next_sequence: int, workers: Collection[str] | None, wait_s: float) -> int:
        """Drop every tracked request on ``workers`` (``None``: all) that ``next_sequence`` makes stale; return
        how many. Each is marked and its handler cancelled at once (no await in between, so none of them can
        relay an answer after this); then their aborts by id are sent, waited for ``wait_s`` at most."""
        stale = [
            t
            for t in self._open
            if t.stale is None
            and (workers is None or t.worker.id in workers)
            and t.start <= next_sequence - t.bound
            and t.task is not None
        ]
        for ticket in stale:
            ticket.stale = StaleAbort(ticket.policy, ticket.bound, ticket.start, ticket.start_version, next_sequence)
            if ticket.task is not None:
                ticket.task.cancel()
        if not stale:
            return 0
        self._aborted.inc(len(stale))
        log.info(
            "pause: dropped %d request(s) that version %d makes stale (%s)",
            len(stale),
            next_sequence,
            ", ".join(sorted({f"{t.worker.id}: {t.policy} from {t.start}" for t in stale})),
        )
        sends = [
            self._tasks.spawn(self._send_abort(t.worker, t.abort), name=f"stale-abort-{t.worker.id}")
            for t in stale
            if t.abort is not None and serves(t.worker, t.abort.endpoint.path)
        ]
        if sends:
            _, late = await asyncio.wait(sends, timeout=wait_s)
            if late:
                log.warning("pause: %d abort(s) of stale requests unanswered after %gs", len(late), wait_s)
        return len(stale)
