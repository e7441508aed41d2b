"""Worker admin wire messages: model info, pause/continue, abort, flush, weight
version, update from disk, memory occupation and the weights checker.

Field names and defaults follow SGLang (``io_struct.py``) and sglang-omni's RL
admin control. Every answer of a route that can fail is an :class:`AdminResult`
(``success``, ``message``, ``rank_results`` with one entry per TP rank) plus its
action's own fields; a failure also carries ``error.message``
(:class:`~router.contract.base.OutcomeResponse`) and answers 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from router.contract.base import MAX_ITEMS, Label, OutcomeResponse, PathText, Text, WireRequest, WireResponse
from router.contract.tensor_handles import HandleMessage
from router.contract.vllm_server import VllmConfigView

PauseMode = Literal["abort", "retract", "in_place"]
#: What one call left a worker's weights as: untouched, a consistent new version, or a mix of versions.
WeightsEffect = Literal["intact", "updated", "partial"]
#: The state of a worker's weights (see ``worker.engine.weight_state``).
WeightStateName = Literal["serving", "writing", "partial", "released"]
CheckerAction = Literal["snapshot", "reset_tensors", "compare", "checksum"]
#: ``cuda_graph`` is one of SGLang's tags; this worker captures no graphs, so it is accepted as a no-op.
MemoryTag = Literal["weights", "kv_cache", "cuda_graph"]


# ----------------------------------------------------------------------------- requests


class EmptyRequest(WireRequest):
    """A route that takes no fields (any JSON object is accepted and ignored)."""


class PauseRequest(WireRequest):
    """``POST /pause_generation``: ``abort`` (default) | ``retract`` | ``in_place``."""

    mode: PauseMode = "abort"


class ContinueRequest(WireRequest):
    """``POST /continue_generation``. ``torch_empty_cache`` (v0.5.15+) is accepted;
    on CUDA it empties the caching allocator before un-pausing."""

    torch_empty_cache: bool = True


class AbortRequest(WireRequest):
    """``POST /abort_request``: abort requests whose rid starts with ``rid``, or all."""

    rid: Label | Annotated[list[Label], Field(max_length=MAX_ITEMS)] | None = None
    abort_all: bool = False
    finished_reason: dict[str, Any] | None = None
    abort_message: Text | None = None


class FlushCacheRequest(WireRequest):
    """``GET|POST /flush_cache``; ``timeout`` (v0.5.23 query parameter) waits up
    to that many seconds for the worker to become idle before giving up."""

    timeout: float = Field(0.0, ge=0.0, le=300.0)


class UpdateWeightVersionRequest(WireRequest):
    """``POST /update_weight_version``; like SGLang, ``abort_all_requests`` defaults to True."""

    new_version: Label
    abort_all_requests: bool = True


class UpdateWeightsFromDiskRequest(WireRequest):
    """``POST /update_weights_from_disk`` — every field of SGLang's ``UpdateWeightFromDiskReqInput``."""

    model_path: PathText
    load_format: Label | None = None
    abort_all_requests: bool = False
    weight_version: Label | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = Field(0, ge=0, le=2**62)
    flush_cache: bool = True
    manifest: dict[str, Any] | None = None


#: One rank's pickled payload (handles and metadata only, never tensor bytes): bounded generously.
MAX_SERIALIZED_CHARS = 8 * 1024 * 1024

#: The id of one admin operation of a router, on every call it sends to a worker: both log it, so one
#: ``grep`` follows an update across the fleet.
OPERATION_HEADER = "X-Omni-Operation"


class UpdateWeightsFromTensorRequest(WireRequest):
    """``POST /update_weights_from_tensor`` — SGLang's ``UpdateWeightsFromTensorReqInput`` plus
    ``tensor_handles``, this project's JSON handle message (:mod:`router.contract.tensor_handles`).

    Exactly one of the two carries the tensors. ``tensor_handles`` is a field of its own (not a
    ``load_format`` value) so an SGLang body keeps its meaning unchanged and a handle message is
    validated as JSON before any route code runs."""

    serialized_named_tensors: Annotated[
        list[Annotated[str, Field(max_length=MAX_SERIALIZED_CHARS)]], Field(max_length=1024)
    ] = Field(default_factory=list)
    load_format: Label | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Label | None = None
    tensor_handles: HandleMessage | None = None

    @model_validator(mode="after")
    def _one_carrier(self) -> UpdateWeightsFromTensorRequest:
        # Checked here, so a router refuses a body without tensors before any worker is fenced for it.
        if self.tensor_handles is not None and (self.serialized_named_tensors or self.load_format is not None):
            raise ValueError("send either tensor_handles or serialized_named_tensors (with load_format), not both")
        if self.tensor_handles is None and not self.serialized_named_tensors:
            raise ValueError("serialized_named_tensors (one entry per TP rank) or tensor_handles is required")
        return self


