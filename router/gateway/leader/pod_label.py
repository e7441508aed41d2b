"""The replica's role on its own pod (``--leader-pod-label``), so a Service can select the leader.

With the label on, both replicas can be Ready (readiness is "this process serves", not "this
replica leads"), which is what lets a PodDisruptionBudget keep one replica up during a drain; the
Service selects ``<label>=leader`` so traffic still goes only to the leader:

::

    start-up                the pod is labelled ``standby`` (a container restarted after leading
                            would otherwise keep ``leader`` from its previous life)
    the gate opens          ``leader``
    leadership lost         nothing: the process exits at once; its successor's start-up relabels it

Correctness never depends on the label: while it is stale (a leader that crashed, a relabel the
API server has not taken yet) the replica's gate still refuses with the standby's 503, which a
client sends again. So a failed patch is logged and tried again every retry period, never fatal.
The patch is a JSON merge patch of ``metadata.labels`` through the elector's lightkube client; it
needs ``patch`` on pods in the router's Role.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from router.gateway.leader.elector import LeaseElector

if TYPE_CHECKING:
    from lightkube import AsyncClient

log = logging.getLogger(__name__)

#: One patch may take this long.
PATCH_TIMEOUT_S = 5.0


async def label_own_pod(
    client: AsyncClient, *, pod: str, namespace: str | None, key: str, value: str, retry_s: float
) -> None:
    """Set ``key=value`` on the pod ``pod``; tried every ``retry_s`` until it is taken (cancel to stop)."""
    from lightkube.resources.core_v1 import Pod
    from lightkube.types import PatchType

    while True:
        try:
            async with asyncio.timeout(PATCH_TIMEOUT_S):
                await client.patch(
                    Pod, pod, {"metadata": {"labels": {key: value}}}, namespace=namespace, patch_type=PatchType.MERGE
                )
        except Exception as exc:  # the API server away, no permission: the gate keeps the router correct
            log.warning("could not label pod %s %s=%s (%s); trying again", pod, key, value, exc)
            await asyncio.sleep(retry_s)
            continue
        log.info("pod %s labelled %s=%s", pod, key, value)
        return


class PodRole:
    """Keeps this replica's role label on its pod: the latest value asked for wins."""

    def __init__(self, elector: LeaseElector, key: str):
        self._elector = elector
        self._key = key
        self._task: asyncio.Task[None] | None = None

    def set(self, value: str) -> None:
        if self._task is not None:
            self._task.cancel()
        s = self._elector.settings
        self._task = asyncio.create_task(
            label_own_pod(
                self._elector.client(),
                pod=s.identity,
                namespace=s.namespace,
                key=self._key,
                value=value,
                retry_s=s.retry_period_s,
            ),
            name=f"pod-label-{value}",
        )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
