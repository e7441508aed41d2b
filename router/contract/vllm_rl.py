"""vLLM's RL and dev routes that only a real vLLM server serves (omni-worker has its own equivalents).

As vLLM 0.32/0.33 serve them with ``VLLM_SERVER_DEV_MODE=1`` (``entrypoints/rl/online/api_router.py``,
``entrypoints/serve/dev/rpc/api_router.py``):

* ``GET /weight_info`` → ``{"weight_version": v}`` (``"default"`` until a label is set);
* ``POST /weight_checker {"action": "checksum"|"reset"|"compare", "baseline"?: {key: sha256}}`` →
  ``{"checksums": {key: sha256}}`` / ``{"status": "reset"}`` / ``{"match": bool, "mismatches": [keys]}``;
  keys are ``dp{d}:pp{p}:pcp{c}:tp{t}:{param}``, values the SHA-256 of the runtime (sharded, post-processed)
  bytes, so only workers of the same parallel layout compare key for key;
* ``POST /collective_rpc {"method", "args": [str], "kwargs": {str: str}, "timeout"}`` → ``{"results": [...]}``,
  one entry per worker rank, or an empty 200 when the method returned nothing; vLLM passes only strings
  as arguments, for safety, and so does this contract;
* ``POST /shutdown_weight_transfer_engine`` → ``{"message": ...}`` (refused while an update is open).

Failures are vLLM's ``{"error": {"message", "type", "param", "code"}}``, a worker-side error a 500.
Nothing here imports torch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator

from router.contract.base import MAX_ITEMS, Label, Text, WireRequest, WireResponse
from router.contract.vllm_server import VllmParallelConfig

VllmCheckerAction = Literal["checksum", "reset", "compare"]

#: Worker methods that only read, or only touch the weight-update group: a ``/collective_rpc`` of any other
#: method may change the weights, so the router treats it as a weight update (fenced, journaled, recorded).
READ_ONLY_RPC_METHODS = frozenset(
    {
        "check_health",
        "get_model_info",
        "get_kv_cache_spec",
        "get_supported_tasks",
        "compute_weight_checksums",
        "determine_available_memory",
        "list_loras",
        "omni_destroy_weights_update_group",
        "omni_init_weights_update_group",
    }
)
#: Worker methods that reload weights from a checkpoint path given as ``kwargs[<key>]``: the router remembers
#: the path, so a worker that joins later can load the same weights (catch-up from a path).
PATH_RPC_METHODS: dict[str, str] = {"reload_weights": "weights_path"}


class WeightInfo(WireResponse):
    """``GET /weight_info``."""

    weight_version: str


class VllmWeightCheckerRequest(WireRequest):
    """``POST /weight_checker``."""

    action: VllmCheckerAction
    baseline: Annotated[dict[Label, Label], Field(max_length=MAX_ITEMS)] | None = None


class VllmWeightCheckerResult(WireResponse):
    """``/weight_checker``'s answer: one of its three shapes, by ``action``."""

    checksums: dict[str, str] | None = None
    status: str | None = None
    match: bool | None = None
    mismatches: list[str] | None = None


class CollectiveRpcRequest(WireRequest):
    """``POST /collective_rpc``: a worker method by name, with string arguments only (as vLLM takes them)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, validate_by_name=True, serialize_by_alias=True)

    method: Label
    args: Annotated[list[Text], Field(max_length=64)] = Field(default_factory=list)
    keyword_args: Annotated[dict[Label, Annotated[str, Field(max_length=1 << 20)]], Field(max_length=64)] = Field(
        default_factory=dict, alias="kwargs"
    )
    """vLLM's ``kwargs`` (named otherwise here only because pydantic's constructor takes ``**kwargs``)."""
    timeout: float | None = Field(default=None, gt=0, le=86_400)

    @property
    def reads_only(self) -> bool:
        """The method is known to leave the weights as they are."""
        return self.method in READ_ONLY_RPC_METHODS

    @property
    def checkpoint_path(self) -> str | None:
        """The checkpoint a weight reload reads, when the method is one (``reload_weights``)."""
        key = PATH_RPC_METHODS.get(self.method)
        return self.keyword_args.get(key) if key is not None else None


class CollectiveRpcResult(WireResponse):
    """``/collective_rpc``'s answer: each rank's return value (``None`` for an empty 200)."""

    results: list[Any] | None = None


class VllmIdentity(WireResponse):
    """The parts of ``vllm_config`` that identify one server process and its ranks."""

    instance_id: str | None = None
    """vLLM's per-process id (``VllmConfig.instance_id``, new at every start unless set by hand)."""
    parallel_config: VllmParallelConfig = Field(default_factory=VllmParallelConfig)

    @field_validator("instance_id", mode="before")
    @classmethod
    def _text(cls, value: object) -> object:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


class VllmServerIdentity(WireResponse):
    """``GET /server_info?config_format=json``, read only for :class:`VllmIdentity`."""

    vllm_config: VllmIdentity
