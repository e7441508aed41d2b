"""vLLM's weight-transfer API across the fleet, as :class:`~router.trainer.calls.RouterCalls` methods.

A vLLM-flow trainer builds its group once (:meth:`VllmCalls.init_weight_transfer_engine`, while it joins
as rank 0 with :class:`~router.trainer.sender.TrainerWeightSender`, both through
:func:`~router.trainer.rendezvous.alongside`); then per sync it pauses generation, opens the update
(:meth:`VllmCalls.start_weight_update`), posts each chunk (:meth:`VllmCalls.update_weights`) on a
thread while :func:`router.trainer.vllm_sender.send` broadcasts it, commits (:meth:`VllmCalls.finish_weight_update`)
and resumes. The router holds its update lock and fence from the start to the finish (docs/weight-sync.md).

``expected_checksum`` (:func:`~router.trainer.digests.expected_checksum` of the tensors sent) is taken by
the calls that change the weights in the router's operations table, the finish and ``/collective_rpc``:
the router then publishes the update only where every worker serves exactly those tensors, and answers
502 (:class:`~router.trainer.calls.RouterCallError`) with each worker's digest otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from router.contract import endpoints as ep
from router.contract.base import WireRequest
from router.contract.fleet_answers import (
    FleetAnswer,
    IsPausedFleetAnswer,
    PauseFleetAnswer,
    VllmWeightCheckerFleetAnswer,
    WeightTransferFleetAnswer,
    WeightTransferInitFleetAnswer,
)
from router.contract.vllm import (
    EmptyVllmRequest,
    FinishWeightUpdateRequest,
    InitWeightTransferEngineRequest,
    PauseQuery,
    StartWeightUpdateRequest,
    UpdateWeightsRequest,
    VllmPauseMode,
    VllmResult,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from router.contract.vllm_rl import (
    CollectiveRpcRequest,
    CollectiveRpcResult,
    VllmCheckerAction,
    VllmWeightCheckerRequest,
)
from router.trainer.transport import Transport, given

M = TypeVar("M", bound=WireRequest)


def _model(model: type[M], value: M | Mapping[str, Any]) -> M:
    """``value`` as ``model``: a trainer may hand the dict vLLM's examples build (and
    :func:`router.trainer.vllm_sender.update_info` returns); a malformed one fails here, before any call."""
    return value if isinstance(value, model) else model.model_validate(value)


class VllmCalls(Transport):
    """vLLM's calls; the transport (``_admin``, ``_plain``) is :class:`~router.trainer.calls.RouterCalls`'."""

    # -- the group
    def init_weight_transfer_engine(
        self, init_info: WeightTransferInitInfo | Mapping[str, Any]
    ) -> WeightTransferInitFleetAnswer:
        """Make every worker join the trainer's group (``init_info``: vLLM's ``NCCLWeightTransferInitInfo``,
        ``world_size`` = 1 + :meth:`~router.trainer.calls.RouterCalls.get_world_size`'s). The call blocks until
        every rank met, so the trainer joins as rank 0 alongside it; the answer names each worker's ranks."""
        req = InitWeightTransferEngineRequest(init_info=_model(WeightTransferInitInfo, init_info))
        return self._admin(ep.INIT_WEIGHT_TRANSFER_ENGINE, req, WeightTransferInitFleetAnswer)

    def shutdown_weight_transfer_engine(self) -> FleetAnswer[VllmResult]:
        """Release the group on every worker; the router forgets it, so the next sync needs a new init."""
        return self._admin(ep.SHUTDOWN_WEIGHT_TRANSFER_ENGINE, EmptyVllmRequest(), FleetAnswer[VllmResult])

    # -- one sync
    def start_weight_update(self, *, timeout_s: float | None = None) -> WeightTransferFleetAnswer:
        """Open the update on every worker; the router holds its lock and fence until the finish.
        ``timeout_s`` bounds the whole update: one never finished ends by itself after it, fenced."""
        req = StartWeightUpdateRequest(**given(timeout_s=timeout_s))
        return self._admin(ep.START_WEIGHT_UPDATE, req, WeightTransferFleetAnswer)

    def update_weights(self, update_info: WeightTransferUpdateInfo | Mapping[str, Any]) -> WeightTransferFleetAnswer:
        """vLLM's ``/update_weights``: every worker receives the chunk ``update_info`` announces. It answers once
        the broadcast is received, so post it on a thread while :func:`router.trainer.vllm_sender.send` runs.
        No digest here: a chunk changes nothing the fleet serves until the finish."""
        req = UpdateWeightsRequest(update_info=_model(WeightTransferUpdateInfo, update_info))
        return self._admin(ep.UPDATE_WEIGHTS, req, WeightTransferFleetAnswer)

    def finish_weight_update(
        self,
        weight_version: str | None = None,
        *,
        flush_cache: bool | None = None,
        expected_checksum: str | None = None,
    ) -> WeightTransferFleetAnswer:
        """Commit the update under ``weight_version`` (the answer's ``weight_version`` is the fleet's afterwards).
        ``flush_cache``: drop the KV cache computed with the old weights (the workers' default: yes).
        ``expected_checksum``: the digest every worker must then serve; the version is published only if each does."""
        req = FinishWeightUpdateRequest(**given(weight_version=weight_version, flush_cache=flush_cache))
        return self._admin(ep.FINISH_WEIGHT_UPDATE, req, WeightTransferFleetAnswer, expected_checksum)

    # -- generation
    def pause(
        self,
        mode: VllmPauseMode = "abort",
        *,
        wait_for_inflight_requests: bool | None = None,
        clear_cache: bool | None = None,
        timeout_s: float | None = None,
    ) -> PauseFleetAnswer:
        """vLLM's ``/pause``: ``abort`` ends running requests, ``wait`` drains them (up to ``timeout_s``),
        ``keep`` freezes them with their KV. Sent as query parameters, as vLLM reads them."""
        req = PauseQuery(
            mode=mode,
            **given(
                wait_for_inflight_requests=wait_for_inflight_requests, clear_cache=clear_cache, timeout_s=timeout_s
            ),
        )
        return self._admin(ep.PAUSE, req, PauseFleetAnswer)

    def resume(self) -> PauseFleetAnswer:
        """vLLM's ``/resume``: serialized with updates, so it never lands inside one."""
        return self._admin(ep.RESUME, EmptyVllmRequest(), PauseFleetAnswer)

    def is_paused(self) -> IsPausedFleetAnswer:
        """``is_paused`` is true only when every live worker is paused."""
        return self._admin(ep.IS_PAUSED, EmptyVllmRequest(), IsPausedFleetAnswer)

    # -- vLLM's dev routes (a real vLLM server with VLLM_SERVER_DEV_MODE=1)
    def collective_rpc(
        self,
        method: str,
        args: Sequence[str] = (),
        kwargs: Mapping[str, str] | None = None,
        *,
        timeout: float | None = None,
        expected_checksum: str | None = None,
    ) -> FleetAnswer[CollectiveRpcResult]:
        """Call a worker method on every rank (``reload_weights`` with ``kwargs={"weights_path": ...}`` reloads a
        checkpoint); string arguments only, as vLLM takes them. Unless the method only reads, the router runs it
        as a weight update, so ``expected_checksum`` applies as for :meth:`finish_weight_update`."""
        fields = given(method=method, args=list(args) or None, kwargs=dict(kwargs) if kwargs else None, timeout=timeout)
        req = CollectiveRpcRequest.model_validate(fields)
        return self._admin(ep.COLLECTIVE_RPC, req, FleetAnswer[CollectiveRpcResult], expected_checksum)

    def weight_checker(
        self, action: VllmCheckerAction = "checksum", baseline: Mapping[str, str] | None = None
    ) -> VllmWeightCheckerFleetAnswer:
        """vLLM's checker on every worker: per-parameter SHA-256 (``checksum``), or a ``compare`` against
        ``baseline``; ``identical`` says whether the workers agree."""
        fields = given(action=action, baseline=dict(baseline) if baseline is not None else None)
        req = VllmWeightCheckerRequest.model_validate(fields)
        return self._admin(ep.WEIGHT_CHECKER, req, VllmWeightCheckerFleetAnswer)
