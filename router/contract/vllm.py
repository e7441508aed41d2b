"""Wire messages of vLLM's weight-transfer API, served beside SGLang's routes.

vLLM's native RL API moves weights in four phases: ``/init_weight_transfer_engine``
once, then per sync ``/start_weight_update``, one or more ``/update_weights`` and
``/finish_weight_update``; generation is paused and resumed with ``/pause``
(``mode`` = ``abort`` | ``wait`` | ``keep``, a query parameter) and ``/resume``.
Field names, defaults and answers follow vLLM's ``NCCLWeightTransferInitInfo``,
``NCCLWeightTransferUpdateInfo`` and ``IPCWeightTransferUpdateInfo``; additions
are optional (``group_name``, ``backend``, ``timeout_s``, ``tensor_handles``).

The group is built as SGLang's ``/init_weights_update_group`` builds it (a
``torch.distributed`` group over a TCP rendezvous at ``master_address:master_port``,
rank ``rank_offset + tp_rank``), so a trainer using ``torch.distributed`` works over
gloo and NCCL alike. Packed updates use vLLM's buffer boundaries exactly
(:func:`packed_chunks`); each chunk is one flattened bucket of this project's
data plane, so its bytes are received and checked like any other bucket.

This module never imports torch; the router and the trainer client use it too.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from router.contract.admin import AdminResult
from router.contract.base import MAX_ITEMS, MAX_WORLD_SIZE, HostText, Label, WireRequest, WireResponse, check_host
from router.contract.bucket_layout import DTYPE_ITEMSIZE, LayoutError, normalize_dtype_name
from router.contract.tensor_handles import HandleMessage
from router.contract.weight_sync import Backend, GroupName, TimeoutS, _check_timeout, _version_to_str

#: vLLM's default group name when ``init_info`` names none.
VLLM_GROUP_NAME = "weight_transfer"
#: vLLM's ``DEFAULT_PACKED_BUFFER_SIZE_BYTES`` and ``DEFAULT_PACKED_NUM_BUFFERS``.
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1024 * 1024 * 1024
DEFAULT_PACKED_NUM_BUFFERS = 2
#: The largest packed buffer a caller may announce (a receiver allocates one of this size).
MAX_PACKED_BUFFER_SIZE_BYTES = 64 * 1024**3

VllmPauseMode = Literal["abort", "wait", "keep"]
#: vLLM's pause modes onto the worker's scheduler modes: ``wait`` drains (running requests
#: finish, new ones wait), ``keep`` freezes running requests with their KV (SGLang's ``in_place``).
SCHEDULER_PAUSE_MODE: dict[str, str] = {"abort": "abort", "wait": "drain", "keep": "in_place"}


class WeightTransferInitInfo(WireRequest):
    """``init_info``: vLLM's NCCL init fields, plus the optional group name and backend."""

    master_address: HostText
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, le=MAX_WORLD_SIZE)
    world_size: int = Field(ge=2, le=MAX_WORLD_SIZE)
    group_name: GroupName = VLLM_GROUP_NAME
    #: ``None`` = ``nccl`` on a CUDA worker, else ``gloo``.
    backend: Backend = None
    timeout_s: TimeoutS = None

    _timeout = field_validator("timeout_s")(_check_timeout)
    _host = field_validator("master_address")(check_host)

    @model_validator(mode="after")
    def _rank_in_world(self) -> WeightTransferInitInfo:
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} must be below world_size {self.world_size}")
        return self


class InitWeightTransferEngineRequest(WireRequest):
    """``POST /init_weight_transfer_engine``: ``{"init_info": {...}}``."""

    init_info: WeightTransferInitInfo


class StartWeightUpdateRequest(WireRequest):
    """``POST /start_weight_update``: no fields in vLLM; ``timeout_s`` bounds the whole update here
    (an update never finished ends by itself after it, its writes reported ``partial``)."""

    timeout_s: TimeoutS = None

    _timeout = field_validator("timeout_s")(_check_timeout)


Shape = Annotated[list[Annotated[int, Field(ge=0, le=2**40)]], Field(max_length=16)]


