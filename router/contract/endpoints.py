"""Every worker admin route, once: path, methods, request and response model, timeout budget.

The worker's route table, the router's operation table and the trainer client
all read their admin routes from here, so a route's shape and its timeouts have
one definition. The router serializes the ``serialized`` routes (every change of
weights, pause state or groups) under its admin update lock, so their caller may
first wait for the lock (:data:`~router.contract.budget.DEFAULT_LOCK_WAIT_S` by
default). ``/complete_weights_update`` and ``/abort_weights_update`` run inside
the update that a ready ``/prepare_weights_update`` holds the lock for: they
never wait for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from router.contract import admin, peer, vllm, vllm_dev, vllm_rl, vllm_server, weight_sync
from router.contract.base import WireRequest, WireResponse
from router.contract.budget import APPLY_S, DEFAULT_GROUP_TIMEOUT_S, DEFAULT_RECEIVE_TIMEOUT_S, Budget

#: Covariant: an endpoint of any route is an ``Endpoint[WireRequest, WireResponse]`` (a table of several routes).
Req = TypeVar("Req", bound=WireRequest, covariant=True)
Resp = TypeVar("Resp", bound=WireResponse, covariant=True)

POST = ("POST",)
GET = ("GET",)
GET_POST = ("GET", "POST")


@dataclass(frozen=True, slots=True)
class Endpoint(Generic[Req, Resp]):
    """One admin route of the worker contract."""

    path: str
    methods: tuple[str, ...]
    request: type[Req]
    response: type[Resp]
    budget: Budget
    serialized: bool = False
    """The router runs it under its admin update lock; the caller may first wait for the lock."""
    aliases: tuple[str, ...] = ()
    """Older names of the same route that workers also serve (SGLang's deprecated spellings)."""
    timeout_field: str | None = "timeout_s"
    """The request field that bounds this call's wait (a join, a receive), if the request declares it."""
    writes_weights: bool = False
    """The call may change the weights or their version label; its answer must say how (``weights``)."""
    summary: str = ""
    """One line for the API description."""
    query_params: bool = False
    """The route takes its arguments as query parameters, as vLLM's dev routes do (``/pause?mode=``):
    they win over the body's fields, and a list field takes every value of a repeated name."""

    @property
    def name(self) -> str:
        return self.path.lstrip("/")

    def timeout_of(self, req: WireRequest) -> float | None:
        """The request's own bound on its wait, if this route has one and the caller set it."""
        field = self.timeout_field
        if field is None or field not in type(req).model_fields:
            return None
        value = getattr(req, field)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def worker_bound(self, req: WireRequest) -> float:
        """The worker's deadline for this call."""
        return self.budget.bound(self.timeout_of(req))


#: An endpoint of any route.
AnyEndpoint = Endpoint[WireRequest, WireResponse]


def _receive(work_s: float) -> Budget:
    """A call that waits for a receive bounded by the body's ``timeout_s``, then applies it."""
    return Budget(work_s=work_s + APPLY_S, overhead_s=APPLY_S)


MODEL_INFO = Endpoint(
    "/model_info",
    GET_POST,
    admin.EmptyRequest,
    admin.ModelInfo,
    Budget(30.0),
    aliases=("/get_model_info",),
    summary="The served model, its weight version and state",
)
GET_WEIGHT_VERSION = Endpoint(
    "/get_weight_version",
    GET,
    admin.EmptyRequest,
    admin.WeightVersionResult,
    Budget(30.0),
    aliases=("/weight_version",),
    summary="The weight version label",
)
SERVER_INFO = Endpoint(
    "/server_info",
    GET,
    vllm_server.ServerInfoRequest,
    admin.ServerInfo,
    Budget(30.0),
    aliases=("/get_server_info",),
    summary="Settings, scheduler counters and the version (keys blanked); vLLM's vllm_config with config_format",
)
UPDATE_WEIGHT_VERSION = Endpoint(
    "/update_weight_version",
    POST,
    admin.UpdateWeightVersionRequest,
    admin.UpdateWeightVersionResult,
    Budget(60.0),
    serialized=True,
    writes_weights=True,
    summary="Relabel the weights",
)
PAUSE_GENERATION = Endpoint(
    "/pause_generation",
    POST,
    admin.PauseRequest,
    admin.PauseResult,
    Budget(60.0),
    serialized=True,
    summary="Pause generation (abort, retract or in_place)",
)
CONTINUE_GENERATION = Endpoint(
    "/continue_generation",
    POST,
    admin.ContinueRequest,
    admin.ContinueResult,
    Budget(60.0),
    serialized=True,
    summary="Resume generation",
)
ABORT_REQUEST = Endpoint(
    "/abort_request",
    POST,
    admin.AbortRequest,
    admin.AbortRequestResult,
    Budget(30.0),
    summary="Abort requests by rid prefix, or all",
)
#: Flush's ``timeout`` (a query parameter in SGLang) is its wait for the worker to become idle.
FLUSH_CACHE = Endpoint(
    "/flush_cache",
    GET_POST,
    admin.FlushCacheRequest,
    admin.FlushCacheResult,
    Budget(30.0, overhead_s=30.0),
    timeout_field="timeout",
    summary="Flush the KV cache once idle",
)
#: vLLM's flush: 200 ``{"success": false}`` while requests hold cache, rather than a 400.
RESET_PREFIX_CACHE = Endpoint(
    "/reset_prefix_cache",
    POST,
    vllm_server.ResetPrefixCacheRequest,
    vllm_server.ResetPrefixCacheResult,
    Budget(30.0),
    timeout_field=None,
    summary="Reset the prefix cache unless requests hold it (vLLM)",
)
UPDATE_WEIGHTS_FROM_DISK = Endpoint(
    "/update_weights_from_disk",
    POST,
    admin.UpdateWeightsFromDiskRequest,
    admin.UpdateWeightsFromDiskResult,
    Budget(600.0),
    serialized=True,
    writes_weights=True,
    summary="Load new weights from a safetensors checkpoint",
)
UPDATE_WEIGHTS_FROM_TENSOR = Endpoint(
    "/update_weights_from_tensor",
    POST,
    admin.UpdateWeightsFromTensorRequest,
    admin.AdminResult,
    Budget(600.0),
    serialized=True,
    writes_weights=True,
    summary="Load tensors from shared memory (handle message, or pickles with --allow-pickled-tensors)",
)
WEIGHTS_CHECKER = Endpoint(
    "/weights_checker",
    GET_POST,
    admin.WeightsCheckerRequest,
    admin.WeightsCheckerResult,
    Budget(600.0),
    summary="Checksum or snapshot-compare the weights",
)
RELEASE_MEMORY_OCCUPATION = Endpoint(
    "/release_memory_occupation",
    GET_POST,
    admin.MemoryOccupationRequest,
    admin.MemoryOccupationResult,
    Budget(300.0),
    serialized=True,
    summary="Release weight memory (kept in a host copy)",
)
RESUME_MEMORY_OCCUPATION = Endpoint(
    "/resume_memory_occupation",
    GET_POST,
    admin.MemoryOccupationRequest,
    admin.MemoryOccupationResult,
    Budget(300.0),
    serialized=True,
    summary="Restore released weight memory",
)
UPDATE_WEIGHTS_FROM_PEER = Endpoint(
    "/update_weights_from_peer",
    POST,
    peer.UpdateWeightsFromPeerRequest,
    peer.UpdateWeightsFromPeerResult,
    _receive(DEFAULT_RECEIVE_TIMEOUT_S),
    serialized=True,
    writes_weights=True,
    summary="Load the weights a live peer serves (its /weights_snapshot), checked by checksum",
)
INIT_WEIGHTS_UPDATE_GROUP = Endpoint(
    "/init_weights_update_group",
    POST,
    weight_sync.InitWeightsUpdateGroupRequest,
    weight_sync.WeightSyncResponse,
    Budget(DEFAULT_GROUP_TIMEOUT_S + 30.0, overhead_s=30.0),
    serialized=True,
    summary="Join a weight-update process group with the trainer",
)
DESTROY_WEIGHTS_UPDATE_GROUP = Endpoint(
    "/destroy_weights_update_group",
    POST,
    weight_sync.DestroyWeightsUpdateGroupRequest,
    weight_sync.WeightSyncResponse,
    Budget(60.0),
    serialized=True,
    summary="Leave a weight-update process group",
)
UPDATE_WEIGHTS_FROM_DISTRIBUTED = Endpoint(
    "/update_weights_from_distributed",
    POST,
    weight_sync.UpdateWeightsFromDistributedRequest,
    weight_sync.WeightSyncResponse,
    _receive(DEFAULT_RECEIVE_TIMEOUT_S),
    serialized=True,
    writes_weights=True,
    summary="Receive one bucket of weights by broadcast and load it",
)
#: Prepare answers once the receive runs: its ``timeout_s`` bounds the receive that follows, not this call.
PREPARE_WEIGHTS_UPDATE = Endpoint(
    "/prepare_weights_update",
    POST,
    weight_sync.PrepareWeightsUpdateRequest,
    weight_sync.PrepareWeightsUpdateResponse,
    Budget(120.0),
    serialized=True,
    timeout_field=None,
    summary="Post the receive of a whole update (two-phase)",
)
COMPLETE_WEIGHTS_UPDATE = Endpoint(
    "/complete_weights_update",
    POST,
    weight_sync.CompleteWeightsUpdateRequest,
    weight_sync.CompleteWeightsUpdateResponse,
    _receive(DEFAULT_RECEIVE_TIMEOUT_S),
    writes_weights=True,
    summary="Wait for the prepared receive, verify it, load it",
)
ABORT_WEIGHTS_UPDATE = Endpoint(
    "/abort_weights_update",
    POST,
    weight_sync.AbortWeightsUpdateRequest,
    weight_sync.AbortWeightsUpdateResponse,
    Budget(60.0),
    writes_weights=True,
    summary="Drop a prepared receive, weights untouched",
)
BEGIN_WEIGHT_UPDATE = Endpoint(
    "/begin_weight_update",
    POST,
    weight_sync.BeginWeightUpdateRequest,
    weight_sync.WeightSyncResponse,
    Budget(30.0),
    serialized=True,
    summary="Open an update bracket (SGLang 0.5.23)",
)
END_WEIGHT_UPDATE = Endpoint(
    "/end_weight_update",
    POST,
    weight_sync.EndWeightUpdateRequest,
    weight_sync.WeightSyncResponse,
    Budget(30.0),
    serialized=True,
    summary="Close an update bracket (SGLang 0.5.23)",
)

# -- vLLM's weight-transfer API -----------------------------------------------------------
#: Builds the group as /init_weights_update_group does; the timeout sits in ``init_info``.
INIT_WEIGHT_TRANSFER_ENGINE = Endpoint(
    "/init_weight_transfer_engine",
    POST,
    vllm.InitWeightTransferEngineRequest,
    vllm.VllmResult,
    Budget(DEFAULT_GROUP_TIMEOUT_S + 30.0, overhead_s=30.0),
    serialized=True,
    timeout_field=None,
    summary="Join the trainer's weight-transfer group (vLLM)",
)
#: Opens an update that /update_weights calls write into and /finish_weight_update commits;
#: through the router it holds the admin update lock until the finish.
START_WEIGHT_UPDATE = Endpoint(
    "/start_weight_update",
    POST,
    vllm.StartWeightUpdateRequest,
    vllm.VllmResult,
    Budget(60.0),
    serialized=True,
    timeout_field=None,
    summary="Open a weight update (vLLM)",
)
UPDATE_WEIGHTS = Endpoint(
    "/update_weights",
    POST,
    vllm.UpdateWeightsRequest,
    vllm.VllmResult,
    _receive(DEFAULT_RECEIVE_TIMEOUT_S),
    writes_weights=True,
    timeout_field=None,
    summary="Receive and load a chunk of weights inside an open update (vLLM)",
)
FINISH_WEIGHT_UPDATE = Endpoint(
    "/finish_weight_update",
    POST,
    vllm.FinishWeightUpdateRequest,
    vllm.VllmResult,
    Budget(APPLY_S),
    writes_weights=True,
    summary="Commit the open weight update and its version (vLLM)",
)
PAUSE = Endpoint(
    "/pause",
    POST,
    vllm.PauseQuery,
    vllm.PauseStatus,
    Budget(300.0),
    serialized=True,
    query_params=True,
    summary="Pause generation: abort, wait (drain) or keep (freeze) (vLLM)",
)
RESUME = Endpoint(
    "/resume",
    POST,
    vllm.EmptyVllmRequest,
    vllm.PauseStatus,
    Budget(30.0),
    serialized=True,
    summary="Resume generation (vLLM)",
)
IS_PAUSED = Endpoint(
    "/is_paused",
    GET,
    vllm.EmptyVllmRequest,
    vllm.IsPausedResponse,
    Budget(10.0),
    summary="Whether generation is paused (vLLM)",
)
GET_WORLD_SIZE = Endpoint(
    "/get_world_size",
    GET,
    vllm.EmptyVllmRequest,
    vllm.WorkerWorldSize,
    Budget(10.0),
    summary="Ranks this worker holds in a weight-transfer group (vLLM)",
)


# -- vLLM's dev routes: sleep and wake, abort ----------------------------------------------
#: A pause (a drain may take its ``timeout_s``), then a memory release like /release_memory_occupation.
SLEEP = Endpoint(
    "/sleep",
    POST,
    vllm_dev.SleepQuery,
    vllm_dev.SleepResult,
    Budget(300.0),
    serialized=True,
    query_params=True,
    summary="Pause generation and release memory: level 1 keeps a host copy of the weights, 2 drops them (vLLM)",
)
WAKE_UP = Endpoint(
    "/wake_up",
    POST,
    vllm_dev.WakeUpQuery,
    vllm_dev.WakeUpResult,
    Budget(300.0),
    serialized=True,
    query_params=True,
    summary="Restore released memory; generation resumes once nothing sleeps (vLLM)",
)
IS_SLEEPING = Endpoint(
    "/is_sleeping",
    GET,
    vllm.EmptyVllmRequest,
    vllm_dev.IsSleepingResponse,
    Budget(10.0),
    summary="Whether generation is paused or memory released (vLLM)",
)
ABORT_REQUESTS = Endpoint(
    "/abort_requests",
    POST,
    vllm_dev.AbortRequestsRequest,
    vllm_dev.AbortRequestsResult,
    Budget(30.0),
    summary="Abort requests by id (all when none are given) (vLLM)",
)


# -- vLLM's routes that only a real vLLM server serves (a router relays them to its vLLM workers) --------
WEIGHT_INFO = Endpoint(
    "/weight_info",
    GET,
    vllm.EmptyVllmRequest,
    vllm_rl.WeightInfo,
    Budget(30.0),
    summary="The weight version label (vLLM)",
)
#: vLLM's checker: per-tensor SHA-256 of the runtime bytes (``weights_checker`` is SGLang's and this worker's).
WEIGHT_CHECKER = Endpoint(
    "/weight_checker",
    POST,
    vllm_rl.VllmWeightCheckerRequest,
    vllm_rl.VllmWeightCheckerResult,
    Budget(600.0),
    summary="Per-tensor SHA-256 checksums, or a compare against a baseline (vLLM)",
)
#: Any worker method by name: serialized and, unless the method only reads, fenced as a weight update.
COLLECTIVE_RPC = Endpoint(
    "/collective_rpc",
    POST,
    vllm_rl.CollectiveRpcRequest,
    vllm_rl.CollectiveRpcResult,
    Budget(600.0),
    serialized=True,
    writes_weights=True,
    timeout_field="timeout",
    summary="Call a method on every worker rank (vLLM; reload_weights loads a checkpoint)",
)
SHUTDOWN_WEIGHT_TRANSFER_ENGINE = Endpoint(
    "/shutdown_weight_transfer_engine",
    POST,
    vllm.EmptyVllmRequest,
    vllm.VllmResult,
    Budget(60.0),
    serialized=True,
    summary="Release the weight-transfer engine (vLLM)",
)

#: Every admin route a worker serves, in the order they are documented.
WORKER_ADMIN: tuple[AnyEndpoint, ...] = (
    MODEL_INFO,
    GET_WEIGHT_VERSION,
    SERVER_INFO,
    UPDATE_WEIGHT_VERSION,
    PAUSE_GENERATION,
    CONTINUE_GENERATION,
    ABORT_REQUEST,
    FLUSH_CACHE,
    RESET_PREFIX_CACHE,
    UPDATE_WEIGHTS_FROM_DISK,
    UPDATE_WEIGHTS_FROM_TENSOR,
    UPDATE_WEIGHTS_FROM_PEER,
    WEIGHTS_CHECKER,
    RELEASE_MEMORY_OCCUPATION,
    RESUME_MEMORY_OCCUPATION,
    INIT_WEIGHTS_UPDATE_GROUP,
    DESTROY_WEIGHTS_UPDATE_GROUP,
    UPDATE_WEIGHTS_FROM_DISTRIBUTED,
    PREPARE_WEIGHTS_UPDATE,
    COMPLETE_WEIGHTS_UPDATE,
    ABORT_WEIGHTS_UPDATE,
    BEGIN_WEIGHT_UPDATE,
    END_WEIGHT_UPDATE,
    INIT_WEIGHT_TRANSFER_ENGINE,
    START_WEIGHT_UPDATE,
    UPDATE_WEIGHTS,
    FINISH_WEIGHT_UPDATE,
    PAUSE,
    RESUME,
    IS_PAUSED,
    GET_WORLD_SIZE,
    SLEEP,
    WAKE_UP,
    IS_SLEEPING,
    ABORT_REQUESTS,
)

#: Admin routes of vLLM servers that omni-worker does not serve (the router relays them to vLLM workers only).
VLLM_ONLY_ADMIN: tuple[AnyEndpoint, ...] = (
    WEIGHT_INFO,
    WEIGHT_CHECKER,
    COLLECTIVE_RPC,
    SHUTDOWN_WEIGHT_TRANSFER_ENGINE,
)
