"""The router's policy classes, driven directly (no HTTP): registry, health
thresholds, load-balancing policies, the update gate, the journal, rank
planning, fencing. Plus: importing the router never imports torch."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from router.contract import endpoints as ep
from router.contract.admin import (
    ModelInfo,
    PauseRequest,
    PauseResult,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDiskResult,
)
from router.contract.budget import HOP_MARGIN_S
from router.contract.errors import BadRequest, Conflict, NotFound, Unavailable
from router.contract.fleet_answers import CompleteFleetAnswer, WorkerResult
from router.contract.web.parsing import MAX_BODY_BYTES
from router.contract.weight_sync import (
    CompleteWeightsUpdateResponse,
    InitWeightsUpdateGroupRequest,
    PrepareWeightsUpdateRequest,
    PrepareWeightsUpdateResponse,
    WeightSyncResponse,
)
from router.gateway.admin.answers import fleet_answer
from router.gateway.admin.journal import UpdateJournal
from router.gateway.admin.operations import OPERATIONS
from router.gateway.admin.update_gate import UpdateGate
from router.gateway.admin.verdicts import judge
from router.gateway.config import RouterConfig, process_share
from router.gateway.fleet.registry import HealthThresholds, WorkerRegistry, normalize_url, worker_id_for
from router.gateway.frontend.budget import BodyBudget
from router.gateway.routing.policy import LeastInflight, Random, RoundRobin, make_policy
from router.gateway.routing.prepare import prepare_generate, prepare_tokens_payload
from router.gateway.sync.ranks import plan_ranks
from router.gateway.upstream import decode_answer


@pytest.mark.process
def test_router_import_leaves_torch_out():
    code = (
        "import sys, router, router.gateway.app, router.gateway.cli, router.trainer, router.contract.fleet;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_event_loop_choice():
    from router.gateway.cli import event_loop_factory

    assert event_loop_factory("asyncio") is None
    try:
        import uvloop
    except ImportError:  # the fallback: asyncio's loop, and a clear refusal when uvloop is demanded
        assert event_loop_factory("auto") is None
        with pytest.raises(RuntimeError, match="not installed"):
            event_loop_factory("uvloop")
    else:
        assert event_loop_factory("auto") is uvloop.new_event_loop
        assert event_loop_factory("uvloop") is uvloop.new_event_loop


class TestUrls:
    def test_normalizes(self):
        assert normalize_url("HTTP://LocalHost:8000/") == "http://localhost:8000"
        assert normalize_url("http://[::1]:9") == "http://[::1]:9"

    @pytest.mark.parametrize(
        "bad",
        [
            "ftp://h:1",
            "http://user:pw@h:1",
            "http://h:1/path",
            "http://h:1?x=1",
            "http://" + "a" * 64 + ".localhost:1",
            "http://bad host:1",
            "http://-\u00e9\u00e9-.localhost:1",
            "nonsense",
            "http://h:99999",
        ],
    )
    def test_rejects(self, bad):
        with pytest.raises(BadRequest):
            normalize_url(bad)

    def test_ids_are_stable(self):
        assert worker_id_for("http://a:1") == worker_id_for(normalize_url("http://a:1/"))
        assert worker_id_for("http://a:1") != worker_id_for("http://a:2")


class TestRegistry:
    def test_add_find_remove(self):
        reg = WorkerRegistry()
        w = reg.add("http://127.0.0.1:8001")
        assert reg.find(w.id) is w
        assert reg.find("http%3A%2F%2F127.0.0.1%3A8001") is w
        assert reg.find("http://127.0.0.1:8001/") is w
        with pytest.raises(Conflict):
            reg.add("http://127.0.0.1:8001/")
        reg.remove(w.id)
        assert w.removed and len(reg) == 0
        with pytest.raises(NotFound):
            reg.get(w.id)

    def test_routable_and_live(self):
        reg = WorkerRegistry()
        a, b, c = (reg.add(f"http://h:{p}") for p in (1, 2, 3))
        for w in (a, b, c):
            reg.observe_probe(w, True)
        b.disabled = True
        c.health = "dead"
        assert reg.routable() == [a]
        assert reg.live() == [a, b]

    def test_health_thresholds(self):
        reg = WorkerRegistry(thresholds=HealthThresholds(failure=2, dead=4, success=2))
        w = reg.add("http://h:1")
        assert w.health == "unhealthy"
        assert reg.observe_probe(w, True) and w.health == "healthy"  # first contact: at once
        reg.observe_probe(w, False)
        assert w.health == "healthy"  # one miss is not enough
        reg.observe_probe(w, False)
        assert w.health == "unhealthy"
        reg.observe_probe(w, False)
        reg.observe_probe(w, False)
        assert w.health == "dead"
        reg.observe_probe(w, True)
        assert w.health == "dead"  # needs the success threshold now
        reg.observe_probe(w, True)
        assert w.health == "healthy"

    def test_failures_ignored_while_in_update(self):
        reg = WorkerRegistry(thresholds=HealthThresholds(failure=1, dead=2, success=1))
        w = reg.add("http://h:1")
        reg.observe_probe(w, True)
        w.update_holds = 1
        for _ in range(5):
            reg.observe_probe(w, False)
        assert w.health == "healthy"
        w.update_holds = 0
        reg.observe_probe(w, False)
        reg.observe_probe(w, False)
        assert w.health == "dead"


class TestPolicies:
    def _workers(self, n):
        reg = WorkerRegistry()
        return [reg.add(f"http://h:{i + 1}") for i in range(n)]

    def test_least_inflight(self):
        ws = self._workers(3)
        ws[0].inflight, ws[1].inflight, ws[2].inflight = 3, 1, 2
        assert LeastInflight().choose(ws) is ws[1]
        ws[1].inflight = 0
        ws[2].inflight = 0
        p = LeastInflight()
        assert {p.choose(ws).id for _ in range(4)} == {ws[1].id, ws[2].id}  # ties rotate

    def test_round_robin_and_random(self):
        ws = self._workers(3)
        rr = RoundRobin()
        assert [rr.choose(ws) for _ in range(6)] == ws + ws
        rnd = Random(seed=1)
        assert {rnd.choose(ws).id for _ in range(50)} == {w.id for w in ws}
        with pytest.raises(ValueError):
            make_policy("cache_aware")


class TestUpdateGate:
    async def test_timeout_is_503_and_busy_while_waiting(self):
        waits = []
        gate = UpdateGate(0.2, on_wait=lambda op, s, ok: waits.append((op, ok)))
        await gate.acquire("first")
        assert gate.is_busy and gate.holder.operation == "first"
        with pytest.raises(Unavailable) as err:
            await gate.acquire("second")
        assert err.value.status == 503 and "first" in err.value.message
        waiter = asyncio.ensure_future(gate.acquire("third", timeout_s=5))
        # One turn of the loop (a yield, not a timed wait): the waiter's first step queues it on the lock.
        await asyncio.sleep(0)
        gate.release()
        assert gate.is_busy  # the lock is free, but a waiter is about to take it
        await waiter
        assert gate.holder.operation == "third"
        gate.release()
        assert not gate.is_busy
        assert waits == [("first", True), ("second", False), ("third", True)]


class TestJournal:
    async def test_round_trip_and_crash_recovery(self, tmp_path):
        j = UpdateJournal(tmp_path)
        await j.begin("/update_weights_from_disk", [("w-a", "http://a:1", False), ("w-b", "http://b:1", True)])
        assert json.loads((tmp_path / "update_journal.json").read_text())["state"] == "in_flight"
        assert (tmp_path / "update_journal.json").stat().st_mode & 0o777 == 0o600
        # A new process finds the in-flight entry: it becomes a failure naming every target.
        again = UpdateJournal(tmp_path)
        state = again.load()
        assert state.state == "failed" and set(state.failed) == {"w-a", "w-b"}
        assert "router stopped" in state.reason
        assert again.names("w-a") and not again.names("w-c")
        assert await again.discard_target("w-a")
        assert again.pending is not None
        assert await again.discard_target("w-b")
        assert again.pending is None and not (tmp_path / "update_journal.json").exists()

    async def test_a_failure_keeps_only_the_uncertain_targets(self, tmp_path):
        j = UpdateJournal(tmp_path)
        await j.begin("/update_weights_from_disk", [("w-a", "http://a:1", False), ("w-b", "http://b:1", True)])
        await j.fail(["w-b"], "w-b did not answer")
        on_disk = json.loads((tmp_path / "update_journal.json").read_text())
        assert on_disk["state"] == "failed" and [t["id"] for t in on_disk["targets"]] == ["w-b"]
        assert UpdateJournal(tmp_path).load().failed == ["w-b"]

    async def test_clear_on_success(self, tmp_path):
        j = UpdateJournal(tmp_path)
        await j.begin("/pause_generation", [("w-a", "http://a:1", False)])
        await j.clear()
        assert UpdateJournal(tmp_path).load() is None

    def test_unreadable_fences_everyone(self, tmp_path):
        (tmp_path / "update_journal.json").write_text("{not json")
        state = UpdateJournal(tmp_path).load_or_unreadable([("w-a", "http://a:1"), ("w-b", "http://b:1")])
        assert state.state == "failed" and {t.id for t in state.targets} == {"w-a", "w-b"}

    async def test_unwritable_refuses_update(self, tmp_path):
        blocker = tmp_path / "file"
        blocker.write_text("x")
        j = UpdateJournal(blocker / "sub")
        with pytest.raises(Unavailable):
            await j.begin("/pause_generation", [("w-a", "http://a:1", False)])
        assert j.pending is None


class TestRanks:
    def test_offsets_follow_tp_sizes(self):
        slots = plan_ranks([("a", "u1", 2), ("b", "u2", 1), ("c", "u3", 4)], world_size=8)
        assert [(s.worker_id, s.rank_offset) for s in slots] == [("a", 1), ("b", 3), ("c", 4)]
        slots = plan_ranks([("a", "u1", 1), ("b", "u2", 1)], world_size=4, rank_offset=2)
        assert [s.rank_offset for s in slots] == [2, 3]

    def test_wrong_world_size_names_the_right_one(self):
        with pytest.raises(BadRequest) as err:
            plan_ranks([("a", "u1", 1), ("b", "u2", 1)], world_size=2)
        assert "must be 3" in err.value.message and err.value.extra["expected_world_size"] == 3

    def test_unknown_tp_is_503(self):
        with pytest.raises(Unavailable):
            plan_ranks([("a", "u1", None)], world_size=2)


class TestWire:
    def test_operations_table_and_budgets(self):
        locked = {p for p, op in OPERATIONS.items() if op.locked}
        assert {
            "/pause_generation",
            "/init_weights_update_group",
            "/destroy_weights_update_group",
            "/update_weights_from_disk",
            "/update_weights_from_distributed",
            "/prepare_weights_update",
        } <= locked
        # complete and abort run inside the update a ready prepare holds the lock for.
        assert not OPERATIONS["/complete_weights_update"].locked and not OPERATIONS["/abort_weights_update"].locked
        disk = OPERATIONS["/update_weights_from_disk"]
        assert (
            disk.router_wait(UpdateWeightsFromDiskRequest(model_path="/m"))
            == ep.UPDATE_WEIGHTS_FROM_DISK.budget.work_s + HOP_MARGIN_S
        )
        # A caller's timeout_s bounds a join: each layer adds one margin on top of the worker's bound.
        init = InitWeightsUpdateGroupRequest(master_address="127.0.0.1", master_port=1, world_size=3, timeout_s=2000)
        bound = ep.INIT_WEIGHTS_UPDATE_GROUP.worker_bound(init)
        assert bound == 2000 + ep.INIT_WEIGHTS_UPDATE_GROUP.budget.overhead_s
        assert OPERATIONS["/init_weights_update_group"].router_wait(init) == bound + HOP_MARGIN_S
        assert ep.INIT_WEIGHTS_UPDATE_GROUP.budget.client_wait(2000, lock_wait_s=7) == bound + 7 + 2 * HOP_MARGIN_S
        # A timeout_s that a route does not declare changes nothing (prepare's bounds its receive, not the call).
        assert (
            ep.PAUSE_GENERATION.worker_bound(PauseRequest.model_validate({"timeout_s": 1}))
            == ep.PAUSE_GENERATION.budget.work_s
        )
        assert (
            ep.PREPARE_WEIGHTS_UPDATE.timeout_of(
                PrepareWeightsUpdateRequest.model_validate(
                    {
                        "num_buckets": 1,
                        "buckets": [{"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]}],
                        "group_name": "g",
                        "timeout_s": 5,
                    }
                )
            )
            is None
        )

    def test_requests_forward_what_the_caller_set_and_unknown_fields(self):
        req = PauseRequest.model_validate({"mode": "in_place", "from_a_newer_sglang": {"x": [1]}})
        assert json.loads(req.to_json()) == {"mode": "in_place", "from_a_newer_sglang": {"x": [1]}}
        assert json.loads(PauseRequest().to_json()) == {}  # defaults stay the receiver's
        init = InitWeightsUpdateGroupRequest(master_address="h", master_port=5, world_size=3)
        assert json.loads(init.model_copy(update={"rank_offset": 2}).to_json())["rank_offset"] == 2
        for bad in ({"mode": 1}, {"mode": "sideways"}):
            with pytest.raises(ValueError):
                PauseRequest.model_validate(bad)
        with pytest.raises(ValueError):
            InitWeightsUpdateGroupRequest.model_validate({"master_address": "h", "master_port": 5, "world_size": True})

    def test_fleet_answer_keeps_worker_field_names_and_types(self):
        complete = OPERATIONS["/complete_weights_update"]

        def result(worker: str, n: int) -> WorkerResult:
            body = CompleteWeightsUpdateResponse(success=True, num_buckets_received=n, weight_version="v1")
            return WorkerResult[CompleteWeightsUpdateResponse](
                worker=worker, url=f"http://{worker}", success=True, body=body, elapsed_ms=1.0
            )

        agreed = fleet_answer(complete, [result("a", 3), result("b", 3)], "ok", checksums={"a": None, "b": None})
        parsed = CompleteFleetAnswer.model_validate_json(agreed.model_dump_json())
        assert parsed.num_buckets_received == 3 and parsed.weight_version == "v1" and parsed.success
        assert (
            isinstance(parsed.results[0].body, CompleteWeightsUpdateResponse)
            and parsed.results[1].body.num_buckets_received == 3
        )
        split = fleet_answer(complete, [result("a", 3), result("b", 2)], "no")
        assert split.num_buckets_received == 0 and [r.body.num_buckets_received for r in split.results] == [3, 2]
        # A plain broadcast lifts the fields every worker agrees on beside the envelope.
        pause = fleet_answer(
            OPERATIONS["/pause_generation"],
            [
                WorkerResult[PauseResult](
                    worker=w, url="u", success=True, body=PauseResult(pause_mode="retract", num_frozen=0), elapsed_ms=1
                )
                for w in ("a", "b")
            ],
            "ok",
        )
        dumped = json.loads(pause.model_dump_json())
        assert dumped["pause_mode"] == "retract" and dumped["results"][0]["body"]["pause_mode"] == "retract"

    def test_verdicts_keep_fenced_only_workers_whose_weights_may_differ(self):
        disk, init = OPERATIONS["/update_weights_from_disk"], OPERATIONS["/init_weights_update_group"]

        def answer(worker: str, status: int | None, **body_fields) -> WorkerResult:
            body = UpdateWeightsFromDiskResult(success=status == 200, **body_fields) if status else None
            return WorkerResult[UpdateWeightsFromDiskResult](
                worker=worker, url="u", success=status == 200, status_code=status, body=body, elapsed_ms=1
            )

        ok, refused, partial = (
            answer("a", 200, weights="updated"),
            answer("b", 400, weights="intact"),
            answer("c", 400, weights="partial"),
        )
        silent, unreachable = answer("d", 400), answer("e", None)
        verdict = judge(disk, [refused, answer("x", 400, weights="intact")])
        assert verdict.kept == () and verdict.all_refused and verdict.refusal_status == 400
        # Once one target moved on, a refusal leaves that worker on the previous weights: it stays out.
        assert judge(disk, [ok, refused]).kept == ("b",)
        assert judge(disk, [refused, partial, silent, unreachable]).kept == ("c", "d", "e")
        assert not judge(disk, [refused, unreachable]).all_refused
        # A group init: refused before any join → untouched; a failed join may leave the group half-built.
        before_join = WorkerResult[WeightSyncResponse](
            worker="f", url="u", success=False, status_code=400, elapsed_ms=1,
            body=WeightSyncResponse(success=False, weights="intact", join_attempted=False),
        )  # fmt: skip
        failed_join = before_join.model_copy(
            update={"worker": "g", "body": WeightSyncResponse(success=False, join_attempted=True)}
        )
        assert judge(init, [before_join, failed_join]).kept == ("g",)

    def test_worker_answers_decode_into_their_models_or_a_clear_failure(self):
        ok = decode_answer(CompleteWeightsUpdateResponse, 200, b'{"success": true, "num_buckets_received": 2}')
        assert ok.error is None and isinstance(ok.value, CompleteWeightsUpdateResponse)
        assert ok.value.num_buckets_received == 2
        bad = decode_answer(CompleteWeightsUpdateResponse, 200, b'{"success": true, "num_buckets_received": {"a": 1}}')
        assert bad.body is None and bad.value is None and bad.error is not None
        assert "not a valid CompleteWeightsUpdateResponse" in bad.error and "num_buckets_received" in bad.error
        empty = decode_answer(CompleteWeightsUpdateResponse, 200, b"")
        assert empty.body is None and empty.error is not None and "empty body" in empty.error
        refused = b'{"success": false, "message": "group missing", "error": {"message": "group missing"}}'
        answer = decode_answer(WeightSyncResponse, 400, refused)
        assert answer.body is not None and not answer.body.ok and answer.error == "group missing"
        assert answer.value is None  # a refusal is never a usable answer
        answer = decode_answer(ModelInfo, 401, b'{"error": {"message": "needs a key"}}')
        assert answer.body is None and answer.error == "needs a key"
        assert (
            decode_answer(ModelInfo, 502, b"<html>bad gateway</html>").error == "answered 502: <html>bad gateway</html>"
        )
        prepared = decode_answer(PrepareWeightsUpdateResponse, 200, b'{"status": "error"}').value
        assert prepared is not None and prepared.ok is False

    def test_rid_injection(self):
        ready = prepare_generate(b'{"text": "hi", "stream": true}')
        assert ready.stream and json.loads(ready.body)["rid"] == ready.rid
        assert ready.fields == {"text": "hi", "stream": True}  # as the caller sent it, for the session key
        ready = prepare_generate(b'{"input_ids": [[1, 2], [3]]}')
        assert json.loads(ready.body)["rid"] == [f"{ready.rid}-0", f"{ready.rid}-1"]
        ready = prepare_generate(b'{"input_ids": [1, 2]}')
        assert json.loads(ready.body)["rid"] == ready.rid
        assert prepare_generate(b'{"text": "x", "rid": "mine"}').rid == "mine"
        assert prepare_generate(b"not json") == (b"not json", None, False, None)
        # A body that names its rid is forwarded byte for byte.
        mine = b'{ "text" : "x","rid":"mine" }'
        assert prepare_generate(mine).body is mine
        # Injection keeps every other byte of the body; bodies it cannot splice are re-encoded whole.
        for raw in (
            b' \n{"text": "a", "sampling_params": {"max_new_tokens": 1}} ',
            b'{"rid": null, "text": "a"}',
            b"{}",
        ):
            ready = prepare_generate(raw)
            sent = json.loads(ready.body)
            assert sent.pop("rid") == ready.rid and sent == {k: v for k, v in json.loads(raw).items() if k != "rid"}
        ready = prepare_generate(b'{"text": "x"}')
        assert ready.body == b'{"rid": "' + ready.rid.encode() + b'", "text": "x"}'
        # Workers abort by prefix: no assigned rid is a prefix of another.
        rids = [prepare_generate(b'{"text": "x"}').rid for _ in range(20)]
        assert not any(a != b and b.startswith(a) for a in rids for b in rids)

    def test_request_id_injection_for_vllm_token_generation(self):
        """``/inference/v1/generate`` is aborted by the id its worker runs it as: ``generate-tokens-<id>``."""
        mine = b'{"token_ids": [1], "request_id": "mine"}'
        assert prepare_tokens_payload(mine, None) == (mine, "generate-tokens-mine", json.loads(mine))
        assert prepare_tokens_payload(mine, "hdr")[:2] == (mine, "generate-tokens-hdr")  # X-Request-Id wins, as in vLLM
        ready = prepare_tokens_payload(b'{"token_ids": [1]}', None)
        assert ready.request_id == "generate-tokens-" + json.loads(ready.body)["request_id"]
        assert ready.body.endswith(b', "token_ids": [1]}')  # spliced, the rest byte for byte
        for raw in (b'{"token_ids": [1], "request_id": ""}', b'{"request_id": null}', b"{}"):
            ready = prepare_tokens_payload(raw, None)
            request_id = ready.request_id
            sent = json.loads(ready.body)
            assert request_id is not None
            assert request_id == "generate-tokens-" + sent.pop("request_id") and len(request_id) > 20
        # Not an id: passed on as it came, for the worker's 400.
        assert prepare_tokens_payload(b'{"request_id": 5}', None)[:2] == (b'{"request_id": 5}', None)
        assert prepare_tokens_payload(b"[1]", None) == (b"[1]", None, None)
        assert prepare_tokens_payload(b"not json", None) == (b"not json", None, None)


def test_the_body_budget_is_shared_by_the_serving_processes_and_never_below_two_bodies() -> None:
    assert process_share(None, 1) == 16 * MAX_BODY_BYTES
    assert process_share(None, 2) == 8 * MAX_BODY_BYTES
    assert process_share(None, 8) == process_share(None, 16) == 2 * MAX_BODY_BYTES  # the floor
    assert process_share(1 << 20, 1) == 2 * MAX_BODY_BYTES
    assert RouterConfig(body_budget_mb=3072, generation_processes=3).body_budget_bytes() == 1024 << 20
    budget = BodyBudget(100)
    assert budget.admits(100) and not budget.admits(101) and budget.refused == 1
    assert budget.take(60) and not budget.take(41) and budget.held == 60 and budget.refused == 2
    budget.give(60)
    assert budget.held == 0 and budget.take(100)
    with pytest.raises(ValueError, match="body_budget_mb"):
        RouterConfig(body_budget_mb=0).validate()