class WeightTransferUpdateInfo(WireRequest):
    """``update_info``: parallel ``names``/``dtype_names``/``shapes`` (lengths must agree, as
    vLLM's ``__post_init__`` checks) and how the bytes travel:

    * over the group (default): ``packed`` false = one broadcast per tensor, in order; true =
      vLLM's packed buffers of ``packed_buffer_size_bytes`` (:func:`packed_chunks`);
    * in shared memory: ``tensor_handles`` (this project's JSON handle message), or vLLM's
      ``ipc_handles_pickled`` (only with ``--allow-pickled-tensors``, through the restricted
      unpickler); ``ipc_handles`` (Ray's in-process objects) cannot cross HTTP and is refused.
    """

    names: Annotated[list[Label], Field(min_length=1, max_length=MAX_ITEMS)]
    dtype_names: Annotated[list[Label], Field(max_length=MAX_ITEMS)]
    shapes: Annotated[list[Shape], Field(max_length=MAX_ITEMS)]
    packed: bool = False
    packed_buffer_size_bytes: int = Field(
        default=DEFAULT_PACKED_BUFFER_SIZE_BYTES, ge=1, le=MAX_PACKED_BUFFER_SIZE_BYTES
    )
    packed_num_buffers: int = Field(default=DEFAULT_PACKED_NUM_BUFFERS, ge=1, le=16)
    tensor_handles: HandleMessage | None = None
    ipc_handles_pickled: Annotated[str, Field(max_length=64 * 1024**2)] | None = None
    ipc_handles: None = None
    timeout_s: TimeoutS = None

    _timeout = field_validator("timeout_s")(_check_timeout)

    @model_validator(mode="after")
    def _lists_agree(self) -> WeightTransferUpdateInfo:
        n = len(self.names)
        if len(self.dtype_names) != n:
            raise ValueError(
                f"`dtype_names` should be of the same size as `names`: got {len(self.dtype_names)} and {n}"
            )
        if len(self.shapes) != n:
            raise ValueError(f"`shapes` should be of the same size as `names`: got {len(self.shapes)} and {n}")
        if len(set(self.names)) != n:
            raise ValueError("`names` must not repeat a tensor")
        try:
            self.dtype_names = [normalize_dtype_name(d) for d in self.dtype_names]
        except LayoutError as exc:
            raise ValueError(str(exc)) from None
        if self.tensor_handles is not None and self.ipc_handles_pickled is not None:
            raise ValueError("send either tensor_handles or ipc_handles_pickled, not both")
        if self.uses_shared_memory and self.packed:
            raise ValueError("packed applies to transfers over the group; shared-memory handles are never packed")
        return self

    @property
    def uses_shared_memory(self) -> bool:
        return self.tensor_handles is not None or self.ipc_handles_pickled is not None

    def nbytes(self, index: int) -> int:
        n = DTYPE_ITEMSIZE[self.dtype_names[index]]
        for dim in self.shapes[index]:
            n *= dim
        return n


class UpdateWeightsRequest(WireRequest):
    """``POST /update_weights``: ``{"update_info": {...}}``."""

    update_info: WeightTransferUpdateInfo


class FinishWeightUpdateRequest(WireRequest):
    """``POST /finish_weight_update``: ``{"weight_version": str | null}``."""

    weight_version: Label | None = None
    #: Drop cached KV computed with the old weights (requests frozen by ``keep`` keep theirs).
    flush_cache: bool = True

    _version = field_validator("weight_version", mode="before")(_version_to_str)


class PauseQuery(WireRequest):
    """``POST /pause?mode=abort|wait|keep``; the deprecated ``wait_for_inflight_requests=true``
    means ``wait``; ``clear_cache`` is accepted and ignored (as vLLM does for ``keep``)."""

    mode: VllmPauseMode = "abort"
    wait_for_inflight_requests: bool | None = None
    clear_cache: bool | None = None
    timeout_s: TimeoutS = None

    _timeout = field_validator("timeout_s")(_check_timeout)

    @property
    def effective_mode(self) -> VllmPauseMode:
        return "wait" if self.wait_for_inflight_requests else self.mode


class EmptyVllmRequest(WireRequest):
    """A vLLM route without a body (``/resume``, ``/is_paused``, ``/get_world_size``)."""


class VllmResult(AdminResult):
    """vLLM's answer ``{"message": ...}``; ``success`` and ``weights`` are this project's
    (a router keeps a worker whose weights may differ from the fleet's out of routing)."""

    success: bool = True


class PauseStatus(AdminResult):
    """``/pause`` → ``{"status": "paused"}``, ``/resume`` → ``{"status": "resumed"}``."""

    success: bool = True
    status: str = ""


class IsPausedResponse(WireResponse):
    """``GET /is_paused``."""

    is_paused: bool


class WorkerWorldSize(WireResponse):
    """``GET /get_world_size`` on one worker: the ranks it holds in a weight-transfer group."""

    world_size: int


def packed_chunks(sizes: list[int], buffer_size_bytes: int) -> list[range]:
    """vLLM's packed buffer boundaries: tensors join the current buffer in order, and the buffer
    is sent once its bytes exceed ``buffer_size_bytes`` (so a buffer may overshoot by its last
    tensor, and a tensor larger than the size travels alone). Both sides must use the same size:
    a receiver given another size expects other buffer lengths, and the receive fails on the
    first one."""
    chunks: list[range] = []
    start = total = 0
    for i, size in enumerate(sizes):
        total += size
        if total > buffer_size_bytes:
            chunks.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        chunks.append(range(start, len(sizes)))
    return chunks
