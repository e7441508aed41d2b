"""The vLLM worker extension: the two-phase weight sync on every rank of a vLLM server.

Loaded with ``--worker-extension-cls worker.vllm_plugin.extension.OmniWeightSyncExtension``: vLLM
adds this class to its Worker's bases, and the endpoint plugin (:mod:`worker.vllm_plugin.endpoints`)
calls the ``omni_*`` methods on every rank with ``engine_client.collective_rpc(...)``.

* Every attribute is prefixed ``omni_``: vLLM refuses an extension whose names collide with its
  Worker's. The per-rank state lives in one instance attribute created on first use.
* Requests and answers cross vLLM's RPC as JSON strings of this project's wire models
  (:mod:`router.contract.weight_sync`), parsed once on each side, so vLLM's serializer only ever
  carries plain strings.
* The rank's state and rules are :class:`~worker.vllm_plugin.rank_sync.RankWeightSync`; this class
  only gathers what it needs from vLLM: the rank, the device, the served checkpoint's spec and how
  to load weights.
* Weights are loaded with the worker's ``reload_weights`` (vLLM's in-place reload: the model's own
  ``load_weights`` between ``initialize_layerwise_reload`` and ``finalize_layerwise_reload``). A bare
  ``model.load_weights`` is not enough: after start-up vLLM may have repacked a layer's weight into a
  kernel format (on CPU the linear weights are replaced by packed oneDNN handles), and the reload
  rebuilds and re-processes each layer from checkpoint tensors.
"""

from __future__ import annotations

from functools import partial
from typing import Any, TypeVar

import torch
from pydantic import BaseModel

from router.contract.base import WireResponse
from router.contract.weight_sync import (
    AbortWeightsUpdateRequest,
    CompleteWeightsUpdateRequest,
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    PrepareWeightsUpdateRequest,
)
from router.dataplane.buckets import NamedTensors
from worker.vllm_plugin.rank_sync import RankContext, RankWeightSync
from worker.vllm_plugin.spec import checkpoint_spec, ignored_names

M = TypeVar("M", bound=BaseModel)


class OmniWeightSyncExtension:
    """Mixed into vLLM's Worker; each method takes and returns one JSON string (see the module docstring)."""

    # Set by vLLM's Worker; declared for the type checker only.
    vllm_config: Any
    rank: int
    device: torch.device

    def omni_init_weights_update_group(self, request: str) -> str:
        return _json(omni_rank_sync(self).init_group(_parse(InitWeightsUpdateGroupRequest, request)))

    def omni_destroy_weights_update_group(self, request: str) -> str:
        return _json(omni_rank_sync(self).destroy_group(_parse(DestroyWeightsUpdateGroupRequest, request)))

    def omni_prepare_weights_update(self, request: str) -> str:
        return _json(omni_rank_sync(self).prepare(_parse(PrepareWeightsUpdateRequest, request)))

    def omni_complete_weights_update(self, request: str) -> str:
        return _json(omni_rank_sync(self).complete(_parse(CompleteWeightsUpdateRequest, request)))

    def omni_abort_weights_update(self, request: str) -> str:
        return _json(omni_rank_sync(self).abort(_parse(AbortWeightsUpdateRequest, request)))


def omni_rank_sync(worker: Any) -> RankWeightSync:
    """The rank's :class:`RankWeightSync`, created on the first call (the model is loaded by then)."""
    state = getattr(worker, "omni_weight_sync", None)
    if state is None:
        state = RankWeightSync(_context(worker))
        worker.omni_weight_sync = state
    return state


def _context(worker: Any) -> RankContext:
    config = worker.vllm_config
    parallel = config.parallel_config
    if parallel.data_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        # Ranks would then be counted per data-parallel replica and layers split across stages;
        # neither is laid out here, so such servers are refused rather than synced wrongly.
        raise RuntimeError("the omni weight sync serves tensor parallelism only (no data or pipeline parallelism)")
    model_config = config.model_config
    tied = bool(getattr(model_config.hf_config, "tie_word_embeddings", False))
    return RankContext(
        rank=int(worker.rank),
        num_ranks=int(parallel.world_size),
        device=torch.device(worker.device),
        spec=partial(checkpoint_spec, str(model_config.model), model_config.dtype),
        is_ignored=ignored_names(tied),
        apply=partial(_reload, worker),
    )


def _reload(worker: Any, named: NamedTensors) -> None:
    """vLLM's in-place reload of checkpoint-format weights, on this rank's main thread."""
    worker.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
    if worker.device.type == "cuda":
        torch.cuda.synchronize(worker.device)


def _parse(model: type[M], request: str) -> M:
    # The endpoint already validated this body; a failure here is a bug, and vLLM reports it as the call's error.
    return model.model_validate_json(request)


def _json(answer: WireResponse) -> str:
    return answer.model_dump_json()
