"""Wire messages of the weight-sync data plane.

Two flows move weights over a distributed group (trainer = rank 0):

* SGLang's single-phase call, ``/update_weights_from_distributed``: metadata
  and broadcast race each other and the collective pairs them (slime, miles).
* The two-phase protocol: ``/prepare_weights_update`` validates every bucket's
  metadata and answers ``ready`` only once the receive loop is running; the
  trainer then broadcasts and calls ``/complete_weights_update`` — or, when it
  will not broadcast after all, ``/abort_weights_update``.

Field names and defaults follow SGLang's ``io_struct.py`` and the two-phase
two-phase protocol exactly; every addition is optional with a default that keeps
the original behaviour. Validation here is purely structural (list lengths,
dtype names, alignment); checking metadata against the model happens in the
worker. Requests coerce types as SGLang's do (``"29500"`` where a port belongs is
29500, :class:`~router.contract.base.WireRequest`) and ignore unknown fields (``selector``, ``torch_empty_cache``, ... from newer SGLang).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Protocol, TypeGuard, runtime_checkable

from pydantic import Field, PrivateAttr, field_validator, model_validator

from router.contract.admin import AdminResult, RankResult, WeightsReport
from router.contract.base import (
    MAX_ITEMS,
    MAX_WORLD_SIZE,
    HostText,
    Label,
    OutcomeResponse,
    WireRequest,
    WireResponse,
    check_host,
)
from router.contract.bucket_layout import BucketLayout, LayoutError
from router.contract.budget import MAX_TIMEOUT_S

DEFAULT_GROUP_NAME = "weight_update_group"
#: A group's name: also the prefix of its keys in the rendezvous store.
GroupName = Annotated[str, Field(min_length=1, max_length=128)]
#: The trainer holds rank 0; a worker's first rank when the caller names none.
DEFAULT_RANK_OFFSET = 1

LoadFormat = Literal["flattened_bucket"] | None
Backend = Literal["nccl", "gloo"] | None
TimeoutS = float | None


def _check_timeout(value: float | None) -> float | None:
    if value is not None and not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout_s must be in (0, {MAX_TIMEOUT_S:.0f}], got {value}")
    return value


def _version_to_str(value: Any) -> Any:
    # Trainers send str(step); accept a bare number too rather than failing a sync over it.
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


class TensorListMeta(WireRequest):
    """Parallel ``names``/``dtypes``/``shapes`` lists with equal lengths (SGLang
    silently truncates with ``zip``; here a mismatch is a 400).

    The bucket's byte layout is computed once, when the model is validated, and
    read from :attr:`layout` by everyone after that (the router, the receiver)."""

    names: Annotated[list[Label], Field(max_length=MAX_ITEMS)]
    dtypes: Annotated[list[Label], Field(max_length=MAX_ITEMS)]
    shapes: Annotated[
        list[Annotated[list[Annotated[int, Field(ge=0, le=2**40)]], Field(max_length=16)]], Field(max_length=MAX_ITEMS)
    ]
    _layout: BucketLayout = PrivateAttr()

    @model_validator(mode="after")
    def _lists_agree(self) -> TensorListMeta:
        if not self.names:
            raise ValueError("at least one tensor is required")
        try:
            # Also checks equal lengths, known dtypes, non-negative dims, distinct names.
            self._layout = BucketLayout.from_meta(self.names, self.dtypes, self.shapes, require_aligned=False)
        except LayoutError as exc:
            raise ValueError(str(exc)) from None
        self.dtypes = self._layout.dtypes  # normalized: "torch.bfloat16" -> "bfloat16"
        return self

    @property
    def layout(self) -> BucketLayout:
        """Where each tensor sits in the bucket's flattened buffer (alignment checked only for flattened updates)."""
        return self._layout


# -- group lifecycle -------------------------------------------------------------------------


class InitWeightsUpdateGroupRequest(WireRequest):
    """``POST /init_weights_update_group``: join the trainer's group at
    ``rank = rank_offset + tp_rank`` (the trainer is rank 0).

    Through the router ``rank_offset`` is the first rank of the first worker; the
    router gives each worker its own. SGLang requires it; here it defaults to
    :data:`DEFAULT_RANK_OFFSET`, the only right value for a lone worker."""

    master_address: HostText
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(default=DEFAULT_RANK_OFFSET, ge=1, le=MAX_WORLD_SIZE)
    world_size: int = Field(ge=2, le=MAX_WORLD_SIZE)
    group_name: GroupName = DEFAULT_GROUP_NAME
    #: ``None`` = ``nccl`` on a CUDA worker, else ``gloo`` (SGLang always defaults to nccl).
    backend: Backend = None
    #: Bound on the join (and on each later collective); the worker's default when absent.
    timeout_s: TimeoutS = None

    _timeout = field_validator("timeout_s")(_check_timeout)
    _host = field_validator("master_address")(check_host)

    @model_validator(mode="after")
    def _rank_in_world(self) -> InitWeightsUpdateGroupRequest:
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} must be below world_size {self.world_size}")
        return self


