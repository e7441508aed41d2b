"""Fleet-wide reads: is every worker on the same weights?

- ``/model_info`` and ``/get_weight_version``: the common ``weight_version``,
  or 409 listing each worker's version when they differ (a mixed fleet must
  not look healthy to a trainer).
- ``/get_weight_version`` and vLLM's ``/weight_info``: likewise.
- vLLM's ``/weight_checker`` with ``checksum``: every worker's per-tensor SHA-256 map and whether
  they are the same key for key (``differing`` names the keys that are not).
- ``/weights_checker`` with ``checksum``: every worker's checksum and whether
  they are all identical (``worker_checksums`` holds the engine-level digest,
  which covers every TP rank; ``rank_checksums`` each rank's checksum of the
  full tensors it serves, which a trainer recomputes from the tensors it sent,
  and which ``identical`` compares, so workers of different TP sizes compare).
- ``/server_info`` asked vLLM's way: the fleet as one vLLM server whose data-parallel
  replicas are the workers (a trainer reads the model and the weight-transfer backend there).
- ``/reset_prefix_cache``: answered once every worker answered; ``success`` only when every
  worker reset its cache (a worker still serving requests says no, and the caller may retry).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from router.contract.admin import (
    EmptyRequest,
    ModelInfo,
    ServerInfo,
    WeightsCheckerRequest,
    WeightsCheckerResult,
    WeightVersionResult,
)
from router.contract.base import WireResponse
from router.contract.errors import Conflict
from router.contract.fleet import FleetModelInfo, FleetWeightVersion, WorkerVersion
from router.contract.fleet_answers import (
    FleetAnswer,
    ResetPrefixCacheFleetAnswer,
    ServerInfoFleetAnswer,
    VllmWeightCheckerFleetAnswer,
    WeightsCheckerFleetAnswer,
    WorkerResult,
)
from router.contract.vllm import EmptyVllmRequest
from router.contract.vllm_rl import VllmWeightCheckerRequest, VllmWeightCheckerResult, WeightInfo
from router.contract.vllm_server import (
    ResetPrefixCacheRequest,
    ResetPrefixCacheResult,
    ServerInfoRequest,
    VllmConfigView,
)
from router.gateway.admin.answers import Outcome
from router.gateway.admin.broadcast import broadcast
from router.gateway.admin.fanout import AdminCall
from router.gateway.admin.locked import AdminContext
from router.gateway.admin.operations import (
    GET_WEIGHT_VERSION,
    MODEL_INFO,
    RESET_PREFIX_CACHE,
    SERVER_INFO,
    WEIGHT_CHECKER,
    WEIGHT_INFO,
    WEIGHTS_CHECKER,
)

R = TypeVar("R", bound=WireResponse)


def fleet_vllm_config(views: list[VllmConfigView]) -> VllmConfigView:
    """Workers as the data-parallel replicas of one vLLM server. The weight-transfer backend is
    reported only when every worker builds the same one (a trainer cannot join a mixed fleet)."""
    first = views[0]
    backends = {v.weight_transfer_config.backend if v.weight_transfer_config else None for v in views}
    parallel = first.parallel_config.model_copy(update={"data_parallel_size": len(views)})
    return first.model_copy(
        update={
            "parallel_config": parallel,
            "weight_transfer_config": first.weight_transfer_config if len(backends) == 1 else None,
        }
    )


def _version_of(result: WorkerResult[WireResponse]) -> str | None:
    body = result.body
    return body.weight_version if isinstance(body, (ModelInfo, WeightVersionResult, WeightInfo)) else None


class FleetViews:
    """Broadcast a read, then judge the fleet's consistency."""

    def __init__(self, ctx: AdminContext) -> None:
        self._ctx = ctx

    def _record_versions(self, results: Sequence[WorkerResult[WireResponse]]) -> None:
        for r in results:
            worker = self._ctx.registry.find(r.worker)
            version = _version_of(r)
            if worker is None or version is None:
                continue
            worker.weight_version = version
            if isinstance(r.body, ModelInfo):
                worker.weight_state = r.body.weight_state
                worker.instance_id = r.body.instance_id or worker.instance_id
                if r.body.tp_size >= 1:
                    worker.tp_size = r.body.tp_size

    def _is_mixed(self, worker_id: str) -> bool:
        worker = self._ctx.registry.find(worker_id)
        return worker is not None and worker.weight_state in ("partial", "writing")

    def _common_version(self, results: Sequence[WorkerResult[WireResponse]]) -> str:
        partial = [r.worker for r in results if isinstance(r.body, ModelInfo) and r.body.weights_partial]
        if partial:
            raise Conflict(
                f"the fleet does not hold whole weights: worker(s) {', '.join(partial)} hold a mix of versions",
                partial_workers=partial,
                results=[r.model_dump(mode="json") for r in results],
            )
        versions = {r.worker: _version_of(r) for r in results}
        distinct = set(versions.values())
        if len(distinct) != 1 or None in distinct:
            listing = ", ".join(f"{w}={v}" for w, v in versions.items())
            raise Conflict(
                f"mixed worker weight_version: {listing}",
                versions=versions,
                results=[r.model_dump(mode="json") for r in results],
            )
        version = distinct.pop()
        assert version is not None
        return version

    async def model_info(
        self, call: AdminCall[EmptyRequest, ModelInfo]
    ) -> tuple[int, ModelInfo | FleetAnswer[ModelInfo]]:
        outcome = await broadcast(self._ctx, MODEL_INFO, call)
        results = outcome.answer.results
        self._record_versions(results)
        if not outcome.ok:
            return outcome.status, outcome.answer
        version = self._common_version(results)
        first = results[0].body
        assert first is not None  # every worker answered
        workers = [WorkerVersion(id=r.worker, url=r.url, weight_version=_version_of(r)) for r in results]
        info = {**first.model_dump(), "weight_version": version, "worker_count": len(results), "workers": workers}
        return 200, FleetModelInfo.model_validate(info)

    async def weight_version(
        self, call: AdminCall[EmptyRequest, WeightVersionResult]
    ) -> tuple[int, WeightVersionResult | FleetAnswer[WeightVersionResult]]:
        """``/get_weight_version`` (SGLang's spelling): the version every worker holds."""
        return await self._version(await broadcast(self._ctx, GET_WEIGHT_VERSION, call))

    async def weight_info(
        self, call: AdminCall[EmptyVllmRequest, WeightInfo]
    ) -> tuple[int, WeightVersionResult | FleetAnswer[WeightInfo]]:
        """vLLM's ``/weight_info``: the version every worker holds, as for ``/get_weight_version``."""
        return await self._version(await broadcast(self._ctx, WEIGHT_INFO, call))

    async def _version(self, outcome: Outcome[R]) -> tuple[int, WeightVersionResult | FleetAnswer[R]]:
        results = outcome.answer.results
        self._record_versions(results)
        if not outcome.ok:
            return outcome.status, outcome.answer
        return 200, FleetWeightVersion(weight_version=self._common_version(results), worker_count=len(results))

    async def weights_checker(
        self, req: WeightsCheckerRequest, call: AdminCall[WeightsCheckerRequest, WeightsCheckerResult]
    ) -> Outcome[WeightsCheckerResult]:
        outcome = await broadcast(self._ctx, WEIGHTS_CHECKER, call)
        answer = outcome.answer
        if req.action == "checksum" and isinstance(answer, WeightsCheckerFleetAnswer):
            bodies = {r.worker: r.body for r in answer.results}
            sums = {w: (b.per_engine_checksum or b.per_gpu_checksum) if b else None for w, b in bodies.items()}
            ranks = {w: b.checksums_per_rank() if b else [] for w, b in bodies.items()}
            # Identical means every worker serves the same tensors: every rank the same full tensors (omni-worker
            # reports full-tensor checksums, so workers of different TP sizes compare), or every worker the same
            # shards rank for rank (SGLang reports each rank's own shards).
            values = {c for sums_of_worker in ranks.values() for c in sums_of_worker}
            same_ranks = len({tuple(r) for r in ranks.values()}) == 1
            partial = [r.worker for r in answer.results if self._is_mixed(r.worker)]
            answer.worker_checksums = sums
            answer.rank_checksums = ranks
            answer.partial_workers = partial
            answer.identical = (
                outcome.ok
                and all(ranks.values())
                and None not in sums.values()
                and (len(values) == 1 or same_ranks)
                and not partial
            )
        return outcome

    async def vllm_weight_checker(
        self, req: VllmWeightCheckerRequest, call: AdminCall[VllmWeightCheckerRequest, VllmWeightCheckerResult]
    ) -> Outcome[VllmWeightCheckerResult]:
        """vLLM's ``/weight_checker``; with ``checksum``, whether every worker holds the same weights key for key."""
        outcome = await broadcast(self._ctx, WEIGHT_CHECKER, call)
        answer = outcome.answer
        if req.action == "checksum" and isinstance(answer, VllmWeightCheckerFleetAnswer):
            maps = [r.body.checksums if r.body is not None else None for r in answer.results]
            known = [m for m in maps if m is not None]
            keys = sorted({k for m in known for k in m})
            answer.differing = [k for k in keys if len({m.get(k) for m in known}) != 1]
            partial = [r.worker for r in answer.results if self._is_mixed(r.worker)]
            answer.identical = (
                outcome.ok and bool(keys) and len(known) == len(maps) and not answer.differing and not partial
            )
        return outcome

    async def server_info(
        self, req: ServerInfoRequest, call: AdminCall[ServerInfoRequest, ServerInfo]
    ) -> Outcome[ServerInfo]:
        outcome = await broadcast(self._ctx, SERVER_INFO, call)
        answer = outcome.answer
        if req.config_format is None or not outcome.ok or not isinstance(answer, ServerInfoFleetAnswer):
            return outcome
        views = [
            r.body.vllm_config
            for r in answer.results
            if r.body is not None and isinstance(r.body.vllm_config, VllmConfigView)
        ]
        if len(views) != len(answer.results) or not views:
            return outcome
        fleet = fleet_vllm_config(views)
        answer.vllm_config = fleet if req.config_format == "json" else fleet.summary()
        answer.vllm_env = {}
        first = answer.results[0].body
        answer.system_env = first.system_env if first is not None else None
        return outcome

    async def reset_prefix_cache(
        self, call: AdminCall[ResetPrefixCacheRequest, ResetPrefixCacheResult]
    ) -> Outcome[ResetPrefixCacheResult]:
        outcome = await broadcast(self._ctx, RESET_PREFIX_CACHE, call)
        answer = outcome.answer
        if outcome.ok and isinstance(answer, ResetPrefixCacheFleetAnswer):
            held = [r.worker for r in answer.results if r.body is None or not r.body.success]
            answer.success = not held
            if held:
                answer.message = f"cache still held by running requests on {', '.join(held)}; retry once they end"
        return outcome
