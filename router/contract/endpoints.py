"""Every worker admin route, once: path, methods, request and response model, timeout budget.

The worker's route table, the router's operation table and the trainer client
all read their admin routes from here, so a route's shape and its timeouts have
one definition. The router serializes the ``serialized`` routes (every change of
weights, pause state or groups) under its admin update lock, so their caller may
first wait for the lock (:data:`~router.contract.budget.DEFAULT_LOCK_WAIT_S` by
default). ``/complete_weights_update`` and ``/abort_weights_update`` run inside
the update that a ready ``/prepare_weights_update`` holds the lock for: they
never wait for it.

The rows of vLLM's own routes are written in :mod:`router.contract.vllm_endpoints` and
gathered here with the rest, so ``ep.PAUSE`` reads as ``ep.FLUSH_CACHE`` does; the
:class:`~router.contract.endpoint.Endpoint` type is in :mod:`router.contract.endpoint`.
"""

from __future__ import annotations

from router.contract import admin, peer, vllm_server, weight_sync
from router.contract.budget import DEFAULT_GROUP_TIMEOUT_S, DEFAULT_RECEIVE_TIMEOUT_S, Budget
from router.contract.endpoint import GET, GET_POST, POST, AnyEndpoint, Endpoint, receive_budget
from router.contract.vllm_endpoints import ABORT_REQUESTS as ABORT_REQUESTS
from router.contract.vllm_endpoints import COLLECTIVE_RPC as COLLECTIVE_RPC
from router.contract.vllm_endpoints import FINISH_WEIGHT_UPDATE as FINISH_WEIGHT_UPDATE
from router.contract.vllm_endpoints import GET_WORLD_SIZE as GET_WORLD_SIZE
from router.contract.vllm_endpoints import INIT_WEIGHT_TRANSFER_ENGINE as INIT_WEIGHT_TRANSFER_ENGINE
from router.contract.vllm_endpoints import IS_PAUSED as IS_PAUSED
from router.contract.vllm_endpoints import IS_SLEEPING as IS_SLEEPING
from router.contract.vllm_endpoints import PAUSE as PAUSE
from router.contract.vllm_endpoints import RESET_PREFIX_CACHE as RESET_PREFIX_CACHE
from router.contract.vllm_endpoints import RESUME as RESUME
from router.contract.vllm_endpoints import SHUTDOWN_WEIGHT_TRANSFER_ENGINE as SHUTDOWN_WEIGHT_TRANSFER_ENGINE
from router.contract.vllm_endpoints import SLEEP as SLEEP
from router.contract.vllm_endpoints import START_WEIGHT_UPDATE as START_WEIGHT_UPDATE
from router.contract.vllm_endpoints import UPDATE_WEIGHTS as UPDATE_WEIGHTS
from router.contract.vllm_endpoints import WAKE_UP as WAKE_UP
from router.contract.vllm_endpoints import WEIGHT_CHECKER as WEIGHT_CHECKER
from router.contract.vllm_endpoints import WEIGHT_INFO as WEIGHT_INFO

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
    bare_when_default=True,
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
    receive_budget(DEFAULT_RECEIVE_TIMEOUT_S),
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
    receive_budget(DEFAULT_RECEIVE_TIMEOUT_S),
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
    receive_budget(DEFAULT_RECEIVE_TIMEOUT_S),
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