class WeightsCheckerRequest(WireRequest):
    """``GET|POST /weights_checker``; ``action`` defaults to ``checksum`` (SGLang v0.5.15+)."""

    action: CheckerAction = "checksum"
    allow_quant_error: bool = False
    skip_tensor_list: Annotated[list[Label], Field(max_length=MAX_ITEMS)] | None = None
    selector: Label = "all"


class MemoryOccupationRequest(WireRequest):
    """``POST /release_memory_occupation`` and ``/resume_memory_occupation``.

    ``tags`` None or empty means every tag. ``keep_weights`` (release only, this project's field):
    ``true`` keeps a host copy of released weights and resume restores them bit for bit; ``false``
    frees them without a copy, as SGLang does, for a colocated trainer that pushes new weights
    after resume (a large model then needs no host memory): after resume the weights are
    ``partial`` and nothing is served until updates have rewritten every tensor."""

    tags: list[MemoryTag] | None = None
    keep_weights: bool = True

    @field_validator("tags")
    @classmethod
    def _dedupe(cls, tags: list[str] | None) -> list[str] | None:
        return list(dict.fromkeys(tags)) if tags else None


# ----------------------------------------------------------------------------- responses


class RankResult(WireResponse):
    """One TP rank's outcome of an admin operation (its scalar fields sit beside these)."""

    rank: int
    role: str = "tp"
    tp_rank: int = 0
    tp_size: int = 1
    success: bool
    message: str = ""


class WeightsReport(OutcomeResponse):
    """What one call did to a worker's weights (``weights``) and what they are after it
    (``weights_partial``): what a router reads of an answer to decide whether the worker may serve
    the fleet's weights again. The answer of every route that may write the weights is one, but
    vLLM's ``/collective_rpc`` (which says nothing of them); :class:`AdminResult` says what the two
    fields mean.

    An answer lists these two after its leading fields (SGLang's order). Pydantic orders fields
    from the last base to the first, so an answer names this class first among its bases and the
    class declaring its leading fields second."""

    weights: WeightsEffect | None = None
    weights_partial: bool | None = None


class AdminStatus(OutcomeResponse):
    """The leading fields of SGLang's admin answer: ``{success, message, rank_results}``."""

    success: bool
    message: str = ""
    rank_results: list[RankResult] | None = None

    @property
    def ok(self) -> bool:
        return self.success


class AdminResult(WeightsReport, AdminStatus):
    """The generic admin answer: ``{success, message, rank_results}`` plus the action's fields.

    ``weights`` says what the call did to the worker's weights, success or not: ``intact``
    (nothing was written: a refusal, or an operation that never writes), ``updated`` or
    ``partial``. A router keeps out of routing exactly the workers whose weights may differ
    from the fleet's; a worker that does not say is treated as ``partial``.
    ``weights_partial`` says what the weights are after the call, whatever it did: a mix of
    versions (an earlier update failed) or released without a copy and not yet rewritten.
    Such a worker generates nothing; a refusal on it is still ``intact``."""


class PauseResult(AdminResult):
    """``/pause_generation``: SGLang answers ``{"message", "status": "ok"}`` (so ``success``
    defaults to true); the counts are this worker's."""

    success: bool = True
    status: str = "ok"
    pause_mode: PauseMode | None = None
    num_aborted: int = 0
    aborted_rids: list[str] = Field(default_factory=list)
    num_retracted: int = 0
    num_frozen: int = 0


class ContinueResult(AdminResult):
    """``/continue_generation``: like pause, SGLang's answer is ``{"message", "status": "ok"}``."""

    success: bool = True
    status: str = "ok"
    was_paused: bool = False


class AbortRequestResult(AdminResult):
    num_aborted: int = 0
    aborted_rids: list[str] = Field(default_factory=list)


class FlushCacheResult(AdminResult):
    """``/flush_cache``; a refusal (requests hold KV) answers 400."""


class MemoryOccupationResult(AdminResult):
    released: list[str] | None = None
    resumed: list[str] | None = None


class UpdateWeightsFromDiskResult(AdminResult):
    num_paused_requests: int = 0
    num_aborted: int = 0
    weight_version: str | None = None
    model_path: str | None = None
    is_paused: bool | None = None


class UpdateWeightVersionResult(AdminResult):
    new_version: str | None = None
    num_aborted: int = 0


