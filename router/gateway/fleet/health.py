"""Health probes and worker metadata (``weight_version``, ``tp_size``).

A probe is ``GET /health``, bounded by ``--health-check-timeout-s``; after a good
probe the checker also reads ``/model_info`` (falling back to ``/server_info`` for
``tp_size`` on SGLang servers whose ``/model_info`` lacks it). Those reads are part of
the probe and are bounded by the same timeout: all workers are probed in one round, and
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

from router.contract import endpoints as ep
from router.contract.admin import HealthStatus
from router.gateway.fleet.registry import Worker, WorkerRegistry
from router.gateway.upstream import WorkerClient

log = logging.getLogger(__name__)

HEALTH_PATH = "/health"


class WorkerProber:
    """Talks to one worker's health and metadata routes.

    ``/health`` is open on every worker, so it is probed without credentials; the
    metadata routes get ``headers`` (the router's own worker key), never a caller's key.
    """

    def __init__(self, workers: WorkerClient, *, timeout_s: float, headers: dict[str, str] | None = None):
        self._workers = workers
        self._timeout_s = timeout_s
        self._headers = headers or {}

    async def probe(self, worker: Worker) -> bool:
        """One health probe; what the worker says of its weights is recorded on the way."""
        status = await self.health(worker)
        if status is None:
            return False
        worker.weight_version = status.weight_version or worker.weight_version
        worker.weight_state = status.weight_state
        worker.instance_id = status.instance_id
        return True

    async def health(self, worker: Worker) -> HealthStatus | None:
        """The worker's ``/health`` answer (nothing recorded), or ``None`` when it gave no usable one."""
        answer = await self._workers.fetch(worker.url, HEALTH_PATH, HealthStatus, headers={}, timeout_s=self._timeout_s)
        return answer.value

    def give_up_requests(self, worker: Worker) -> None:
        """The worker stopped answering: its generation requests still waiting would wait for
        ``--request-timeout-s``; end them now (the proxy retries those that got no answer yet)."""
        cut = self._workers.cut_generation(worker.url, f"worker {worker.id} stopped answering health checks")
        if cut:
            log.warning("worker %s is dead: ended %d request(s) in flight on it", worker.id, cut)

    async def refresh_metadata(self, worker: Worker) -> bool:
        """Update the worker's version, weight state, instance and ``tp_size``; False if it did not answer."""
        answer = await self._workers.call(worker.url, ep.MODEL_INFO, headers=self._headers, cap_s=self._timeout_s)
        info = answer.value
        if info is not None:
            worker.weight_version = info.weight_version
            worker.weight_state = info.weight_state
            worker.instance_id = info.instance_id
            if "tp_size" in info.model_fields_set and info.tp_size >= 1:
                worker.tp_size = info.tp_size
                return True
        elif answer.status is None:
            return False  # unreachable: /server_info is not tried either
        server = (
            await self._workers.call(worker.url, ep.SERVER_INFO, headers=self._headers, cap_s=self._timeout_s)
        ).value
        if server is not None:
            if "tp_size" in server.model_fields_set and server.tp_size >= 1:
                worker.tp_size = server.tp_size
            return True
        return False


class HealthChecker:
    """Probe every worker each interval (with jitter) and apply the thresholds."""

    def __init__(self, registry: WorkerRegistry, prober: WorkerProber, *, interval_s: float):
        self._registry = registry
        self._prober = prober
        self._interval = interval_s

    async def check(self, worker: Worker) -> None:
        ok = await self._prober.probe(worker)
        if self._registry.observe_probe(worker, ok):
            log.info("worker %s (%s) is now %s", worker.id, worker.url, worker.health)
            if worker.health == "dead":
                self._prober.give_up_requests(worker)
        if ok and worker.update_holds == 0:
            await self._prober.refresh_metadata(worker)

    async def check_all(self) -> None:
        workers = list(self._registry)
        if workers:
            await asyncio.gather(*(self.check(w) for w in workers))

    async def run(self) -> None:
        """The background loop; the first round runs at once so start-up is quick."""
        while True:
            try:
                await self.check_all()
            except Exception:
                log.exception("health check round failed")
            await asyncio.sleep(self._interval * random.uniform(0.8, 1.2))
