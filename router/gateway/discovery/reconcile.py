"""Discovery's candidate sets, applied to the worker registry between updates.

Discovery says which workers should exist (:class:`~router.gateway.discovery.k8s.KubernetesPods`
publishes the whole set on every change). Two things follow from a new set:

- at once, a worker discovery added whose pod left the set is marked
  *departed*: it takes no generation traffic from that moment, and an update
  in flight that targets it counts it as failed (fail closed); a worker whose
  pod comes back before it was removed is simply no longer departed. With
  data-plane processes the departure goes through the same fence barrier as an
  admin call's fence (:class:`~router.gateway.admin.locked.FenceBarrier`): the
  worker is removed only once every data plane has acknowledged that it takes
  no more requests (a data plane that does not is restarted, as for a fence);
- the registry itself (workers added and removed, hence the rank plan and the
  world size) changes only under the admin update lock, like ``POST /workers``:
  a change that arrives while an update holds the lock is applied when that
  update ends, so an update's targets never shift under it. The lock is held as a
  :class:`~router.gateway.admin.locked.LockHold`, as every admin operation holds it.

Added workers start unhealthy and are probed at once, outside the lock; after
the fleet's first weight update they are *pending* until an update brings them
to the fleet's weights (:mod:`router.gateway.fleet.weights`). Discovery only
ever removes workers it added: static workers and ``POST /workers`` ones are
the operator's.
"""

from __future__ import annotations

import asyncio
import logging

from router.contract.errors import ApiError, Unavailable
from router.contract.fleet import ENGINE_NAMES, EngineName
from router.gateway.admin.journal import UpdateJournal
from router.gateway.admin.locked import ONE_PROCESS, FenceBarrier, LockHold
from router.gateway.admin.update_gate import UpdateGate
from router.gateway.discovery.k8s import PodWorker
from router.gateway.fleet.registry import Worker, WorkerRegistry, normalize_url, worker_id_for
from router.gateway.health import HealthChecker

log = logging.getLogger(__name__)

DEPARTED = "discovery no longer lists its pod (deleted, NotReady or terminating)"


class DiscoveredFleet:
    """Keeps the registry's discovered workers equal to discovery's latest candidate set."""

    def __init__(
        self,
        registry: WorkerRegistry,
        gate: UpdateGate,
        journal: UpdateJournal,
        health: HealthChecker,
        *,
        default_engine: EngineName | None = None,
        barrier: FenceBarrier = ONE_PROCESS,
    ):
        self._registry = registry
        self.barrier = barrier
        self._departures: list[str] = []
        """Workers marked departed whose departure the data planes have not acknowledged yet."""
        self._default_engine = default_engine
        """The engine of a pod that names none (``None``: detected)."""
        self._gate = gate
        self._journal = journal
        self._health = health
        self._desired: dict[str, PodWorker] = {}
        self._managed: dict[str, str] = {}
        """Worker id → URL of every worker discovery added and still owns."""
        self._wake = asyncio.Event()
        self._departed = asyncio.Event()
        self._confirming = asyncio.Lock()
        self.applied = asyncio.Event()
        """Set whenever the registry matches the latest candidate set (cleared by a new one)."""

    def offer(self, candidates: dict[str, PodWorker]) -> None:
        """A new candidate set: departures take effect now, the registry change when the lock is free."""
        desired: dict[str, PodWorker] = {}
        for url, pod in candidates.items():
            try:
                desired[normalize_url(url)] = pod
            except ApiError as exc:
                log.warning("pod %s has an unusable worker url %s: %s", pod.pod, url, exc.message)
        self._desired = desired
        for wid, url in self._managed.items():
            worker = self._registry.find(wid)
            if worker is None:
                continue
            if url in desired:
                worker.departed = None
            elif worker.departed is None:
                worker.departed = DEPARTED
                self._departures.append(wid)
                self._departed.set()
                log.info("worker %s (%s, pod %s) departed: no traffic from now on", wid, url, worker.pod)
        self.applied.clear()
        self._wake.set()

    async def run(self) -> None:
        """Apply each new candidate set, and confirm departures at once (not after an update that holds
        the lock); cancel the task to stop."""
        await asyncio.gather(self._confirm_departures(), self._apply_sets())

    async def _apply_sets(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            hold = await self._take_lock()
            try:
                await self._confirm()  # no worker leaves the registry before its departure is confirmed
                added = await self._apply()
            finally:
                hold.release()
            if not self._wake.is_set():
                self.applied.set()
            # First probes outside the lock: a worker that does not answer must not stall updates.
            if added:
                await asyncio.gather(*(self._health.check(w) for w in added))

    async def _confirm_departures(self) -> None:
        """Each time workers depart, at once: confirm it (an update holding the lock does not delay this)."""
        while True:
            await self._departed.wait()
            self._departed.clear()
            await self._confirm()

    async def _confirm(self) -> None:
        """Every routing process has stopped sending to the departed workers (the fence barrier)."""
        async with self._confirming:
            if not self._departures:
                return
            departed, self._departures = self._departures, []
            try:
                await self.barrier.confirm(f"worker(s) {', '.join(departed)} left with their pods")
            except Unavailable as exc:  # the laggards are restarted and come back with the current snapshot
                log.warning("%s", exc.message)

    async def _take_lock(self) -> LockHold:
        """Wait for the admin update lock as long as updates hold it (each of them is bounded)."""
        while True:
            try:
                return await LockHold.take(self._gate, "service_discovery")
            except Unavailable:
                log.info("worker pod changes wait for the update in progress to end")

    def _engine_of(self, pod: PodWorker) -> EngineName | None:
        """The engine the pod's label names, ``None`` for ``auto``, the default for none or an unknown name."""
        if pod.engine == "auto":
            return None
        for name in ENGINE_NAMES:
            if pod.engine == name:
                return name
        if pod.engine is not None:
            log.warning("pod %s names an unknown engine %r; using the router's --worker-engine", pod.pod, pod.engine)
        return self._default_engine

    async def _apply(self) -> list[Worker]:
        desired = self._desired
        added: list[Worker] = []
        for url, pod in desired.items():
            wid = worker_id_for(url)
            worker = self._registry.find(wid)
            if worker is None:
                worker = self._registry.add(url, source="discovery", pod=pod.pod, engine=self._engine_of(pod))
                if self._journal.names(wid):
                    worker.disabled = True  # an unresolved failed update named this address
                self._managed[wid] = url
                added.append(worker)
                log.info("worker %s (%s) discovered in pod %s", wid, url, pod.pod)
            elif wid in self._managed:
                worker.departed, worker.pod = None, pod.pod
        for wid, url in list(self._managed.items()):
            if url in desired:
                continue
            del self._managed[wid]
            if self._registry.find(wid) is None:
                continue
            self._registry.remove(wid)
            # The process whose weights a failed update left uncertain is gone with its pod; a new
            # process at the same address comes up pending (it is not among the fleet's holders).
            if self._journal.names(wid):
                await self._journal.discard_target(wid)
            log.info("worker %s (%s) removed: its pod left the fleet", wid, url)
        return added
