"""Health probes and worker metadata (``weight_version``, ``tp_size``, the process identity).

A probe reads the worker's health route, as its engine serves it (:mod:`router.gateway.engines`:
omni-worker's JSON ``/health``, vLLM's and SGLang's empty one), bounded by
``--health-check-timeout-s``; after a good probe the checker also reads the engine's metadata
routes (omni-worker's ``/model_info``, vLLM's ``/weight_info`` and ``/server_info``, SGLang's
``/model_info`` and ``/server_info``). A worker whose engine nobody named is detected first.
Those reads are part of the probe and are bounded by the same timeout: all workers are probed in
one round, and
a worker slow to describe itself must not hold the round (and so delay noticing that
another worker died) for its endpoints' longer budgets. Workers that an update is targeting
are probed but their failures are not counted (see ``Worker.update_holds``),
and their metadata is left alone until the update settles. Every call goes
through the gateway's worker client (:class:`~router.gateway.upstream.WorkerClient`).

A worker found dead has its generation requests in flight ended at once
(:meth:`WorkerProber.give_up_requests`): one that had no answer yet is retried on another
worker within the retry budget, a stream already relaying ends with an error event, rather
than both waiting for ``--request-timeout-s`` on a worker that stopped answering.
"""

from __future__ import annotations

import asyncio
import logging
import random

from router.contract.admin import HealthStatus
from router.gateway.engines import Engine, detect, engine_of
from router.gateway.fleet.registry import Worker, WorkerRegistry
from router.gateway.tasks import every
from router.gateway.upstream import WorkerClient

log = logging.getLogger(__name__)


class WorkerProber:
    """Talks to one worker's health and metadata routes, through its engine's adapter
    (:mod:`router.gateway.engines`), which it detects first where nobody named it.

    The health route is open on every engine, so it is probed without credentials; the
    metadata routes get ``headers`` (the router's own worker key), never a caller's key.
    """

    def __init__(self, workers: WorkerClient, *, timeout_s: float, headers: dict[str, str] | None = None):
        self._workers = workers
        self._timeout_s = timeout_s
        self._headers = headers or {}

    async def probe(self, worker: Worker) -> bool:
        """One health probe; what the worker says of its weights is recorded on the way (omni-worker's
        ``/health`` says it; other engines' metadata is read by :meth:`refresh_metadata`)."""
        engine = await self.engine(worker)
        if engine is None:
            return False
        changes = worker.control_changes
        status = await engine.health(self._workers, worker, self._timeout_s, self._headers)
        if status is None:
            return False
        if engine.reports_update_state:
            worker.weight_version = status.weight_version or worker.weight_version
            worker.weight_state = status.weight_state
            worker.instance_id = status.instance_id
            worker.reported_paused = status.is_paused
        _drop_stale_pause_read(worker, changes)
        return True

    async def engine(self, worker: Worker) -> Engine | None:
        """The worker's engine adapter, detected now when nobody named it (``None`` while it cannot be told)."""
        engine = engine_of(worker)
        if engine is not None:
            return engine
        name, how = await detect(self._workers, worker.url, self._headers, self._timeout_s)
        if name is None:
            worker.engine_detail = how
            return None
        worker.engine, worker.engine_detail = name, None
        log.info("worker %s (%s) runs %s: %s", worker.id, worker.url, name, how)
        return engine_of(worker)

    async def health(self, worker: Worker) -> HealthStatus | None:
        """The worker's health answer (nothing recorded), or ``None`` when it gave no usable one."""
        engine = engine_of(worker)
        if engine is None:
            return None
        return await engine.health(self._workers, worker, self._timeout_s, self._headers)

    def give_up_requests(self, worker: Worker) -> None:
        """The worker stopped answering: its generation requests still waiting would wait for
        ``--request-timeout-s``; end them now (the proxy retries those that got no answer yet)."""
        cut = self._workers.cut_generation(worker.url, f"worker {worker.id} stopped answering health checks")
        if cut:
            log.warning("worker %s is dead: ended %d request(s) in flight on it", worker.id, cut)

    def give_up_parked(self, worker: Worker) -> None:
        """The worker says it is paused while the router has not paused it: its requests that got no answer
        yet would wait until someone continues it; end them now (the proxy retries them elsewhere). Answers
        already begun resume with it."""
        cut = self._workers.cut_generation(
            worker.url, f"worker {worker.id} is paused (it would park the request)", unanswered_only=True
        )
        log.warning("worker %s is paused although the router did not pause it: out of rotation", worker.id)
        if cut:
            log.warning("worker %s: %d request(s) still waiting for it go elsewhere", worker.id, cut)

    async def refresh_metadata(self, worker: Worker) -> bool:
        """Update the worker's version, weight state, instance and ``tp_size``; False if it did not answer."""
        engine = await self.engine(worker)
        if engine is None:
            return False
        changes = worker.control_changes
        answered = await engine.describe(self._workers, worker, self._headers, self._timeout_s)
        _drop_stale_pause_read(worker, changes)
        return answered


def _drop_stale_pause_read(worker: Worker, changes: int) -> None:
    """A pause or continue of the router's succeeded while the read was in flight: what the worker said
    before it is stale; its answer to the router's broadcast stands."""
    if worker.control_changes != changes:
        worker.reported_paused = worker.paused


class HealthChecker:
    """Probe every worker each interval (with jitter) and apply the thresholds."""

    def __init__(self, registry: WorkerRegistry, prober: WorkerProber, *, interval_s: float):
        self._registry = registry
        self._prober = prober
        self._interval = interval_s
        self._checks: dict[str, asyncio.Task[None]] = {}
        """Each worker's check still running, by worker id: a round starts none beside it."""

    async def check(self, worker: Worker) -> None:
        parked = worker.paused_behind_router
        ok = await self._prober.probe(worker)
        if self._registry.observe_probe(worker, ok):
            log.info("worker %s (%s) is now %s", worker.id, worker.url, worker.health)
            if worker.health == "dead":
                self._prober.give_up_requests(worker)
        if ok and worker.update_holds == 0:
            await self._prober.refresh_metadata(worker)
        if ok and worker.update_holds == 0 and worker.paused_behind_router and not parked:
            self._prober.give_up_parked(worker)

    async def check_all(self) -> None:
        """Check every worker whose last check has ended, and wait for them, at most one interval.

        A worker that does not answer (a stopped process, a slow network) holds its own check for the probe's
        timeout, never the round: its check goes on and later rounds skip it, so a worker that died beside it
        is still noticed within the thresholds' count of intervals, and its requests are given up in time."""
        started = [self._start(w) for w in self._registry if w.id not in self._checks]
        if started:
            await asyncio.wait(started, timeout=max(self._interval, 0.001))

    def _start(self, worker: Worker) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(self.check(worker), name=f"health check {worker.id}")
        self._checks[worker.id] = task
        task.add_done_callback(lambda done: self._ended(worker.id, done))
        return task

    def _ended(self, worker_id: str, task: asyncio.Task[None]) -> None:
        if self._checks.get(worker_id) is task:
            del self._checks[worker_id]
        if not task.cancelled() and task.exception() is not None:
            log.error("health check of worker %s failed", worker_id, exc_info=task.exception())

    async def run(self) -> None:
        """The background loop; the first round runs at once so start-up is quick (rounds jittered ±20 %)."""
        try:
            await every(lambda: self._interval * random.uniform(0.8, 1.2), self.check_all, "health check round")
        finally:
            checks = list(self._checks.values())
            for task in checks:
                task.cancel()
            await asyncio.gather(*checks, return_exceptions=True)
