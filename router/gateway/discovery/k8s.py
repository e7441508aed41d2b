"""Worker pods found by label in one Kubernetes namespace (``--service-discovery k8s``).

The loop is the informer pattern, done so that no change can be missed:

    list pods (label selector)  →  the whole candidate set, reconciled
      → watch from the list's resourceVersion  →  each event applied
      → the watch ends (error, 410 Gone, server timeout, our resync bound)
      → list again

Every watch restart re-lists, so a pod deleted while nobody watched (an API
server restart, a dropped connection, compacted history) is gone after that
list, rather than served forever from a stale view. A failed list is retried
with bounded, jittered exponential back-off; while the API server is away
nothing is removed: the router keeps serving the workers it knows, and its own
health probes still take out the ones that stop answering.

A pod is a candidate while it is ``Running``, its ``Ready`` condition is true,
it has an IP and it is not terminating (``deletionTimestamp`` set). NotReady
counts as gone: its readiness probe is what an operator uses to take a worker
out. The worker URL is ``http://<podIP>:<port>``, the port from
``--service-discovery-port`` or else the container port named ``http``.

The Kubernetes client is lightkube (optional extra ``omni-router[k8s]``): an
asyncio client with typed models that reads credentials the usual way (the
pod's service account inside a cluster, else ``KUBECONFIG``, else
``~/.kube/config``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential_jitter

from router.gateway.k8s_extra import require_client

if TYPE_CHECKING:
    from lightkube import AsyncClient

log = logging.getLogger(__name__)

#: The pod label (or annotation) that names the engine its worker runs: ``omni``, ``vllm``, ``sglang`` or ``auto``.
ENGINE_LABEL = "omni-router.io/engine"

#: A watch session lasts at most this long before a full re-list (a periodic resync, as informers do).
RESYNC_S = 300.0
#: Bounds of the back-off between failed lists: the API server is asked again at least this often.
BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 30.0
#: How long one list or one HTTP exchange with the API server may take.
API_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class PodWorker:
    """A worker candidate: the URL to reach it, the pod (``namespace/name``) it runs in, and the engine its
    pod names (:data:`ENGINE_LABEL`, as a label or an annotation; ``None``: the router's ``--worker-engine``)."""

    url: str
    pod: str
    engine: str | None = None


@dataclass(slots=True)
class DiscoveryStatus:
    """What ``GET /health`` reports about discovery."""

    connected: bool = False
    last_sync: float | None = None
    last_error: str | None = None
    failures: int = 0
    pods_seen: int = 0
    candidates: int = 0

    def view(self) -> dict[str, Any]:
        age = None if self.last_sync is None else round(time.time() - self.last_sync, 1)
        return {
            "connected": self.connected,
            "seconds_since_list": age,
            "last_error": self.last_error,
            "consecutive_failures": self.failures,
            "pods_seen": self.pods_seen,
            "candidates": self.candidates,
        }


class ListFailed(Exception):
    """Listing pods failed: retried with back-off."""


def is_candidate(pod: Any) -> bool:
    """Running, Ready, with an IP, not terminating."""
    status, meta = pod.status, pod.metadata
    if status is None or meta is None or meta.deletionTimestamp is not None:
        return False
    if status.phase != "Running" or not status.podIP:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])


def worker_port(pod: Any, port: int | None) -> int | None:
    """The flag's port, else the first container port named ``http``."""
    if port is not None:
        return port
    for container in pod.spec.containers if pod.spec is not None else []:
        for p in container.ports or []:
            if p.name == "http":
                return int(p.containerPort)
    return None


def pod_url(ip: str, port: int) -> str:
    return f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}"