class DestroyWeightsUpdateGroupRequest(WireRequest):
    """``POST /destroy_weights_update_group``."""

    group_name: GroupName = DEFAULT_GROUP_NAME


@runtime_checkable
class GroupCall(Protocol):
    """A request sent over one named weight-update group: SGLang's group routes and the two-phase
    calls (vLLM's name their group in ``init_info`` or not at all)."""

    @property
    def group_name(self) -> str: ...


def names_a_group(request: object) -> TypeGuard[GroupCall]:
    """``isinstance(request, GroupCall)``, as Python 3.11 decides it (the member is there) at the cost of one
    attribute lookup rather than the protocol machinery's several microseconds: asked on every broadcast."""
    return hasattr(request, "group_name")


class WeightSyncResponse(AdminResult):
    """SGLang's admin answer: ``{"success", "message"}``.

    ``join_attempted`` (``/init_weights_update_group`` only): ``false`` when the init was refused
    before any join began (nothing to clean up); a failed join may leave the group half-built."""

    join_attempted: bool | None = None


@runtime_checkable
class JoinReport(Protocol):
    """An answer to a group init, SGLang's (:class:`WeightSyncResponse`) or vLLM's
    (:class:`~router.contract.vllm.VllmResult`): ``join_attempted`` is ``False`` when the worker
    refused before any join began, ``None`` when it does not say."""

    @property
    def join_attempted(self) -> bool | None: ...


# -- single phase ----------------------------------------------------------------------------


class UpdateWeightsFromDistributedRequest(TensorListMeta):
    """``POST /update_weights_from_distributed`` (SGLang's single-phase update): one bucket, received
    while the HTTP call is open."""

    group_name: GroupName = DEFAULT_GROUP_NAME
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Label | None = None
    #: ``None``: one broadcast per tensor in list order; ``"flattened_bucket"``: one uint8 broadcast.
    load_format: LoadFormat = None
    #: Bound on the receive; the worker's default when absent.
    timeout_s: TimeoutS = None

    _version = field_validator("weight_version", mode="before")(_version_to_str)
    _timeout = field_validator("timeout_s")(_check_timeout)

    @model_validator(mode="after")
    def _aligned_if_flat(self) -> UpdateWeightsFromDistributedRequest:
        if self.load_format == "flattened_bucket":
            try:
                self.layout.check_aligned()
            except LayoutError as exc:
                raise ValueError(str(exc)) from None
        return self


# -- two phase -------------------------------------------------------------------------------


#: A bucket's checksum: ``zlib.crc32`` of its bytes in slot order (exactly the bytes of its
#: flattened buffer, whichever format carries them), as ``crc32:`` and 8 lowercase hex digits.
BucketChecksum = Annotated[str, Field(pattern=r"^crc32:[0-9a-f]{8}$")]


class BucketMetadata(TensorListMeta):
    """One bucket of a two-phase update.

    ``nbytes`` and ``checksum`` (optional, from the trainer's own tensors) let the
    worker hold what arrives to what the trainer meant to send: ``nbytes`` must equal
    the bytes the names, dtypes and shapes describe (else the prepare is refused), and
    a bucket whose received bytes do not match ``checksum`` fails before it is applied."""

    nbytes: int | None = Field(default=None, ge=0, le=2**62)
    checksum: BucketChecksum | None = None


