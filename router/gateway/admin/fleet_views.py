"""Fleet-wide reads: is every worker on the same weights?

- ``/model_info`` and ``/get_weight_version``: the common ``weight_version``,
  or 409 listing each worker's version when they differ (a mixed fleet must
  not look healthy to a trainer).
- ``/weights_checker`` with ``checksum``: every worker's checksum and whether
  they are all identical (``checksums`` holds the engine-level digest, which
  covers every TP rank; ``rank_checksums`` each rank's own, which a trainer
  can recompute from the tensors it sent).
"""

from __future__ import annotations

from typing import Any

from router.gateway.admin.broadcast import AdminBroadcaster, AdminCall, Outcome
from router.contract.errors import Conflict
from router.gateway.admin.operations import Operation
from router.contract.fleet import WorkerResult
from router.gateway.fleet.registry import tp_size_of

CHECKSUM_KEYS = ("per_engine_checksum", "per_gpu_checksum", "checksum")


def _version_of(result: WorkerResult) -> str | None:
    body = result.body
    if isinstance(body, dict) and isinstance(body.get("weight_version"), str):
        return body["weight_version"]
    return None


class FleetViews:
    """Broadcast a read, then judge the fleet's consistency."""

    def __init__(self, broadcaster: AdminBroadcaster):
        self._b = broadcaster

    async def _read(self, op: Operation, call: AdminCall) -> tuple[Outcome, list[WorkerResult]]:
        outcome = await self._b.broadcast(op, call)
        return outcome, outcome.response.results

    def _record_versions(self, results: list[WorkerResult]) -> None:
        for r in results:
            worker = self._b.registry.find(r.worker)
            version = _version_of(r)
            if worker is not None and version is not None:
                worker.weight_version = version
                tp = tp_size_of(r.body)
                if tp is not None:
                    worker.tp_size = tp

    def _common_version(self, results: list[WorkerResult]) -> str:
        versions = {r.worker: _version_of(r) for r in results}
        distinct = set(versions.values())
        if len(distinct) != 1 or None in distinct:
            listing = ", ".join(f"{w}={v}" for w, v in versions.items())
            raise Conflict(
                f"mixed worker weight_version: {listing}",
                versions=versions,
                results=[r.model_dump() for r in results],
            )
        return distinct.pop()  # type: ignore[return-value]

    async def model_info(self, op: Operation, call: AdminCall) -> tuple[int, dict[str, Any]]:
        outcome, results = await self._read(op, call)
        self._record_versions(results)
        if not outcome.ok:
            return outcome.status, outcome.response.model_dump()
        version = self._common_version(results)
        first = results[0].body if isinstance(results[0].body, dict) else {}
        workers = [{"id": r.worker, "url": r.url, "weight_version": _version_of(r)} for r in results]
        return 200, {**first, "weight_version": version, "worker_count": len(results), "workers": workers}

    async def weight_version(self, op: Operation, call: AdminCall) -> tuple[int, dict[str, Any]]:
        outcome, results = await self._read(op, call)
        self._record_versions(results)
        if not outcome.ok:
            return outcome.status, outcome.response.model_dump()
        return 200, {"weight_version": self._common_version(results), "worker_count": len(results)}

    async def weights_checker(self, op: Operation, call: AdminCall, action: str) -> tuple[int, dict[str, Any]]:
        outcome, results = await self._read(op, call)
        body = outcome.response.model_dump()
        if action == "checksum":
            sums = {r.worker: _checksum(r.body) for r in results}
            values = set(sums.values())
            body["checksums"] = sums
            body["rank_checksums"] = {r.worker: _rank_checksums(r.body) for r in results}
            body["identical"] = outcome.ok and None not in values and len(values) == 1
        return outcome.status, body


def _checksum(body: Any) -> str | None:
    if not isinstance(body, dict):
        return None
    for key in CHECKSUM_KEYS:
        if isinstance(body.get(key), str):
            return body[key]
    return None


def _rank_checksums(body: Any) -> list[str]:
    """Each rank's own checksum (the scheme a trainer can recompute from the tensors it sent)."""
    if not isinstance(body, dict):
        return []
    ranks = body.get("ranks")
    if isinstance(ranks, list):
        found = [r.get("per_gpu_checksum") for r in ranks if isinstance(r, dict)]
        if found and all(isinstance(c, str) for c in found):
            return found
    single = body.get("per_gpu_checksum")
    return [single] if isinstance(single, str) else []
