"""vLLM's admin routes in the endpoint table: its flush, its weight-transfer API, its dev routes, and
the routes only a real vLLM server serves.

Their rows are gathered with the rest of the table in :mod:`router.contract.endpoints`
(``ep.PAUSE`` as ``ep.FLUSH_CACHE``).
"""

from __future__ import annotations

from router.contract import vllm, vllm_dev, vllm_rl, vllm_server
from router.contract.budget import APPLY_S, DEFAULT_GROUP_TIMEOUT_S, DEFAULT_RECEIVE_TIMEOUT_S, Budget
from router.contract.endpoint import GET, POST, Endpoint, receive_budget

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
    receive_budget(DEFAULT_RECEIVE_TIMEOUT_S),
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
