"""The flattened-bucket layout, the weight-sync wire models and the bucket planner (in-process)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError

from router.contract.bucket_layout import BucketLayout, LayoutError, aligned_order
from router.contract.weight_sync import (
    CompleteWeightsUpdateRequest,
    InitWeightsUpdateGroupRequest,
    PrepareWeightsUpdateRequest,
    PrepareWeightsUpdateResponse,
    UpdateWeightsFromDistributedRequest,
)
from router.dataplane.buckets import layout_of, pack, unpack
from router.trainer.sender import BucketPlan


class TestBucketLayout:
    def test_offsets_are_back_to_back_in_list_order(self) -> None:
        layout = BucketLayout.from_meta(["a", "b", "c"], ["float32", "torch.bfloat16", "int8"], [[2, 3], [4], [5]])
        assert [s.offset for s in layout.slots] == [0, 24, 32]
        assert layout.total_bytes == 37
        assert layout.dtypes == ["float32", "bfloat16", "int8"]

    def test_unaligned_offset_is_rejected_before_any_receive(self) -> None:
        with pytest.raises(LayoutError, match=r"unaligned tensor 'b'.*byte offset 6.*float32"):
            BucketLayout.from_meta(["a", "b"], ["bfloat16", "float32"], [[3], [2]])
        # The same tensors are fine when the check is not required (per-tensor format).
        assert (
            BucketLayout.from_meta(["a", "b"], ["bfloat16", "float32"], [[3], [2]], require_aligned=False).total_bytes
            == 14
        )

    def test_aligned_order_makes_any_mix_aligned(self) -> None:
        dtypes = ["int8", "bfloat16", "float64", "bool", "float32", "float16", "int64", "float8_e4m3fn"]
        shapes = [[3], [5], [1], [1], [3], [1], [1], [7]]
        order = aligned_order(dtypes)
        layout = BucketLayout.from_meta(
            [f"t{i}" for i in order], [dtypes[i] for i in order], [shapes[i] for i in order]
        )
        assert all(slot.aligned for slot in layout.slots)

    @pytest.mark.parametrize(
        ("names", "dtypes", "shapes", "message"),
        [
            (["a", "b"], ["float32"], [[1], [1]], "equal lengths, got 2, 1 and 2"),
            (["a"], ["complex64"], [[1]], "unsupported dtype 'complex64'"),
            (["a"], ["float32"], [[-1]], "negative dimension"),
            (["a", "a"], ["float32", "float32"], [[1], [1]], "appears twice"),
        ],
    )
    def test_bad_metadata(self, names: list, dtypes: list, shapes: list, message: str) -> None:
        with pytest.raises(LayoutError, match=message):
            BucketLayout.from_meta(names, dtypes, shapes)

    @pytest.mark.process
    def test_protocol_does_not_import_torch(self) -> None:
        code = (
            "import sys, router.contract.weight_sync, router.contract.bucket_layout; assert 'torch' not in sys.modules"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


class TestWireModels:
    def test_update_from_distributed_defaults_follow_sglang(self) -> None:
        req = UpdateWeightsFromDistributedRequest.model_validate(
            {"names": ["w"], "dtypes": ["torch.bfloat16"], "shapes": [[2]], "weight_version": 3, "selector": "all"}
        )
        assert (req.group_name, req.flush_cache, req.abort_all_requests, req.load_format) == (
            "weight_update_group",
            True,
            False,
            None,
        )
        assert req.dtypes == ["bfloat16"] and req.weight_version == "3"

    def test_length_mismatch_is_a_validation_error(self) -> None:
        with pytest.raises(ValidationError, match="equal lengths"):
            UpdateWeightsFromDistributedRequest.model_validate(
                {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1]]}
            )

    def test_flattened_unaligned_is_a_validation_error(self) -> None:
        body = {
            "names": ["a", "b"],
            "dtypes": ["int8", "float32"],
            "shapes": [[1], [1]],
            "load_format": "flattened_bucket",
        }
        with pytest.raises(ValidationError, match="unaligned"):
            UpdateWeightsFromDistributedRequest.model_validate(body)
        body["load_format"] = None
        UpdateWeightsFromDistributedRequest.model_validate(body)  # per tensor: no layout, no alignment rule

    def test_unknown_load_format_rejected(self) -> None:
        with pytest.raises(ValidationError):
            UpdateWeightsFromDistributedRequest.model_validate(
                {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "load_format": "direct"}
            )

    def test_prepare_seed_fields_and_checks(self) -> None:
        bucket = {"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[4, 4]]}
        req = PrepareWeightsUpdateRequest.model_validate(
            {"num_buckets": 1, "buckets": [bucket], "group_name": "weight_sync_group"}
        )
        assert (req.atomic, req.load_format, req.timeout_s) == (False, None, None)
        with pytest.raises(ValidationError, match="num_buckets is 2 but 1"):
            PrepareWeightsUpdateRequest.model_validate({"num_buckets": 2, "buckets": [bucket], "group_name": "g"})
        with pytest.raises(ValidationError, match="group_name"):
            PrepareWeightsUpdateRequest.model_validate({"num_buckets": 1, "buckets": [bucket]})
        with pytest.raises(ValidationError, match="bucket 1 and bucket 2"):
            PrepareWeightsUpdateRequest.model_validate(
                {"num_buckets": 2, "buckets": [bucket, bucket], "group_name": "g"}
            )

    def test_complete_and_response_defaults(self) -> None:
        req = CompleteWeightsUpdateRequest.model_validate({"group_name": "g"})
        assert (req.flush_cache, req.return_checksum) == (False, False)
        assert PrepareWeightsUpdateResponse(status="ready").model_dump() == {
            "status": "ready",
            "message": "",
            "weights": None,
            "weights_partial": None,
            "rank_results": None,
        }

    @pytest.mark.parametrize(
        "patch",
        [
            {"rank_offset": 0},
            {"rank_offset": 2, "world_size": 2},
            {"master_port": 0},
            {"backend": "mpi"},
            {"timeout_s": -1},
        ],
    )
    def test_init_group_rejects(self, patch: dict) -> None:
        body = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2, **patch}
        with pytest.raises(ValidationError):
            InitWeightsUpdateGroupRequest.model_validate(body)


class TestFlatBucketAndPlan:
    def test_pack_unpack_round_trip_zero_copy(self) -> None:
        named = [
            ("f", torch.randn(3, 5)),
            ("h", torch.randn(7).to(torch.bfloat16)),
            ("i", torch.arange(3, dtype=torch.int8)),
        ]
        layout = layout_of(named)
        buffer = pack(named, layout)
        views = unpack(buffer, layout)
        for (name, want), (got_name, got) in zip(named, views, strict=True):
            assert got_name == name and got.dtype == want.dtype and torch.equal(got, want)
            assert got.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # a view, not a copy

    def test_pack_refuses_a_tensor_that_does_not_match_the_plan(self) -> None:
        layout = layout_of([("f", torch.zeros(2))])
        with pytest.raises(LayoutError, match="does not match"):
            pack([("f", torch.zeros(3))], layout)

    def test_plan_respects_budget_order_and_alignment(self) -> None:
        named = [
            (f"t{i}", torch.zeros(i + 1, dtype=[torch.int8, torch.bfloat16, torch.float32][i % 3])) for i in range(30)
        ]
        plan = BucketPlan.from_named_tensors(named, budget_bytes=64)
        assert plan.num_tensors == 30 and plan.total_bytes == sum(t.numel() * t.element_size() for _, t in named)
        assert all(b.total_bytes <= 64 or len(b) == 1 for b in plan.buckets)
        # Buckets partition the tensors in order; only the order inside a bucket changes.
        flat = [n for b in plan.buckets for n in sorted(b.names, key=lambda n: int(n[1:]))]
        assert flat == [n for n, _ in named]
        assert all(slot.aligned for b in plan.buckets for slot in b.slots)
        req = plan.prepare_request("g", load_format="flattened_bucket", atomic=True)
        again = PrepareWeightsUpdateRequest.model_validate_json(req.to_json())
        assert [b.layout for b in again.buckets] == list(plan.buckets)
