"""Worker answers typed end to end: the shared weights report, the typed fan-out and the policy that reads it.

In-process only: the answers' wire shape (fields and their order, unchanged for SGLang's and vLLM's
clients), the fan-out's results parametrized by the operation's response model, and the policy reading
answers through the shared base or a protocol rather than by attribute name.
"""

from __future__ import annotations

import json
from typing import Any

from router.contract import endpoints as ep
from router.contract.admin import AdminResult, ModelInfo, UpdateWeightsFromDiskRequest, WeightsReport
from router.contract.fleet_answers import WorkerResult, agreed_fields
from router.contract.vllm import VllmResult
from router.contract.weight_sync import (
    AbortWeightsUpdateRequest,
    AbortWeightsUpdateResponse,
    CompleteWeightsUpdateResponse,
    JoinReport,
    PrepareWeightsUpdateRequest,
    PrepareWeightsUpdateResponse,
    WeightSyncResponse,
)
from router.gateway.admin import operations as ops
from router.gateway.admin.fanout import AdminCall, FanOut
from router.gateway.admin.verdicts import refused_untouched
from router.gateway.fleet.groups import group_name_of
from router.gateway.fleet.registry import Worker
from router.gateway.fleet.weights import agreed_checksum


def keys(model: Any) -> list[str]:
    return list(json.loads(model.model_dump_json()))


def test_answers_keep_their_field_order_on_the_wire() -> None:
    assert keys(AdminResult(success=True)) == ["success", "message", "rank_results", "weights", "weights_partial"]
    assert keys(WeightSyncResponse(success=True)) == [
        "success", "message", "rank_results", "weights", "weights_partial", "join_attempted",
    ]  # fmt: skip
    assert keys(PrepareWeightsUpdateResponse(status="ready")) == [
        "status", "message", "weights", "weights_partial", "rank_results",
    ]  # fmt: skip
    assert keys(AbortWeightsUpdateResponse(success=True))[3:5] == ["weights", "weights_partial"]
    complete = CompleteWeightsUpdateResponse(success=True, checksum="crc32:00000000")
    assert keys(complete)[:5] == ["success", "message", "rank_results", "weights", "weights_partial"]
    # A failure carries error.message after every declared field; fields this version does not know follow.
    failed = PrepareWeightsUpdateResponse.model_validate({"status": "error", "newer": 1}).failed("no")
    assert keys(failed) == ["status", "message", "weights", "weights_partial", "rank_results", "error", "newer"]
    assert keys(AdminResult(success=False).failed("no"))[-1] == "error" and "error" not in keys(
        failed.model_copy(update={"error": None})
    )


def test_every_answer_that_says_what_happened_to_the_weights_shares_the_base() -> None:
    for endpoint in (*ep.WORKER_ADMIN, *ep.VLLM_ONLY_ADMIN):
        declares = "weights" in endpoint.response.model_fields
        assert declares == issubclass(endpoint.response, WeightsReport), endpoint.path
        if endpoint.writes_weights and endpoint is not ep.COLLECTIVE_RPC:
            assert issubclass(endpoint.response, WeightsReport), endpoint.path


def test_a_vllm_init_answer_says_whether_its_join_began_without_changing_shape() -> None:
    raw = b'{"success": false, "message": "no", "weights": "intact", "join_attempted": false}'
    body = VllmResult.model_validate_json(raw)
    assert isinstance(body, JoinReport) and body.join_attempted is False
    assert json.loads(body.model_dump_json())["join_attempted"] is False
    assert VllmResult().join_attempted is None and "join_attempted" not in keys(VllmResult())
    assert VllmResult.model_validate({"join_attempted": "no"}).join_attempted is None


def result(body: Any, status: int) -> WorkerResult[Any]:
    return WorkerResult[type(body)](
        worker="w", url="u", success=status == 200, status_code=status, body=body, elapsed_ms=1.0
    )


def test_refusals_are_read_through_the_shared_base_and_the_join_report() -> None:
    intact = PrepareWeightsUpdateResponse(status="error", weights="intact")
    assert refused_untouched(ops.PREPARE, result(intact, 400))
    silent = PrepareWeightsUpdateResponse(status="error")
    assert not refused_untouched(ops.PREPARE, result(silent, 400))
    # An answer that is no weights report says nothing of the weights: they may have changed.
    assert not refused_untouched(ops.MODEL_INFO, result(ModelInfo(model_path="m"), 400))
    before_join = WeightSyncResponse(success=False, join_attempted=False)
    assert refused_untouched(ops.INIT_GROUP, result(before_join, 400))
    joined = WeightSyncResponse(success=False, weights="intact", join_attempted=True)
    assert not refused_untouched(ops.INIT_GROUP, result(joined, 400))


def test_requests_over_a_group_and_checksums_are_read_by_protocol() -> None:
    assert group_name_of(AbortWeightsUpdateRequest(group_name="g")) == "g"
    assert group_name_of(UpdateWeightsFromDiskRequest(model_path="/m")) == "weight_update_group"
    same = [CompleteWeightsUpdateResponse(success=True, checksum="c") for _ in range(2)]
    assert agreed_checksum(same) == "c"
    assert agreed_checksum([*same, AdminResult(success=True)]) is None


def test_the_typed_operations_are_the_table_s() -> None:
    for op in (ops.PREPARE, ops.COMPLETE, ops.ABORT, ops.START, ops.UPDATE, ops.FINISH, ops.INIT_GROUP):
        assert ops.OPERATIONS[op.path] is op
    assert ops.PREPARE.endpoint.response is PrepareWeightsUpdateResponse
    assert ops.PREPARE.answer_model().__name__ == "PrepareFleetAnswer"
    assert ops.ABORT.answer_model() is ops.ABORT.answer_model()


