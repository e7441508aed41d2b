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

import base64
import binascii
from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class TransferParams:
    """How a transfer over the group is laid out on the wire; trainer and worker must agree on it,
    or their broadcasts pair up wrongly (vLLM's "must-agree wire params")."""

    packed: bool = False
    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS


_PARAM_FIELDS = {
    "packed": "packed",
    "packed_buffer_size_bytes": "buffer_size_bytes",
    "packed_num_buffers": "num_buffers",
}
PackedBufferSize = Annotated[int, Field(ge=1, le=MAX_PACKED_BUFFER_SIZE_BYTES)]
PackedNumBuffers = Annotated[int, Field(ge=1, le=16)]
#: ``ncclGetUniqueId``'s 128 bytes, standard base64 (vLLM's torch-free rendezvous).
NcclUniqueIdB64 = Annotated[str, Field(max_length=256)]
#: The size of NCCL's ``ncclUniqueId``.
NCCL_UNIQUE_ID_BYTES = 128


def decode_unique_id_b64(
    *, master_address: str | None, master_port: int | None, nccl_unique_id_b64: str | None
) -> bytes | None:
    """Check the rendezvous mode as vLLM does and return the pre-shared id's bytes, or ``None`` for
    the store mode. Raises ``ValueError``:

    * an id together with ``master_address`` or ``master_port`` (an empty id counts as none);
    * no id, and not both ``master_address`` and ``master_port``;
    * an id that is not standard base64 (RFC 4648 alphabet, padded; URL-safe ``-``/``_`` and
      whitespace are refused);
    * an id that does not decode to :data:`NCCL_UNIQUE_ID_BYTES` bytes.
    """
    has_id = bool(nccl_unique_id_b64)
    if has_id and (master_address is not None or master_port is not None):
        raise ValueError("pass nccl_unique_id_b64 or master_address/master_port, not both")
    if not has_id:
        if master_address is None or master_port is None:
            raise ValueError(
                "need nccl_unique_id_b64, or both master_address and master_port "
                f"(got master_address={master_address!r}, master_port={master_port!r})"
            )
        return None
    try:
        raw = base64.b64decode(nccl_unique_id_b64 or "", validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise ValueError("nccl_unique_id_b64 is not valid standard base64 (URL-safe base64 is not accepted)") from None
    if len(raw) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"nccl_unique_id_b64 must decode to {NCCL_UNIQUE_ID_BYTES} bytes, got {len(raw)}")
    return raw


class WeightTransferInitInfo(WireRequest):
    """``init_info``: vLLM's ``NCCLWeightTransferInitInfo`` (vLLM 0.28 and later also carry the
    transfer's wire params here: ``packed``, ``packed_buffer_size_bytes``, ``packed_num_buffers``,
    which every later ``/update_weights`` of the group then uses), plus the optional group name,
    backend and timeout. The rendezvous is ``master_address`` + ``master_port``, or, for vLLM's
    NCCL engine only, ``nccl_unique_id_b64`` — exactly one of the two, as vLLM checks."""

    master_address: HostText | None = None
    master_port: int | None = Field(default=None, ge=1, le=65535)
    nccl_unique_id_b64: NcclUniqueIdB64 | None = None
    rank_offset: int = Field(ge=1, le=MAX_WORLD_SIZE)
    world_size: int = Field(ge=2, le=MAX_WORLD_SIZE)
    packed: bool = False
    packed_buffer_size_bytes: PackedBufferSize = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: PackedNumBuffers = DEFAULT_PACKED_NUM_BUFFERS
    group_name: GroupName = VLLM_GROUP_NAME
    #: ``None`` = ``nccl`` on a CUDA worker, else ``gloo``.
    backend: Backend = None
    timeout_s: TimeoutS = None

    _timeout = field_validator("timeout_s")(_check_timeout)

    @field_validator("master_address")
    @classmethod
    def _host(cls, value: str | None) -> str | None:
        return None if value is None else check_host(value)

    @model_validator(mode="after")
    def _rank_in_world(self) -> WeightTransferInitInfo:
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} must be below world_size {self.world_size}")
        decode_unique_id_b64(
            master_address=self.master_address, master_port=self.master_port, nccl_unique_id_b64=self.nccl_unique_id_b64
        )
        return self

    def transfer_params(self) -> TransferParams | None:
        """The wire params this init fixes for the group, or ``None`` when the trainer sent none
        (vLLM before 0.28, whose trainers say ``packed`` in each ``update_info``)."""
        if not self.model_fields_set & _PARAM_FIELDS.keys():
            return None
        return TransferParams(self.packed, self.packed_buffer_size_bytes, self.packed_num_buffers)

    def group_fields(self) -> dict[str, object]:
        """The fields a group join takes (the wire params and the rendezvous mode are the engine's)."""
        return self.model_dump(exclude_unset=True, exclude={"group_name", "nccl_unique_id_b64", *_PARAM_FIELDS.keys()})


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
      vLLM's packed buffers of ``packed_buffer_size_bytes`` (:func:`packed_chunks`). Since vLLM
      0.28 these come once, in ``init_info``; a value given here too must agree with it
      (:meth:`transfer_params`);
    * in shared memory: ``tensor_handles`` (this project's JSON handle message), or vLLM's
      ``ipc_handles_pickled`` (only with ``--allow-pickled-tensors``, through the restricted
      unpickler); ``ipc_handles`` (Ray's in-process objects) cannot cross HTTP and is refused.
    """

    names: Annotated[list[Label], Field(min_length=1, max_length=MAX_ITEMS)]
    dtype_names: Annotated[list[Label], Field(max_length=MAX_ITEMS)]
    shapes: Annotated[list[Shape], Field(max_length=MAX_ITEMS)]
    #: Unset: the group's init-time value (vLLM 0.28+), else vLLM's default.
    packed: bool | None = None
    packed_buffer_size_bytes: PackedBufferSize | None = None
    packed_num_buffers: PackedNumBuffers | None = None
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

    def transfer_params(self, at_init: TransferParams | None) -> TransferParams:
        """The wire params of this transfer: the group's init-time ones, unless this update says
        otherwise where the init said nothing. A value that contradicts the init's is refused
        (``ValueError``) before anything is received: vLLM's workers would pair their broadcasts
        wrongly and abort inside the collective."""
        base = at_init or TransferParams()
        chosen = {}
        for wire, attr in _PARAM_FIELDS.items():
            value = getattr(self, wire)
            if value is None:
                chosen[attr] = getattr(base, attr)
                continue
            if at_init is not None and value != getattr(at_init, attr):
                raise ValueError(
                    f"update_info {wire}={value!r} disagrees with {wire}={getattr(at_init, attr)!r} given to "
                    "/init_weight_transfer_engine; the trainer and this worker must use the same wire params "
                    "(send them once, at init, as vLLM 0.28+ does)"
                )
            chosen[attr] = value
        return TransferParams(**chosen)

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

    @property
    def join_attempted(self) -> bool | None:
        """omni-worker's answer to ``/init_weight_transfer_engine`` says, as SGLang's init does
        (:class:`~router.contract.weight_sync.JoinReport`), whether its join began. It is not one of
        vLLM's fields, so it stays undeclared (an answer keeps its shape) and is read from the extras."""
        said = (self.model_extra or {}).get("join_attempted")
        return said if isinstance(said, bool) else None


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