class WeightVersionResult(WireResponse):
    """``/get_weight_version``."""

    weight_version: str


class CheckerRank(WireResponse):
    """One rank's digests in an engine-level checker report (SGLang 0.5.23's ``ranks`` entries)."""

    checksums: dict[str, str] = Field(default_factory=dict)
    per_gpu_checksum: str
    parallelism_info: list[dict[str, Any]] = Field(default_factory=list)
    full_checksum: str | None = None
    """With tensor parallelism: the checksum of the full checkpoint tensors this rank serves (its shards
    gathered with its peers'), in the trainer's scheme; ``per_gpu_checksum`` covers its shards only."""


class WeightsCheckerResult(AdminResult):
    """Checker summary (sglang-omni ``StrictWeightChecker``); ``compare`` adds the diff fields.

    ``per_gpu_checksum`` is rank 0's checksum; ``per_engine_checksum`` covers every
    rank and ``ranks`` holds each rank's digests (SGLang 0.5.23's scheme). With tensor
    parallelism a rank's digests cover its shards, and ``full_checksum`` the full
    checkpoint tensors rebuilt from every rank's shard: what a trainer computes
    (``sent_checksum``) over the tensors it sent."""

    action: str | None = None
    tensor_count: int = 0
    per_gpu_checksum: str | None = None
    per_engine_checksum: str | None = None
    full_checksum: str | None = None
    checksums: dict[str, str] | None = None
    tensor_metadata: dict[str, dict[str, Any]] | None = None
    ranks: list[CheckerRank] | None = None
    elapsed_s: float = 0.0
    matched: list[str] | None = None
    missing: list[str] | None = None
    unexpected: list[str] | None = None
    changed: list[str] | None = None

    def checksums_per_rank(self) -> list[str]:
        """Each rank's checksum of the full tensors it serves, in the scheme a trainer recomputes from the
        tensors it sent: its own checksum, or with tensor parallelism its ``full_checksum``."""
        if self.ranks:
            return [r.full_checksum or r.per_gpu_checksum for r in self.ranks]
        full = self.full_checksum or self.per_gpu_checksum
        return [full] if full else []


class ModelInfo(WireResponse):
    """``/model_info``: SGLang's fields plus the sglang-omni admin fields."""

    model_path: str
    tokenizer_path: str | None = None
    is_generation: bool = True
    preferred_sampling_params: dict[str, Any] | None = None
    weight_version: str = "default"
    has_image_understanding: bool = False
    has_audio_understanding: bool = False
    model_type: str | None = None
    architectures: list[str] = Field(default_factory=list)
    served_model_name: str | None = None
    load_format: str | None = None
    tp_size: int = 1
    dtype: str = ""
    device: str = ""
    context_length: int | None = None
    is_paused: bool = False
    pause_mode: str | None = None
    weights_partial: bool = False
    weights_released: bool = False
    weight_state: WeightStateName | None = None
    """``serving`` is the only state in which the worker generates."""
    instance_id: str | None = None
    """Changes whenever the worker process restarts (its weights are then its boot checkpoint)."""
    token_step: int = 0
    supports_weight_update: bool = True
    supports_weight_checker: bool = True
    rank_results: list[RankResult] | None = None


#: A weight receive's state, as ``/health`` reports it (``staged``: atomic, every bucket held).
ReceiveStateName = Literal["starting", "receiving", "draining", "staged", "done", "failed"]


class HealthStatus(WireResponse):
    """``GET /health``: the process serves (paused or not); what it holds, for a router's routing."""

    status: str
    is_paused: bool = False
    weight_version: str | None = None
    weight_state: WeightStateName | None = None
    instance_id: str | None = None
    receive: ReceiveStateName | None = None
    """The state of a prepared two-phase update's receive, while there is one: a router ends
    the update at once when every target's receive has ``failed``."""
    weight_update: Literal["open"] | None = None
    """``open`` between vLLM's ``/start_weight_update`` and its end (finish, a failed transfer, or
    the update's window passing): a router ends its held update once no target holds one open."""


class ServerInfo(WireResponse):
    """``/server_info``: the worker's settings (keys blanked) and per-rank scheduler counters;
    asked with ``config_format`` (vLLM's way), also vLLM's ``vllm_config`` (an object for
    ``json``, a line of text for ``text``), ``vllm_env`` and ``system_env``."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    tp_size: int = 1
    weight_version: str | None = None
    version: str | None = None
    internal_states: list[dict[str, Any]] = Field(default_factory=list)
    vllm_config: VllmConfigView | str | None = None
    vllm_env: dict[str, Any] | None = None
    system_env: dict[str, Any] | None = None