class _Client:
    """A worker client that answers every call with one raw body."""

    def __init__(self, status: int, raw: bytes):
        self.status, self.raw = status, raw
        self.paths: list[str] = []

    async def fetch_all(self, method: str, calls: list[tuple[str, str, bytes | None]], **kw: Any) -> list[Any]:
        self.paths += [path for _, path, _ in calls]
        return [kw["convert"](i, (self.status, self.raw, 0.001)) for i in range(len(calls))]


async def test_the_fan_out_answers_in_the_operation_s_response_model() -> None:
    client = _Client(200, b'{"status": "ready", "weights": "intact", "newer": true}')
    req = PrepareWeightsUpdateRequest.model_validate(
        {"num_buckets": 1, "group_name": "g", "buckets": [{"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]}]}
    )
    call = AdminCall(ops.PREPARE, "POST", req, {}, timeout_s=5.0)
    (got,) = await FanOut(client).to_all([Worker(id="w1", url="http://w1")], call)
    assert type(got) is WorkerResult[PrepareWeightsUpdateResponse]
    assert got.success and isinstance(got.body, PrepareWeightsUpdateResponse) and got.body.weights == "intact"
    assert json.loads(got.model_dump_json())["body"]["newer"] is True
    assert client.paths == ["/prepare_weights_update"]


def test_a_fleet_answer_keeps_only_the_fields_every_worker_reported_alike() -> None:
    def info(**fields: Any) -> ModelInfo:
        return ModelInfo.model_validate({"model_path": "/m", **fields})

    same = [info(weight_version="v2", model_type="llama"), info(weight_version="v2", model_type="llama")]
    assert agreed_fields(ModelInfo, same) == {"model_path": "/m", "weight_version": "v2", "model_type": "llama"}
    # Workers that disagree, or one that left a field unset (its default), agree on nothing there.
    split = [info(weight_version="v2", model_type="llama"), info(weight_version="v3")]
    assert agreed_fields(ModelInfo, split) == {"model_path": "/m"}
    # Per-worker fields never lift to the fleet; one worker without an answer makes nothing agreed.
    done = [AdminResult(success=True, message="a"), AdminResult(success=True, message="a")]
    assert "success" not in agreed_fields(AdminResult, done) and "message" not in agreed_fields(AdminResult, done)
    assert agreed_fields(ModelInfo, [same[0], None]) == {}


def test_a_parametrized_answer_model_is_built_once_per_process() -> None:
    # Pydantic holds parametrized models weakly; the broadcast path must not rebuild one per call.
    assert ops.parametrized(WorkerResult, ModelInfo) is ops.parametrized(WorkerResult, ModelInfo)
    assert ops.MODEL_INFO.answer_model() is ops.MODEL_INFO.answer_model()


def test_a_flush_that_sets_nothing_goes_bare_as_sglang_s_router_sends_it() -> None:
    """SGLang's ``/flush_cache`` reads no body: a call that sets nothing is sent without one (and without a
    ``Content-Type``), so no worker parses a body on a broadcast. A field set, or a route that reads its body
    even when it is all defaults (``/pause_generation``), forwards the parsed body as before."""
    headers = {"Content-Type": "application/json", "Authorization": "Bearer k"}
    worker = Worker(id="w1", url="http://w1")
    flush = ops.OPERATIONS[ep.FLUSH_CACHE.path]
    bare = AdminCall(flush, "POST", flush.endpoint.request(), headers, timeout_s=5.0)
    assert bare.body_for(worker) == b"" and bare.headers == {"Authorization": "Bearer k"}
    timed = flush.endpoint.request.model_validate({"timeout": 2})
    sent = AdminCall(flush, "POST", timed, headers, timeout_s=5.0)
    assert json.loads(sent.body_for(worker) or b"") == {"timeout": 2.0} and sent.headers == headers
    pause = ops.OPERATIONS[ep.PAUSE_GENERATION.path]
    kept = AdminCall(pause, "POST", pause.endpoint.request(), headers, timeout_s=5.0)
    assert kept.body_for(worker) == b"{}" and kept.headers == headers
    assert [e.path for e in (*ep.WORKER_ADMIN, *ep.VLLM_ONLY_ADMIN) if e.bare_when_default] == [ep.FLUSH_CACHE.path]


def test_the_cheap_protocol_checks_decide_as_isinstance_does() -> None:
    """``names_a_group`` and ``reports_checksum`` stand in for ``isinstance`` on the broadcast's path (Python
    3.11's protocol check costs microseconds per call): they must agree on every kind of answer and request."""
    from router.contract.admin import FlushCacheRequest
    from router.contract.weight_sync import (
        DEFAULT_GROUP_NAME,
        ChecksumReport,
        GroupCall,
        names_a_group,
        reports_checksum,
    )

    requests = [
        FlushCacheRequest(),
        FlushCacheRequest.model_validate({"group_name": "g"}),  # a field this version does not know
        AbortWeightsUpdateRequest(group_name="g"),
        PrepareWeightsUpdateRequest.model_validate(
            {"num_buckets": 1, "group_name": "g", "buckets": [{"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]}]}
        ),
    ]
    assert [names_a_group(r) for r in requests] == [isinstance(r, GroupCall) for r in requests] == [
        False, True, True, True,
    ]  # fmt: skip
    answers = [AdminResult(success=True), CompleteWeightsUpdateResponse(success=True, checksum="crc32:0"), object()]
    assert [reports_checksum(a) for a in answers] == [isinstance(a, ChecksumReport) for a in answers]
    assert [group_name_of(r) for r in requests] == [DEFAULT_GROUP_NAME, "g", "g", "g"]
