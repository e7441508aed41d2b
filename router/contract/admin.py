"""Worker admin wire messages: model info, pause/continue, abort, flush, weight
version, update from disk, memory occupation and the weights checker.

Field names and defaults follow SGLang (``io_struct.py``) and sglang-omni's RL
admin control. Request types are strict (no string-to-bool coercion); unknown
fields are ignored so newer trainers keep working.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, field_validator

from router.contract.base import WireResponse
from router.contract.generate import StrictRequest

PauseMode = Literal["abort", "retract", "in_place"]
CheckerAction = Literal["snapshot", "reset_tensors", "compare", "checksum"]
#: ``cuda_graph`` is one of SGLang's tags; this worker captures no graphs, so it is accepted as a no-op.
MemoryTag = Literal["weights", "kv_cache", "cuda_graph"]


# ----------------------------------------------------------------------------- requests


class EmptyRequest(StrictRequest):
    """A route that takes no fields (any JSON object is accepted and ignored)."""


class PauseRequest(StrictRequest):
    """``POST /pause_generation``: ``abort`` (default) | ``retract`` | ``in_place``."""

    mode: PauseMode = "abort"


class ContinueRequest(StrictRequest):
    """``POST /continue_generation``. ``torch_empty_cache`` (v0.5.15+) is accepted;
    on CUDA it empties the caching allocator before un-pausing."""

    torch_empty_cache: bool = True


class AbortRequest(StrictRequest):
    """``POST /abort_request``: abort requests whose rid starts with ``rid``, or all."""

    rid: Optional[Union[str, list[str]]] = None
    abort_all: bool = False
    finished_reason: Optional[dict[str, Any]] = None
    abort_message: Optional[str] = None


class FlushCacheRequest(StrictRequest):
    """``GET|POST /flush_cache``; ``timeout`` (v0.5.23 query parameter) waits up
    to that many seconds for the worker to become idle before giving up."""

    timeout: float = Field(0.0, ge=0.0, le=300.0, strict=False)


class UpdateWeightVersionRequest(StrictRequest):
    """``POST /update_weight_version``; like SGLang, ``abort_all_requests`` defaults to True."""

    new_version: str
    abort_all_requests: bool = True


class UpdateWeightsFromDiskRequest(StrictRequest):
    """``POST /update_weights_from_disk`` — every field of SGLang's ``UpdateWeightFromDiskReqInput``."""

    model_path: str = Field(min_length=1)
    load_format: Optional[str] = None
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: Optional[dict[str, Any]] = None


class WeightsCheckerRequest(StrictRequest):
    """``GET|POST /weights_checker``; ``action`` defaults to ``checksum`` (SGLang v0.5.15+)."""

    action: CheckerAction = "checksum"
    allow_quant_error: bool = False
    skip_tensor_list: Optional[list[str]] = None
    selector: str = "all"


class MemoryOccupationRequest(StrictRequest):
    """``POST /release_memory_occupation`` and ``/resume_memory_occupation``.

    ``tags`` None or empty means every tag."""

    tags: Optional[list[MemoryTag]] = None

    @field_validator("tags")
    @classmethod
    def _dedupe(cls, tags: Optional[list[str]]) -> Optional[list[str]]:
        return list(dict.fromkeys(tags)) if tags else None


# ----------------------------------------------------------------------------- responses


class RankResult(WireResponse):
    """One rank's outcome of an admin operation."""

    rank: int
    role: str = "tp"
    success: bool
    message: str = ""


class AdminResult(WireResponse):
    """Generic admin response: ``{success, message, rank_results, ...}``.

    Extra action-specific fields sit beside these (``num_paused_requests``,
    ``per_gpu_checksum``, ...)."""

    success: bool
    message: str = ""
    rank_results: Optional[list[RankResult]] = None


class StatusResult(WireResponse):
    """``/pause_generation`` and ``/continue_generation`` reply, as SGLang: ``{"message", "status": "ok"}``."""

    message: str
    status: str = "ok"


class UpdateWeightsFromDiskResult(AdminResult):
    num_paused_requests: int = 0
    weight_version: Optional[str] = None


class UpdateWeightVersionResult(AdminResult):
    new_version: Optional[str] = None


class WeightVersionResult(WireResponse):
    weight_version: str


class WeightsCheckerResult(AdminResult):
    """Checker summary (sglang-omni ``StrictWeightChecker``); ``compare`` adds the diff fields."""

    action: str
    tensor_count: int = 0
    per_gpu_checksum: Optional[str] = None
    per_engine_checksum: Optional[str] = None
    checksums: Optional[dict[str, str]] = None
    elapsed_s: float = 0.0
    matched: Optional[list[str]] = None
    missing: Optional[list[str]] = None
    unexpected: Optional[list[str]] = None
    changed: Optional[list[str]] = None


class ModelInfo(WireResponse):
    """``/model_info``: SGLang's fields plus the sglang-omni admin fields."""

    model_path: str
    tokenizer_path: Optional[str] = None
    is_generation: bool = True
    preferred_sampling_params: Optional[dict[str, Any]] = None
    weight_version: str = "default"
    has_image_understanding: bool = False
    has_audio_understanding: bool = False
    model_type: Optional[str] = None
    architectures: list[str] = Field(default_factory=list)
    served_model_name: Optional[str] = None
    load_format: Optional[str] = None
    tp_size: int = 1
    dtype: str = ""
    device: str = ""
    is_paused: bool = False
    pause_mode: Optional[str] = None
    weights_partial: bool = False
    weights_released: bool = False
    supports_weight_update: bool = True
    supports_weight_checker: bool = True
    rank_results: Optional[list[dict[str, Any]]] = None
