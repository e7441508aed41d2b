"""One method per router call, shared by the blocking and the asyncio client.

Each method builds its request model and names the model of the router's answer
(a :class:`Call`); the client's transport sends it and parses the answer into
that model, once. The HTTP wait of an admin call comes from the endpoint's
timeout budget: the router's wait for the workers plus one margin, plus the
router's lock wait for serialized calls (:mod:`router.contract.budget`).

A non-2xx answer raises :class:`RouterCallError` with the status, the message
and, for a failed broadcast, the per-worker results as typed models.

Behind a router with replicas (``--leader-election``) a call is sent again through
a failover of its leader when the answer proves nothing ran
(:mod:`router.trainer.failover`), within ``failover_budget_s``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, Unpack
from urllib.parse import quote, urlencode

from pydantic import BaseModel, ValidationError

from router.contract import endpoints as ep
from router.contract.admin import (
    AbortRequest,
    AbortRequestResult,
    AdminResult,
    ContinueRequest,
    ContinueResult,
    EmptyRequest,
    FlushCacheRequest,
    FlushCacheResult,
    MemoryOccupationRequest,
    MemoryOccupationResult,
    MemoryTag,
    PauseMode,
    PauseRequest,
    PauseResult,
    ServerInfo,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDiskResult,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
    UpdateWeightVersionResult,
    WeightsCheckerRequest,
)
from router.contract.base import WireRequest, WireResponse
from router.contract.budget import DEFAULT_LOCK_WAIT_S
from router.contract.endpoint import Endpoint
from router.contract.errors import ErrorBody
from router.contract.fleet import (
    AddWorkerRequest,
    FleetModelInfo,
    FleetWeightVersion,
    JournalResolved,
    JournalResolveRequest,
    JournalView,
    RemovedWorker,
    UpdateWorkerRequest,
    WorkerList,
    WorkerRecord,
    WorldSizeResponse,
)
from router.contract.fleet_answers import (
    CompleteFleetAnswer,
    FleetAnswer,
    GroupInitFleetAnswer,
    PrepareFleetAnswer,
    WeightsCheckerFleetAnswer,
    WorkerResult,
)
from router.contract.weight_digest import EXPECTED_CHECKSUM_HEADER
from router.contract.weight_sync import (
    DEFAULT_GROUP_NAME,
    AbortWeightsUpdateRequest,
    AbortWeightsUpdateResponse,
    BucketMetadata,
    CompleteWeightsUpdateRequest,
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    PrepareWeightsUpdateRequest,
    UpdateWeightsFromDistributedRequest,
    WeightSyncResponse,
)
from router.trainer.adapter_calls import AdapterCalls
from router.trainer.call_fields import DiskUpdateFields, TensorUpdateFields
from router.trainer.failover import DEFAULT_FAILOVER_BUDGET_S
from router.trainer.transport import given
from router.trainer.vllm_calls import VllmCalls

A = TypeVar("A", bound=WireResponse)
M = TypeVar("M", bound=BaseModel)
#: The HTTP timeout of calls outside the admin table (registry, journal, world size): they answer at once.
REGISTRY_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Call(Generic[A]):
    """One router call: what to send, how long to wait, and the model of the answer."""

    method: str
    path: str
    body: WireRequest | None
    answer: type[A]
    timeout_s: float
    headers: tuple[tuple[str, str], ...] = ()
    """Headers of this call only (beside the client's :meth:`RouterCalls.headers`)."""
    query: str = ""
    """The query string, for the routes that read their arguments there (vLLM's ``/pause?mode=``)."""

    @property
    def target(self) -> str:
        """The path and query the request is sent to."""
        return f"{self.path}?{self.query}" if self.query else self.path

    def data(self) -> bytes | None:
        if self.body is None:
            return None
        data = self.body.to_json()
        return None if self.method == "GET" and data == b"{}" else data


class RouterCallError(RuntimeError):
    """A router call answered non-2xx (``status``), or got no answer at all (``status`` is ``None``)."""

    def __init__(
        self,
        method: str,
        path: str,
        status: int | None,
        message: str,
        *,
        answer: FleetAnswer[Any] | None = None,
        error: ErrorBody | None = None,
    ):
        self.method = method
        self.path = path
        self.status = status
        self.message = message
        self.answer = answer
        """The router's answer of a failed broadcast (per-worker ``results``)."""
        self.error = error
        """The error body of a refusal (extra fields such as ``expected_world_size`` in ``model_extra``)."""
        super().__init__(f"{method} {path} -> {status}: {message}")

    @property
    def results(self) -> list[WorkerResult[Any]]:
        """Per-worker results of a failed broadcast (empty for other errors)."""
        return list(self.answer.results) if self.answer is not None else []

    def failed_workers(self) -> list[str]:
        return [r.worker for r in self.results if not r.success]


def decode_answer(call: Call[A], status: int, raw: bytes) -> A:
    """The answer of a 2xx call as ``call.answer``; anything else raises :class:`RouterCallError`."""
    if 200 <= status < 300:
        try:
            return call.answer.model_validate_json(raw)
        except ValidationError as exc:
            raise RouterCallError(
                call.method, call.path, status, f"the router's answer is not a {call.answer.__name__}: {exc}"
            ) from None
    answer: FleetAnswer[Any] | None = None
    error: ErrorBody | None = None
    try:
        data = json.loads(raw) if raw else None
    except ValueError:
        data = None
    if isinstance(data, dict):
        if "results" in data:  # a broadcast: the per-worker answers, typed like the route's answer
            typed = _parsed(call.answer, data) if issubclass(call.answer, FleetAnswer) else None
            answer = typed if typed is not None else _parsed(FleetAnswer[WireResponse], data)
        if "error" in data:
            error = _parsed(ErrorBody, data)
    if error is not None:
        message = error.error.message
    elif answer is not None:
        message = answer.message
    else:
        message = raw.decode("utf-8", errors="replace")[:1000] or f"HTTP {status}"
    raise RouterCallError(call.method, call.path, status, message, answer=answer, error=error)


def _parsed(model: type[M], data: dict[str, Any]) -> M | None:
    try:
        return model.model_validate(data)
    except ValidationError:
        return None


def unreachable(call: Call[Any], exc: BaseException) -> RouterCallError:
    """The error for a call that got no HTTP answer at all (refused, reset, timed out)."""
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else repr(exc)  # a timeout's str() is empty
    return RouterCallError(call.method, call.path, None, f"router unreachable: {detail}")


def query_string(req: WireRequest) -> str:
    """The fields of ``req`` the caller set, as query parameters: booleans spelled as in JSON, a list's
    items each under the field's name (as the router reads a query, :func:`router.contract.web.parsing.query_fields`)."""
    pairs: list[tuple[str, str]] = []
    for name, value in req.model_dump(mode="json", exclude_unset=True).items():
        for item in value if isinstance(value, list) else [value]:
            if item is not None:
                pairs.append((name, json.dumps(item) if isinstance(item, bool) else str(item)))
    return urlencode(pairs)


def _buckets(buckets: Sequence[BucketMetadata]) -> list[BucketMetadata]:
    # A model passes as it is; an untyped caller's dict (the shape the wire takes) is still validated into one.
    return [BucketMetadata.model_validate(b) for b in buckets]


class RouterCalls(AdapterCalls, VllmCalls):
    """The router's HTTP surface as methods; the transport (:meth:`_call`) is the subclass's.

    Args:
        url: the router's base URL (a trailing ``/`` is dropped).
        admin_key: sent as ``Authorization: Bearer`` on every call.
        lock_wait_s: the router's ``--admin-lock-timeout-s``: how long a serialized
            call may wait for the router's update lock before its own work starts.
        failover_budget_s: how long one call may keep trying while the router's leader
            fails over (:mod:`router.trainer.failover`); 0 sends every call once.
    """

    def __init__(
        self,
        url: str,
        *,
        admin_key: str | None = None,
        lock_wait_s: float = DEFAULT_LOCK_WAIT_S,
        failover_budget_s: float = DEFAULT_FAILOVER_BUDGET_S,
    ):
        self.url = url.rstrip("/")
        self.admin_key = admin_key
        self.lock_wait_s = lock_wait_s
        self.failover_budget_s = failover_budget_s
        self.joined_groups: set[str] = set()
        """Names of the weight-update groups this trainer has joined as rank 0 through this
        client. ``sync_weights`` initializes a group not in it (asking the router for ranks,
        calling ``GroupSpec.join``) and removes a group whose sync failed after it was
        joined, so that the next sync rebuilds it."""

    def headers(self) -> dict[str, str]:
        """Headers for every call: JSON, and the admin key as ``Authorization: Bearer``."""
        out = {"Content-Type": "application/json"}
        if self.admin_key:
            out["Authorization"] = f"Bearer {self.admin_key}"
        return out

    def _call(self, call: Call[A]) -> A:
        raise NotImplementedError

    def _admin(
        self, endpoint: Endpoint[Any, Any], req: WireRequest, answer: type[A], expected_checksum: str | None = None
    ) -> A:
        lock = self.lock_wait_s if endpoint.serialized else 0.0
        wait = endpoint.budget.client_wait(endpoint.timeout_of(req), lock_wait_s=lock)
        headers = () if expected_checksum is None else ((EXPECTED_CHECKSUM_HEADER, expected_checksum),)
        method = endpoint.methods[-1]
        if endpoint.query_params:  # vLLM reads these routes' arguments from the query only, never the body
            return self._call(Call(method, endpoint.path, None, answer, wait, headers, query_string(req)))
        return self._call(Call(method, endpoint.path, req, answer, wait, headers))

    def _plain(self, method: str, path: str, answer: type[A], body: WireRequest | None = None) -> A:
        return self._call(Call(method, path, body, answer, REGISTRY_TIMEOUT_S))

    # -- generation control
    def pause_generation(self, mode: PauseMode = "retract") -> FleetAnswer[PauseResult]:
        return self._admin(ep.PAUSE_GENERATION, PauseRequest(mode=mode), FleetAnswer[PauseResult])

    def continue_generation(self) -> FleetAnswer[ContinueResult]:
        return self._admin(ep.CONTINUE_GENERATION, ContinueRequest(), FleetAnswer[ContinueResult])

    def abort_request(
        self, rid: str | list[str] | None = None, abort_all: bool = False
    ) -> FleetAnswer[AbortRequestResult]:
        req = AbortRequest(**given(rid=rid), abort_all=abort_all)
        return self._admin(ep.ABORT_REQUEST, req, FleetAnswer[AbortRequestResult])

    def flush_cache(self) -> FleetAnswer[FlushCacheResult]:
        return self._admin(ep.FLUSH_CACHE, FlushCacheRequest(), FleetAnswer[FlushCacheResult])

    # -- weights
    def update_weights_from_disk(
        self, model_path: str, *, expected_checksum: str | None = None, **fields: Unpack[DiskUpdateFields]
    ) -> FleetAnswer[UpdateWeightsFromDiskResult]:
        """``expected_checksum``: the digest every worker must hold afterwards (:mod:`router.trainer.digests`);
        the router publishes the update only if each does (a 502 names each worker's otherwise)."""
        req = UpdateWeightsFromDiskRequest(model_path=model_path, **fields)
        return self._admin(
            ep.UPDATE_WEIGHTS_FROM_DISK, req, FleetAnswer[UpdateWeightsFromDiskResult], expected_checksum
        )

    def update_weights_from_tensor(
        self, *, expected_checksum: str | None = None, **fields: Unpack[TensorUpdateFields]
    ) -> FleetAnswer[AdminResult]:
        return self._admin(
            ep.UPDATE_WEIGHTS_FROM_TENSOR,
            UpdateWeightsFromTensorRequest(**fields),
            FleetAnswer[AdminResult],
            expected_checksum,
        )

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        *,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str | None = None,
        rank_offset: int | None = None,
        timeout_s: float | None = None,
    ) -> GroupInitFleetAnswer:
        req = InitWeightsUpdateGroupRequest(
            master_address=master_address,
            master_port=master_port,
            world_size=world_size,
            group_name=group_name,
            **given(backend=backend, rank_offset=rank_offset, timeout_s=timeout_s),
        )
        return self._admin(ep.INIT_WEIGHTS_UPDATE_GROUP, req, GroupInitFleetAnswer)

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> FleetAnswer[WeightSyncResponse]:
        req = DestroyWeightsUpdateGroupRequest(group_name=group_name)
        return self._admin(ep.DESTROY_WEIGHTS_UPDATE_GROUP, req, FleetAnswer[WeightSyncResponse])

    def get_world_size(self) -> WorldSizeResponse:
        return self._plain("GET", "/get_world_size", WorldSizeResponse)

    def update_weights_from_distributed(
        self,
        bucket: BucketMetadata,
        *,
        group_name: str = DEFAULT_GROUP_NAME,
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        timeout_s: float | None = None,
        expected_checksum: str | None = None,
    ) -> FleetAnswer[WeightSyncResponse]:
        meta = _buckets([bucket])[0]
        req = UpdateWeightsFromDistributedRequest(
            names=meta.names,
            dtypes=meta.dtypes,
            shapes=meta.shapes,
            group_name=group_name,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
            **given(load_format=load_format, weight_version=weight_version, timeout_s=timeout_s),
        )
        return self._admin(ep.UPDATE_WEIGHTS_FROM_DISTRIBUTED, req, FleetAnswer[WeightSyncResponse], expected_checksum)

    def prepare_weights_update(
        self,
        buckets: Sequence[BucketMetadata],
        *,
        group_name: str = DEFAULT_GROUP_NAME,
        load_format: str | None = None,
        weight_version: str | None = None,
        atomic: bool | None = None,
        timeout_s: float | None = None,
    ) -> PrepareFleetAnswer:
        metas = _buckets(buckets)
        req = PrepareWeightsUpdateRequest(
            num_buckets=len(metas),
            buckets=metas,
            group_name=group_name,
            **given(load_format=load_format, weight_version=weight_version, atomic=atomic, timeout_s=timeout_s),
        )
        return self._admin(ep.PREPARE_WEIGHTS_UPDATE, req, PrepareFleetAnswer)

    def complete_weights_update(
        self,
        *,
        group_name: str = DEFAULT_GROUP_NAME,
        flush_cache: bool = False,
        weight_version: str | None = None,
        return_checksum: bool | None = None,
        timeout_s: float | None = None,
        expected_checksum: str | None = None,
    ) -> CompleteFleetAnswer:
        req = CompleteWeightsUpdateRequest(
            group_name=group_name,
            flush_cache=flush_cache,
            **given(weight_version=weight_version, return_checksum=return_checksum, timeout_s=timeout_s),
        )
        return self._admin(ep.COMPLETE_WEIGHTS_UPDATE, req, CompleteFleetAnswer, expected_checksum)

    def abort_weights_update(self, group_name: str = DEFAULT_GROUP_NAME) -> FleetAnswer[AbortWeightsUpdateResponse]:
        req = AbortWeightsUpdateRequest(group_name=group_name)
        return self._admin(ep.ABORT_WEIGHTS_UPDATE, req, FleetAnswer[AbortWeightsUpdateResponse])

    def update_weight_version(
        self, new_version: str, abort_all_requests: bool = False
    ) -> FleetAnswer[UpdateWeightVersionResult]:
        req = UpdateWeightVersionRequest(new_version=new_version, abort_all_requests=abort_all_requests)
        return self._admin(ep.UPDATE_WEIGHT_VERSION, req, FleetAnswer[UpdateWeightVersionResult])

    def release_memory_occupation(self, tags: list[MemoryTag] | None = None) -> FleetAnswer[MemoryOccupationResult]:
        req = MemoryOccupationRequest(**given(tags=tags))
        return self._admin(ep.RELEASE_MEMORY_OCCUPATION, req, FleetAnswer[MemoryOccupationResult])

    def resume_memory_occupation(self, tags: list[MemoryTag] | None = None) -> FleetAnswer[MemoryOccupationResult]:
        req = MemoryOccupationRequest(**given(tags=tags))
        return self._admin(ep.RESUME_MEMORY_OCCUPATION, req, FleetAnswer[MemoryOccupationResult])

    # -- fleet reads
    def model_info(self) -> FleetModelInfo:
        return self._admin(ep.MODEL_INFO, EmptyRequest(), FleetModelInfo)

    def get_weight_version(self) -> FleetWeightVersion:
        return self._admin(ep.GET_WEIGHT_VERSION, EmptyRequest(), FleetWeightVersion)

    def server_info(self) -> FleetAnswer[ServerInfo]:
        return self._admin(ep.SERVER_INFO, EmptyRequest(), FleetAnswer[ServerInfo])

    def weights_checker(self, action: str = "checksum") -> WeightsCheckerFleetAnswer:
        req = WeightsCheckerRequest.model_validate({"action": action})
        return self._admin(ep.WEIGHTS_CHECKER, req, WeightsCheckerFleetAnswer)

    # -- registry
    def list_workers(self) -> WorkerList:
        return self._plain("GET", "/workers", WorkerList)

    def add_worker(self, url: str, disabled: bool = False) -> WorkerRecord:
        return self._plain("POST", "/workers", WorkerRecord, AddWorkerRequest(url=url, disabled=disabled))

    def remove_worker(self, worker: str) -> RemovedWorker:
        return self._plain("DELETE", f"/workers/{quote(worker, safe='')}", RemovedWorker)

    def set_worker_disabled(self, worker: str, disabled: bool) -> WorkerRecord:
        return self._plain(
            "PUT", f"/workers/{quote(worker, safe='')}", WorkerRecord, UpdateWorkerRequest(disabled=disabled)
        )

    def update_journal(self) -> JournalView:
        return self._plain("GET", "/weight_update_journal", JournalView)

    def resolve_update_journal(self) -> JournalResolved:
        return self._plain(
            "POST", "/weight_update_journal/resolve", JournalResolved, JournalResolveRequest(acknowledge=True)
        )
