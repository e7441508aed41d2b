"""Leader election on a Kubernetes Lease (``--leader-election``), with client-go's leaderelection rules.

::

    standby   every retry period: read the Lease; take it when it has no holder, or when its holder
              has not renewed it for a whole lease duration as observed here
    leader    every retry period: renew it; when no renewal succeeded within the renew deadline,
              leadership is lost

Invariants:

* **Time is only this process's monotonic clock.** A standby never compares the Lease's
  ``renewTime`` with its own clock (the leader's clock, in another pod, may be off): it notes when
  it *saw* the record (holder, renewTime, acquireTime, transitions) change, and counts a whole lease
  duration from that moment. ``renewTime`` and ``acquireTime`` are written for people (kubectl).
* **Every write is a compare-and-swap**: a replace carrying the resourceVersion just read, or the
  create of a Lease that does not exist yet. A 409 means another replica wrote first: this one did
  not take, or did not renew, the lease.
* **A leader gives up before a standby can take over.** Its renew deadline runs from the moment it
  *sent* its last successful renewal, and renew deadline < lease duration, while a standby counts
  from when it *saw* that renewal. Every call to the API server is cut at the deadline, so a call
  hanging on a partitioned network cannot keep a leader past it; a leader that reads another holder
  in the Lease has lost at once.

The client is lightkube's ``AsyncClient`` (the ``k8s`` extra), imported only when the election runs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightkube import AsyncClient
    from lightkube.models.coordination_v1 import LeaseSpec

log = logging.getLogger(__name__)

#: How long one call to the API server may take, at most (a leader's is cut sooner, at its renew deadline).
API_TIMEOUT_S = 10.0
#: A standby's tries are spread by up to this fraction of the retry period, so replicas do not ask in step.
JITTER = 0.2


@dataclass(frozen=True, slots=True)
class LeaseSettings:
    """The Lease and its timing (``--leader-lease-name``, ``--leader-lease-duration-s``, ...)."""

    name: str
    identity: str
    duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0
    namespace: str | None = None
    """``None``: the client configuration's (the router pod's own namespace inside a cluster)."""


def default_identity() -> str:
    """The pod's name (``POD_NAME``, from the downward API), else ``<hostname>_<pid>``."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}_{os.getpid()}"


