"""Health probes and worker metadata (``weight_version``, ``tp_size``).

A probe is ``GET /health``; after a good probe the checker also reads
``/model_info`` (falling back to ``/server_info`` for ``tp_size`` on SGLang
servers whose ``/model_info`` lacks it). Workers that an update is targeting
are probed but their failures are not counted (see ``Worker.update_holds``),
and their metadata is left alone until the update settles.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import TypeVar

import aiohttp
from pydantic import ValidationError

from router.contract.admin import HealthStatus, ModelInfo, ServerInfo
from router.contract.base import WireResponse
from router.gateway.fleet.registry import Worker, WorkerRegistry

log = logging.getLogger(__name__)

M = TypeVar("M", bound=WireResponse)


#: Errors that mean "no usable answer" from a worker (``ValueError``: a URL that cannot be encoded).
_UNREACHABLE = (TimeoutError, aiohttp.ClientError, OSError, ValueError)


class WorkerProber:
    """Talks to one worker's health and metadata routes.

    ``/health`` is open on every worker, so it is probed without credentials; the
    metadata routes get ``headers`` (the router's own worker key), never a caller's key.
    """

    def __init__(self, session: aiohttp.ClientSession, *, timeout_s: float, headers: dict[str, str] | None = None):
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._headers = headers or {}

    async def _get(self, worker: Worker, path: str, model: type[M], headers: dict[str, str]) -> M | None:
        """The worker's answer parsed as ``model``; ``None`` unless it answered 200 with one."""
        async with self._session.get(worker.url + path, timeout=self._timeout, headers=headers) as resp:
            if resp.status != 200:
                return None
            try:
                return model.model_validate_json(await resp.read())
            except ValidationError:
                return None

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
        try:
            return await self._get(worker, "/health", HealthStatus, {})
        except _UNREACHABLE:
            return None

    async def refresh_metadata(self, worker: Worker) -> bool:
        """Update the worker's version, weight state, instance and ``tp_size``; False if it did not answer."""
        try:
            info = await self._get(worker, "/model_info", ModelInfo, self._headers)
            if info is not None:
                worker.weight_version = info.weight_version
                worker.weight_state = info.weight_state
                worker.instance_id = info.instance_id
                if "tp_size" in info.model_fields_set and info.tp_size >= 1:
                    worker.tp_size = info.tp_size
                    return True
            server = await self._get(worker, "/server_info", ServerInfo, self._headers)
            if server is not None:
                if "tp_size" in server.model_fields_set and server.tp_size >= 1:
                    worker.tp_size = server.tp_size
                return True
        except _UNREACHABLE:
            return False
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