class PrepareWeightsUpdateRequest(WireRequest):
    """``POST /prepare_weights_update``: metadata for every bucket, before any broadcast."""

    num_buckets: int = Field(ge=1, le=MAX_ITEMS)
    buckets: Annotated[list[BucketMetadata], Field(max_length=MAX_ITEMS)]
    group_name: GroupName
    #: Per bucket: ``None`` = one broadcast per tensor (SGLang's default),
    #: ``"flattened_bucket"`` = one uint8 broadcast per bucket.
    load_format: LoadFormat = None
    #: Visible ``weight_version`` after a successful complete (complete may also set it).
    weight_version: Label | None = None
    #: ``False`` (streaming): apply each bucket as it arrives. ``True``: stage all, apply at
    #: complete; on failure the old weights stay, bit for bit.
    atomic: bool = False
    #: Abort in-flight requests instead of refusing while generation is not paused.
    abort_all_requests: bool = False
    #: Bound on the whole receive, from ``ready`` on; the worker's default when absent.
    timeout_s: TimeoutS = None

    _version = field_validator("weight_version", mode="before")(_version_to_str)
    _timeout = field_validator("timeout_s")(_check_timeout)

    @model_validator(mode="after")
    def _count_alignment_and_sizes(self) -> PrepareWeightsUpdateRequest:
        if self.num_buckets != len(self.buckets):
            raise ValueError(f"num_buckets is {self.num_buckets} but {len(self.buckets)} buckets were described")
        seen: dict[str, int] = {}
        for index, bucket in enumerate(self.buckets):
            for name in bucket.names:
                if name in seen:
                    raise ValueError(f"tensor {name!r} appears in bucket {seen[name] + 1} and bucket {index + 1}")
                seen[name] = index
            if self.load_format == "flattened_bucket":
                try:
                    bucket.layout.check_aligned()
                except LayoutError as exc:
                    raise ValueError(f"bucket {index + 1}: {exc}") from None
            if bucket.nbytes is not None and bucket.nbytes != bucket.layout.total_bytes:
                raise ValueError(
                    f"bucket {index + 1}: nbytes is {bucket.nbytes} but its names, dtypes and shapes describe "
                    f"{bucket.layout.total_bytes} bytes"
                )
        return self


class PrepareStatus(OutcomeResponse):
    """The leading fields of a prepare's answer (see :class:`~router.contract.admin.WeightsReport` for why
    they sit in a class of their own)."""

    status: Literal["ready", "error"]
    message: str = ""


class PrepareWeightsUpdateResponse(WeightsReport, PrepareStatus):
    """``ready`` once the receive loop runs; ``error`` (with the reason) when nothing was started."""

    # ``weights``: a prepare writes nothing (a streaming update writes its first bucket only once it
    # arrives); ``weights_partial``: the worker's weights are partial already.
    rank_results: list[RankResult] | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ready"


class CompleteWeightsUpdateRequest(WireRequest):
    """``POST /complete_weights_update``: wait for the receive, apply (atomic), answer."""

    group_name: GroupName
    flush_cache: bool = False
    #: Overrides the version given at prepare.
    weight_version: Label | None = None
    #: Also return the checksum of the weights as applied (weights-checker scheme).
    return_checksum: bool = False
    #: How long complete waits for the receive before failing it.
    timeout_s: TimeoutS = None

    _version = field_validator("weight_version", mode="before")(_version_to_str)
    _timeout = field_validator("timeout_s")(_check_timeout)


class BeginWeightUpdateRequest(WireRequest):
    """``POST /begin_weight_update`` (SGLang 0.5.23; miles sends it): open the update bracket."""

    selector: Literal["all", "target", "draft"] = "all"


class EndWeightUpdateRequest(WireRequest):
    """``POST /end_weight_update`` (SGLang 0.5.23): close the update bracket. No fields."""


class AbortWeightsUpdateRequest(WireRequest):
    """``POST /abort_weights_update``: drop a prepared receive the trainer will not feed
    (the router sends it to the ready workers when another one's prepare failed)."""

    group_name: GroupName = DEFAULT_GROUP_NAME


class AbortWeightsUpdateResponse(AdminResult):
    """``success``: the prepared receive was dropped and the weights are untouched.
    ``weights_partial``: the worker's weights are a mix of versions (some buckets were
    applied before the abort, or an earlier update failed); it stays paused."""

    weights_partial: bool = False


class RankChecksum(WireResponse):
    rank: int
    checksum: str


@runtime_checkable
class ChecksumReport(Protocol):
    """An answer that reports the checksum of the weights as applied: a complete asked with
    ``return_checksum`` (:class:`CompleteWeightsUpdateResponse`), a load from a peer."""

    @property
    def checksum(self) -> str | None: ...


def reports_checksum(answer: object) -> TypeGuard[ChecksumReport]:
    """``isinstance(answer, ChecksumReport)`` without the protocol machinery (asked of every worker's answer)."""
    return hasattr(answer, "checksum")


class CompleteWeightsUpdateResponse(AdminResult):
    """What the receive got and what was applied; through the router, each field holds the
    value every worker agrees on (per-worker answers sit beside it in ``results``)."""

    num_buckets_received: int = 0
    #: Checksum of rank 0's weights as applied (only when requested and successful).
    checksum: str | None = None
    rank_checksums: list[RankChecksum] | None = None
    weight_version: str | None = None
    elapsed_s: float | None = None
    # ``weights_partial`` is true when a streaming update failed midway: the worker stays paused.