class LeaseElector:
    """Takes, renews and releases the Lease; says who holds it as last seen (see the module docstring)."""

    def __init__(
        self,
        settings: LeaseSettings,
        *,
        client_factory: Callable[[], AsyncClient] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.settings = settings
        self._client_factory = client_factory
        self._clock = clock
        self._client: AsyncClient | None = None
        self.holder: str | None = None
        """The holder as last seen (this replica's identity while it leads)."""
        self.last_error: str | None = None
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = clock()
        self._last_renew_sent: float | None = None

    @property
    def identity(self) -> str:
        return self.settings.identity

    def seconds_until_free(self) -> float:
        """How long, as seen from here, until the lease could be taken (0 when nobody holds it)."""
        if self.holder is None:
            return 0.0
        return max(0.0, self._observed_at + self.settings.duration_s - self._clock())

    def free_at(self) -> float:
        """The moment (this host's monotonic clock) from which the lease could be taken; 0 when nobody holds it."""
        return 0.0 if self.holder is None else self._observed_at + self.settings.duration_s

    def renewed_until(self) -> float | None:
        """The moment (this host's monotonic clock) at which this replica's leadership ends unless renewed
        again; ``None`` when it has not renewed. Data planes close their gate at it (``holds_lease``)."""
        sent = self._last_renew_sent
        return None if sent is None else sent + self.settings.renew_deadline_s

    def holds_lease(self) -> bool:
        """Whether this replica renewed the lease within its renew deadline, on this process's clock.

        The gate asks it on every request, so a leader whose deadline has passed refuses at once, even
        before its renewal task has run again (a busy event loop must not stretch its leadership)."""
        sent = self._last_renew_sent
        return sent is not None and self._clock() - sent < self.settings.renew_deadline_s

    def open(self) -> None:
        """Build the API client (a configuration error fails the router's start-up, not every try)."""
        if self._client is not None:
            return
        if self._client_factory is not None:
            self._client = self._client_factory()
            return
        import httpx2
        from lightkube import AsyncClient

        self._client = AsyncClient(timeout=httpx2.Timeout(API_TIMEOUT_S), field_manager="omni-router")

    def client(self) -> AsyncClient:
        """The API client (built on first use), shared with what else the replica asks the API server."""
        self.open()
        assert self._client is not None
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def acquire(self) -> None:
        """Return once this replica holds the Lease; tries every retry period until then (cancel to stop)."""
        s = self.settings
        while True:
            if await self._attempt(bound_s=s.renew_deadline_s):
                log.info("took the lease %s as %s: this replica is the leader", s.name, s.identity)
                return
            await asyncio.sleep(s.retry_period_s * (1 + JITTER * random.random()))

    async def hold(self) -> str:
        """Renew every retry period while this replica leads; return why, once leadership is lost."""
        s = self.settings
        while True:
            await asyncio.sleep(s.retry_period_s)
            while True:
                assert self._last_renew_sent is not None, "hold() runs only after acquire()"
                left = self._last_renew_sent + s.renew_deadline_s - self._clock()
                if left <= 0:
                    return (
                        f"no renewal succeeded within the renew deadline ({s.renew_deadline_s:g} s): {self.last_error}"
                    )
                if await self._attempt(bound_s=left):
                    break
                if self.holder is not None and self.holder != s.identity:
                    return f"{self.holder} holds the lease now"
                log.warning("renewing the lease %s failed (%s); %.1f s left to renew", s.name, self.last_error, left)
                await asyncio.sleep(min(s.retry_period_s, left))

    async def release(self, bound_s: float) -> bool:
        """Give the lease up (no holder; a compare-and-swap), so a standby takes it within a retry period
        rather than a lease duration. Best effort, within ``bound_s``; True if released."""
        from lightkube.models.coordination_v1 import LeaseSpec
        from lightkube.resources.coordination_v1 import Lease

        client = self._client
        if client is None or self._last_renew_sent is None:
            return False
        s = self.settings
        try:
            async with asyncio.timeout(bound_s):
                lease = await client.get(Lease, s.name, namespace=s.namespace)
                spec = lease.spec or LeaseSpec()
                if spec.holderIdentity != s.identity:
                    return False
                lease.spec = LeaseSpec(
                    holderIdentity=None,
                    leaseDurationSeconds=1,
                    acquireTime=spec.acquireTime,
                    renewTime=datetime.now(UTC),
                    leaseTransitions=spec.leaseTransitions,
                )
                await client.replace(lease)
        except Exception as exc:  # a conflict, the API server away: the lease simply expires
            log.warning("could not release the lease %s (%s); it expires on its own", s.name, _describe(exc))
            return False
        self._last_renew_sent = None
        log.info("released the lease %s", s.name)
        return True

    async def _attempt(self, *, bound_s: float) -> bool:
        """One try to take or renew the lease, cut at ``bound_s``; True when this replica holds it now."""
        sent = self._clock()
        try:
            async with asyncio.timeout(bound_s):
                taken = await self._try_acquire_or_renew()
        except TimeoutError:
            self.last_error = f"the API server did not answer within {bound_s:.1f} s"
            return False
        except Exception as exc:  # an API error other than 404/409, the transport
            self.last_error = _describe(exc)
            return False
        if taken:
            self._last_renew_sent = sent
            self.last_error = None
        return taken

    async def _try_acquire_or_renew(self) -> bool:
        from lightkube import ApiError
        from lightkube.models.coordination_v1 import LeaseSpec
        from lightkube.models.meta_v1 import ObjectMeta
        from lightkube.resources.coordination_v1 import Lease

        if self._client is None:
            self.open()
        client = self._client
        assert client is not None
        s = self.settings
        try:
            lease = await client.get(Lease, s.name, namespace=s.namespace)
        except ApiError as exc:
            if exc.status.code != 404:
                raise
            lease = None
        now = datetime.now(UTC)
        if lease is None:  # the first leader creates it
            fresh = Lease(metadata=ObjectMeta(name=s.name, namespace=s.namespace), spec=self._spec(now, now, 0))
            try:
                created = await client.create(fresh)
            except ApiError as exc:
                if exc.status.code == 409:  # another replica created it first
                    return False
                raise
            self._observe(created.spec)
            return True
        spec = lease.spec or LeaseSpec()
        self._observe(spec)
        if self.holder is not None and self.holder != s.identity and self.seconds_until_free() > 0:
            return False
        ours = self.holder == s.identity
        transitions = spec.leaseTransitions or 0
        lease.spec = self._spec(spec.acquireTime if ours else now, now, transitions if ours else transitions + 1)
        try:
            renewed = await client.replace(lease)  # carries the resourceVersion just read
        except ApiError as exc:
            if exc.status.code == 409:  # another replica wrote it since the read
                return False
            raise
        self._observe(renewed.spec)
        return True

    def _spec(self, acquired: datetime | None, renewed: datetime, transitions: int) -> LeaseSpec:
        from lightkube.models.coordination_v1 import LeaseSpec

        return LeaseSpec(
            holderIdentity=self.settings.identity,
            leaseDurationSeconds=max(1, math.ceil(self.settings.duration_s)),
            acquireTime=acquired,
            renewTime=renewed,
            leaseTransitions=transitions,
        )

    def _observe(self, spec: LeaseSpec | None) -> None:
        """Note the record; when it changed, the lease's clock restarts now (on this process's clock)."""
        record: tuple[Any, ...] = (None, None, None, None)
        if spec is not None:
            record = (spec.holderIdentity or None, spec.renewTime, spec.acquireTime, spec.leaseTransitions)
        if record == self._observed:
            return
        self._observed, self._observed_at = record, self._clock()
        holder = record[0]
        if holder != self.holder and holder != self.settings.identity:
            log.info("lease %s: the leader is %s", self.settings.name, holder or "(none)")
        self.holder = holder


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]
