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

from router.contract.admin import ModelInfo, ServerInfo
from router.contract.base import WireResponse
from router.gateway.fleet.registry import Worker, WorkerRegistry

log = logging.getLogger(__name__)

M = TypeVar("M", bound=WireResponse)


class WorkerProber:
    """Talks to one worker's health and metadata routes."""

    def __init__(self, session: aiohttp.ClientSession, *, timeout_s: float, headers: dict[str, str] | None = None):
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._headers = headers or {}

    async def _get(self, worker: Worker, path: str, model: type[M]) -> M | None:
        """The worker's answer parsed as ``model``; ``None`` unless it answered 200 with one."""
        async with self._session.get(worker.url + path, timeout=self._timeout, headers=self._headers) as resp:
            if resp.status != 200:
                return None
            try:
                return model.model_validate_json(await resp.read())
            except ValidationError:
                return None

    async def is_healthy(self, worker: Worker) -> bool:
        try:
            async with self._session.get(worker.url + "/health", timeout=self._timeout, headers=self._headers) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def refresh_metadata(self, worker: Worker) -> bool:
        """Update ``weight_version`` and ``tp_size`` from the worker; False if it did not answer."""
        try:
            info = await self._get(worker, "/model_info", ModelInfo)
            if info is not None:
                worker.weight_version = info.weight_version
                if "tp_size" in info.model_fields_set and info.tp_size >= 1:
                    worker.tp_size = info.tp_size
                    return True
            server = await self._get(worker, "/server_info", ServerInfo)
            if server is not None:
                if "tp_size" in server.model_fields_set and server.tp_size >= 1:
                    worker.tp_size = server.tp_size
                return True
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False
        return False


class HealthChecker:
    """Probe every worker each interval (with jitter) and apply the thresholds."""

    def __init__(self, registry: WorkerRegistry, prober: WorkerProber, *, interval_s: float):
        self._registry = registry
        self._prober = prober
        self._interval = interval_s

    async def check(self, worker: Worker) -> None:
        ok = await self._prober.is_healthy(worker)
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