@dataclass
class KubernetesPods:
    """List-then-watch pods matching ``selector`` in ``namespace``; calls ``on_change`` with every new candidate set."""

    selector: Mapping[str, str]
    on_change: Callable[[dict[str, PodWorker]], None]
    namespace: str | None = None
    port: int | None = None
    client_factory: Callable[[], AsyncClient] | None = None
    resync_s: float = RESYNC_S
    status: DiscoveryStatus = field(default_factory=DiscoveryStatus)
    _pods: dict[str, Any] = field(default_factory=dict)
    _published: dict[str, PodWorker] | None = None
    _unnamed_port: set[str] = field(default_factory=set)

    async def run(self) -> None:
        """Forever: list, watch, re-list. Cancel the task to stop."""
        client = self._client()
        namespace = self.namespace or client.namespace
        log.info("discovering worker pods in namespace %s with labels %s", namespace, dict(self.selector))
        quick_failures = 0
        try:
            while True:
                version = await self._list_with_backoff(client, namespace)
                started = time.monotonic()
                failed = await self._watch(client, namespace, version)
                # A watch refused at once while lists succeed (say, RBAC without "watch") must not spin.
                quick_failures = quick_failures + 1 if failed and time.monotonic() - started < 1.0 else 0
                if quick_failures:
                    await asyncio.sleep(min(BACKOFF_INITIAL_S * 2**quick_failures, BACKOFF_MAX_S))
        finally:
            await client.close()

    def _client(self) -> AsyncClient:
        if self.client_factory is not None:
            return self.client_factory()
        require_client()
        import httpx2
        from lightkube import AsyncClient

        return AsyncClient(timeout=httpx2.Timeout(API_TIMEOUT_S), field_manager="omni-router")

    async def _list_with_backoff(self, client: AsyncClient, namespace: str) -> str:
        retrying = AsyncRetrying(
            wait=wait_exponential_jitter(initial=BACKOFF_INITIAL_S, max=BACKOFF_MAX_S),
            retry=retry_if_exception_type(ListFailed),
            before_sleep=lambda state: log.warning(
                "listing worker pods failed %d time(s), retrying: %s", state.attempt_number, self.status.last_error
            ),
        )
        async for attempt in retrying:
            with attempt:
                return await self._list(client, namespace)
        raise AssertionError("unreachable: the retry above never stops")

    async def _list(self, client: AsyncClient, namespace: str) -> str:
        """One full list: the candidate set is replaced, so pods deleted meanwhile disappear."""
        from lightkube.resources.core_v1 import Pod

        try:
            async with asyncio.timeout(API_TIMEOUT_S):
                listing = client.list(Pod, namespace=namespace, labels=dict(self.selector))
                pods: dict[str, Any] = {_uid(p): p async for p in listing}
                version = listing.resourceVersion
        except Exception as exc:  # any API or transport failure: keep what we know, retry later
            self._failed(f"list: {_describe(exc)}")
            raise ListFailed(str(exc)) from exc
        self._pods = pods
        self.status.connected, self.status.last_sync, self.status.failures = True, time.time(), 0
        self._publish()
        return version

    async def _watch(self, client: AsyncClient, namespace: str, version: str) -> bool:
        """Apply events from ``version`` on, until the stream fails (returns True) or the resync bound."""
        from lightkube.resources.core_v1 import Pod

        try:
            async with asyncio.timeout(self.resync_s):
                stream = client.watch(
                    Pod,
                    namespace=namespace,
                    labels=dict(self.selector),
                    resource_version=version,
                    server_timeout=int(self.resync_s),
                )
                async for kind, pod in stream:
                    self._apply(kind, pod)
        except TimeoutError:
            log.debug("watch resync after %.0fs: listing again", self.resync_s)
        except Exception as exc:  # 410 Gone, a dropped connection, the API server away: list again
            self._failed(f"watch: {_describe(exc)}")
            log.info("pod watch ended (%s); listing again", self.status.last_error)
            return True
        return False

    def _apply(self, kind: str, pod: Any) -> None:
        uid = _uid(pod)
        if kind == "DELETED":
            self._pods.pop(uid, None)
        elif kind in ("ADDED", "MODIFIED"):
            self._pods[uid] = pod
        else:  # BOOKMARK carries no pod change
            return
        self._publish()

    def _publish(self) -> None:
        candidates: dict[str, PodWorker] = {}
        for pod in sorted(self._pods.values(), key=lambda p: p.metadata.name or ""):
            if not is_candidate(pod):
                continue
            name = f"{pod.metadata.namespace}/{pod.metadata.name}"
            port = worker_port(pod, self.port)
            if port is None:
                if name not in self._unnamed_port:
                    self._unnamed_port.add(name)
                    log.warning(
                        "pod %s has no container port named 'http' and no --service-discovery-port: skipped", name
                    )
                continue
            url = pod_url(pod.status.podIP, port)
            candidates[url] = PodWorker(url=url, pod=name, engine=pod_engine(pod))
        self.status.pods_seen, self.status.candidates = len(self._pods), len(candidates)
        if candidates != self._published:
            self._published = candidates
            self.on_change(dict(candidates))

    def _failed(self, message: str) -> None:
        self.status.connected = False
        self.status.failures += 1
        self.status.last_error = message


def pod_engine(pod: Any) -> str | None:
    """The engine a pod names for its worker: its :data:`ENGINE_LABEL` label, else that annotation."""
    meta = pod.metadata
    for names in (meta.labels, meta.annotations):
        value = (names or {}).get(ENGINE_LABEL)
        if value:
            return str(value)
    return None


def _uid(pod: Any) -> str:
    meta = pod.metadata
    return str(meta.uid or f"{meta.namespace}/{meta.name}")


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]
