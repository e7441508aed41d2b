"""Byte-exact weight transfers: a trainer that broadcasts other bytes than it announced.

Three levels:

* in-process: the canary helper, the receive layouts with slack, the bucket
  ``nbytes``/``checksum`` metadata and its validation;
* real processes over gloo, no HTTP (``tests._transfer_peer``): short and long
  messages in both formats, streaming and atomic, also with four ranks, where
  gloo relays a broadcast through a receiver;
* real ``omni-worker`` processes over HTTP, driven by a hand-written trainer
  (``tests._weight_sync_trainer``): every mismatch is an error, never success;
  every worker stays up, with its weights intact or partial as the rules say, and a
  correct update on the same group succeeds next.
"""

from __future__ import annotations

import itertools
import zlib
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from router.contract.bucket_layout import BucketLayout
from router.contract.weight_sync import PrepareWeightsUpdateRequest, UpdateWeightsFromDistributedRequest
from router.dataplane import canary
from router.dataplane.buckets import bucket_checksum, pack
from router.dataplane.canary import CANARY_BYTES, RECEIVE_SLACK_BYTES, CanarySequence
from router.dataplane.formats import get_format, receive_slack
from router.dataplane.group import WeightUpdateGroup
from tests._transfer_peer import make_plan, make_tensors
from tests._weight_sync_fixtures import NUM_BUCKETS, checksum, run_trainer
from tests.procs import http_json
from tests.test_transfer_group import NUM_BUCKETS as PEER_BUCKETS
from tests.test_transfer_group import run_peers
from worker.transfer.validation import ChecksumMismatch, verify_bucket

# -- in process ------------------------------------------------------------------------------------


def posted(nbytes: int, canary_bytes: bytes) -> tuple[torch.Tensor, canary.Armed]:
    """A receive view of ``nbytes`` + slack holding stale bytes, armed with ``canary_bytes``."""
    view = torch.full((nbytes + RECEIVE_SLACK_BYTES,), 0x5A, dtype=torch.uint8)
    return view, canary.arm(view, nbytes, canary_bytes)


def land(view: torch.Tensor, count: int) -> None:
    """What a receive of a ``count``-byte message does to ``view``."""
    view[:count] = torch.arange(count, dtype=torch.int64).remainder(251).to(torch.uint8)


CANARY = CanarySequence("tests").next()


class TestCanary:
    @pytest.mark.parametrize("nbytes", [1, 5, 8, 9, 4096])
    def test_exact_message_passes(self, nbytes: int) -> None:
        view, armed = posted(nbytes, CANARY)
        land(view, nbytes)
        assert canary.check(view, armed) is None

    @pytest.mark.parametrize(("nbytes", "short_by"), [(4096, 8), (4096, 4000), (4096, 4096), (5, 5), (3, 3)])
    def test_short_message_is_fewer(self, nbytes: int, short_by: int) -> None:
        view, armed = posted(nbytes, CANARY)
        land(view, nbytes - short_by)
        assert canary.check(view, armed) == "fewer"

    @pytest.mark.parametrize(("nbytes", "long_by"), [(4096, 1), (4096, 8), (0, 100), (7, RECEIVE_SLACK_BYTES)])
    def test_long_message_within_the_slack_is_more(self, nbytes: int, long_by: int) -> None:
        view, armed = posted(nbytes, CANARY)
        land(view, nbytes + long_by)
        assert canary.check(view, armed) == "more"

    def test_short_by_less_than_the_canary_is_left_to_the_checksum(self) -> None:
        """The documented limit: a partly overwritten end canary cannot be told from data."""
        view, armed = posted(4096, CANARY)
        land(view, 4093)
        assert canary.check(view, armed) is None

    def test_sequences_agree_across_receivers_and_change_every_receive(self) -> None:
        one, other = CanarySequence("weight_update_group"), CanarySequence("weight_update_group")
        a = [one.next() for _ in range(4)]
        assert a == [other.next() for _ in range(4)]  # what a relayed buffer needs
        assert len(set(a)) == 4 and all(len(c) == 2 * CANARY_BYTES for c in a)
        assert CanarySequence("another_group").next() != a[0]

    def test_one_sequence_per_group_object(self) -> None:
        g1 = WeightUpdateGroup("g", 1, 2, "gloo", 5.0, None)
        g2 = WeightUpdateGroup("g", 1, 2, "gloo", 5.0, None)
        assert canary.sequence_for(g1) is canary.sequence_for(g1)
        assert canary.sequence_for(g1) is not canary.sequence_for(g2)  # a re-created group starts afresh

    def test_slack_on_gloo_only(self) -> None:
        assert receive_slack(WeightUpdateGroup("g", 1, 2, "gloo", 5.0, None)) == RECEIVE_SLACK_BYTES
        assert receive_slack(WeightUpdateGroup("g", 1, 2, "nccl", 5.0, None)) == 0


class TestReceiveLayouts:
    layout = BucketLayout.from_meta(
        ["a", "b", "c"], ["bfloat16", "float32", "int8"], [[3], [2], [5]], require_aligned=False
    )

    def test_per_tensor_gives_every_tensor_its_slack_and_alignment(self) -> None:
        landing = get_format("per_tensor").receive_layout(self.layout, RECEIVE_SLACK_BYTES)
        slots = landing.slots
        assert all(s.offset % s.itemsize == 0 for s in slots)
        assert all(b.offset >= a.end + RECEIVE_SLACK_BYTES for a, b in itertools.pairwise(slots))
        assert landing.total_bytes >= slots[-1].end + RECEIVE_SLACK_BYTES
        assert get_format("per_tensor").receive_layout(self.layout) == self.layout.padded()

    def test_flattened_keeps_the_packed_offsets_and_adds_one_slack(self) -> None:
        layout = BucketLayout.from_meta(["b", "a"], ["float32", "bfloat16"], [[2], [3]])
        landing = get_format("flattened_bucket").receive_layout(layout, RECEIVE_SLACK_BYTES)
        assert landing.slots == layout.slots
        assert landing.total_bytes == layout.total_bytes + RECEIVE_SLACK_BYTES


class TestBucketMetadata:
    def test_plan_metadata_carries_nbytes_and_the_crc_of_the_flattened_bytes(self) -> None:
        plan = make_plan(3)
        tensors = make_tensors(plan, seed=1)
        plain, full = plan.metadata(), plan.metadata(tensors)
        assert all(m.nbytes is None and m.checksum is None for m in plain)
        for meta, layout in zip(full, plan.buckets, strict=True):
            flat = pack([(n, tensors[n]) for n in layout.names], layout)
            assert meta.nbytes == layout.total_bytes
            assert meta.checksum == f"crc32:{zlib.crc32(flat.numpy().tobytes()):08x}"
            # The per-tensor format carries the same bytes: each tensor's, in list order.
            assert meta.checksum == bucket_checksum(tensors[n] for n in layout.names)
        # Only what was set goes on the wire: a plan without tensors sends neither field.
        assert b"nbytes" not in plan.prepare_request("g").to_json()
        assert b'"checksum":"crc32:' in plan.prepare_request("g", tensors=tensors).to_json()

    def test_nbytes_other_than_the_layout_is_refused_naming_the_bucket(self) -> None:
        plan = make_plan(3)
        tensors = make_tensors(plan, seed=1)
        name = plan.buckets[1].names[2]
        tensors[name] = torch.zeros(tensors[name].numel() + 1, dtype=tensors[name].dtype).view(-1)
        with pytest.raises(ValidationError, match=r"bucket 2: nbytes is \d+ but its names, dtypes and shapes"):
            plan.prepare_request("g", tensors=tensors)

    @pytest.mark.parametrize("bad", ["crc32:123", "crc32:DEADBEEF", "md5:0123abcd", "0123abcd"])
    def test_checksum_format(self, bad: str) -> None:
        bucket = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]], "checksum": bad}
        with pytest.raises(ValidationError, match="checksum"):
            PrepareWeightsUpdateRequest.model_validate({"num_buckets": 1, "buckets": [bucket], "group_name": "g"})
        bucket.update(checksum="crc32:0123abcd", nbytes=8)
        PrepareWeightsUpdateRequest.model_validate({"num_buckets": 1, "buckets": [bucket], "group_name": "g"})

    def test_sglang_single_phase_body_has_neither_field(self) -> None:
        assert "nbytes" not in UpdateWeightsFromDistributedRequest.model_fields
        assert "checksum" not in UpdateWeightsFromDistributedRequest.model_fields

    def test_verify_bucket(self) -> None:
        named = [("a", torch.arange(6, dtype=torch.float32)), ("b", torch.ones(3, dtype=torch.bfloat16))]
        good = bucket_checksum(t for _, t in named)
        verify_bucket(good, named)
        verify_bucket(None, named)
        named[1][1][0] = 2.0
        with pytest.raises(ChecksumMismatch, match=f"the trainer announced {good}"):
            verify_bucket(good, named)


# -- processes over gloo, no HTTP ---------------------------------------------------------------


def expect_mismatch(got: dict, sent: dict, rnd: dict, *, atomic: bool) -> None:
    """One receiver's report of a tampered round: failed, named, drained, group usable."""
    at = rnd["at"]
    verdict = "fewer" if rnd.get("short_by") else "more"
    assert got["state"] == "failed", got
    assert f"received {verdict} bytes than announced for bucket {at + 1}/{PEER_BUCKETS}" in got["error"]
    if rnd["format"] == "per_tensor":
        assert f"(tensor 'layers.{at}." in got["error"]
    assert got["buckets_received"] == PEER_BUCKETS  # the trainer's broadcasts all completed
    assert got["group_broken"] is None
    # Streaming: the buckets before the mismatch were applied, none from it on; atomic: none.
    applied = 0 if atomic else at
    assert got["digests"] == sent["digests"][:applied] + [None] * (PEER_BUCKETS - applied)


@pytest.mark.process
class TestCanariesOverGloo:
    def test_short_and_long_in_both_formats_streaming_and_atomic(self, tmp_path: Path) -> None:
        rounds = [
            {"format": "flattened_bucket", "short_by": 8, "at": 3},
            {"format": "flattened_bucket"},
            {"format": "per_tensor", "long_by": 8, "at": 0, "tensor": 2},
            {"format": "per_tensor"},
            # A message exactly filling the slack is the longest one that is still reported.
            {"format": "flattened_bucket", "long_by": RECEIVE_SLACK_BYTES, "at": PEER_BUCKETS - 1},
            # Nothing at all of the 5-byte int8 tensor arrives.
            {"format": "per_tensor", "short_by": 5, "at": 40, "tensor": 5},
            {"format": "flattened_bucket"},
        ]
        trainer, receivers = run_peers(
            tmp_path,
            world_size=3,
            timeout_s=60,
            trainer_rounds=rounds,
            receiver_rounds=[
                [{"format": r["format"]} for r in rounds],
                [{"format": r["format"], "atomic": True} for r in rounds],
            ],
        )
        assert trainer is not None and all(r["ok"] for r in trainer["rounds"]), trainer
        for atomic, rep in zip((False, True), receivers, strict=True):
            for rnd, sent, got in zip(rounds, trainer["rounds"], rep["rounds"], strict=True):
                if "short_by" in rnd or "long_by" in rnd:
                    expect_mismatch(got, sent, rnd, atomic=atomic)
                else:  # the group stayed in lockstep: the next round arrives whole
                    assert got["state"] in ("done", "staged"), got
                    assert got["digests"] == sent["digests"]
        assert "(tensor 'layers.40.w_i8')" in receivers[0]["rounds"][5]["error"]

    def test_four_ranks_where_gloo_relays_through_a_receiver(self, tmp_path: Path) -> None:
        """gloo's binomial tree has rank 1 forward its whole posted buffer to rank 3: the
        canaries must be the same on every receiver for rank 3 to judge it right."""
        rounds = [
            {"format": "flattened_bucket"},
            {"format": "per_tensor"},
            {"format": "flattened_bucket", "short_by": 100, "at": 10},
            {"format": "per_tensor", "long_by": 8, "at": 20, "tensor": 3},
            {"format": "flattened_bucket"},
        ]
        receiver_rounds = [{"format": r["format"]} for r in rounds]
        trainer, receivers = run_peers(
            tmp_path,
            world_size=4,
            timeout_s=60,
            trainer_rounds=rounds,
            receiver_rounds=[receiver_rounds] * 3,
        )
        assert trainer is not None and all(r["ok"] for r in trainer["rounds"]), trainer
        for rep in receivers:
            for rnd, sent, got in zip(rounds, trainer["rounds"], rep["rounds"], strict=True):
                if "short_by" in rnd or "long_by" in rnd:
                    expect_mismatch(got, sent, rnd, atomic=False)
                else:
                    assert got["state"] == "done", got
                    assert got["digests"] == sent["digests"]


# -- real workers over HTTP ------------------------------------------------------------------------

STREAMING_ATOMIC = [False, True]


def rounds_of(report: dict) -> list[dict[str, dict]]:
    """The trainer's steps, one dict per round (keyed by step name; ``after`` ends a round)."""
    out: list[dict[str, dict]] = []
    current: dict[str, dict] = {}
    for step in report["steps"]:
        if step["step"] in ("connect", "disconnect"):
            continue
        if step["step"].startswith("after "):
            out.append({**current, "after": step})
            current = {}
        else:
            current[step["step"]] = step
    return out


def expect_failed_round(rnd: dict[str, dict], before: list[str], *, message: str, partial: list[bool]) -> None:
    """A tampered two-phase round: every complete is an error naming what was wrong; each worker
    is up, partial as given, and where not partial its weights are exactly ``before``."""
    assert rnd["update"]["ok"] is False
    assert all(a["status"] == "ready" for _, a in rnd["prepare"]["answers"]), rnd["prepare"]
    for (status, body), was_partial in zip(rnd["complete"]["answers"], partial, strict=True):
        assert status != 200 and body["success"] is False, body
        assert message in body["message"], body
        assert bool(body["weights_partial"]) is was_partial, body
    after = rnd["after"]
    assert after["health"] == [200, 200]
    assert after["partial"] == partial
    for got, old, was_partial in zip(after["checksums"], before, partial, strict=True):
        assert (got == old) is not was_partial


def expect_ok_round(rnd: dict[str, dict], version: str) -> str:
    """A correct update on the same group: success everywhere; returns the weights' checksum."""
    assert rnd["update"]["ok"] is True, rnd["update"]
    sent = rnd["update"]["sent_checksum"]
    assert rnd["after"]["checksums"] == [sent, sent]
    assert rnd["after"]["versions"] == [version, version]
    assert rnd["after"]["partial"] == [False, False]
    return sent


class TestWorkersOverHttp:
    def test_wrong_byte_counts_fail_two_phase_updates_in_both_formats(
        self, sync_ckpts: dict[str, str], sync_workers: list[str], tmp_path: Path
    ) -> None:
        """Worker 1 streams, worker 2 is atomic. Fewer or more bytes than announced (within the
        slack) fail the update; the streaming worker is partial only when buckets before the
        wrong one were applied; a correct update on the same group follows each."""
        before = [checksum(u) for u in sync_workers]
        common = {"atomic": STREAMING_ATOMIC, "checksums": False}  # the canaries alone must catch these
        report, _ = run_trainer(
            tmp_path,
            sync_workers,
            scenario="two_phase",
            rounds=[
                {
                    **common,
                    "ckpt": sync_ckpts["c"],
                    "format": "flattened_bucket",
                    "version": "s1",
                    "short_by": 8,
                    "at": 5,
                },
                {"ckpt": sync_ckpts["c"], "format": "flattened_bucket", "version": "v1"},
                {
                    **common,
                    "ckpt": sync_ckpts["b"],
                    "format": None,
                    "version": "l1",
                    "long_by": 4096,
                    "at": 0,
                    "tensor": 1,
                },
                {**common, "ckpt": sync_ckpts["b"], "format": None, "version": "s2", "short_by": 512, "at": 40},
                {"ckpt": sync_ckpts["b"], "format": None, "version": "v2"},
                # With checksums announced too: the receive's own check answers first.
                {"ckpt": sync_ckpts["a"], "format": "flattened_bucket", "version": "l2", "long_by": 8, "at": 0},
                {"ckpt": sync_ckpts["a"], "format": "flattened_bucket", "version": "v3", "atomic": [True, False]},
            ],
        )
        s1, v1, l1, s2, v2, l2, v3 = rounds_of(report)
        fewer, more = "received fewer bytes than announced", "received more bytes than announced"
        expect_failed_round(s1, before, message=f"{fewer} for bucket 6/{NUM_BUCKETS}", partial=[True, False])
        c = expect_ok_round(v1, "v1")
        expect_failed_round(l1, [c, c], message=f"{more} for bucket 1/{NUM_BUCKETS} (tensor '", partial=[False, False])
        expect_failed_round(s2, [c, c], message=f"{fewer} for bucket 41/{NUM_BUCKETS} (tensor '", partial=[True, False])
        b = expect_ok_round(v2, "v2")
        expect_failed_round(l2, [b, b], message=f"{more} for bucket 1/{NUM_BUCKETS}", partial=[False, False])
        assert expect_ok_round(v3, "v3") == before[0] == before[1]
        for url in sync_workers:
            assert http_json("GET", url + "/health")[0] == 200

    def test_checksum_mismatch_fails_before_the_bucket_is_applied(
        self, sync_ckpts: dict[str, str], sync_workers: list[str], tmp_path: Path
    ) -> None:
        """Right sizes, wrong bytes: only the announced checksum can tell."""
        before = [checksum(u) for u in sync_workers]
        report, _ = run_trainer(
            tmp_path,
            sync_workers,
            scenario="two_phase",
            rounds=[
                {
                    "ckpt": sync_ckpts["c"],
                    "format": "flattened_bucket",
                    "version": "x1",
                    "atomic": STREAMING_ATOMIC,
                    "bad_checksum": 1,
                    "at": 7,
                },
                {"ckpt": sync_ckpts["c"], "format": "flattened_bucket", "version": "v1"},
                {
                    "ckpt": sync_ckpts["b"],
                    "format": None,
                    "version": "x2",
                    "atomic": STREAMING_ATOMIC,
                    "bad_checksum": 1,
                    "at": 0,
                },
                {"ckpt": sync_ckpts["a"], "format": None, "version": "v2"},
            ],
        )
        x1, v1, x2, v2 = rounds_of(report)
        mismatch = "not applied: checksum mismatch"
        expect_failed_round(x1, before, message=f"bucket 8/{NUM_BUCKETS} {mismatch}", partial=[True, False])
        # Atomic: caught before the staged apply, the old weights kept.
        assert "previous weights kept" in x1["complete"]["answers"][1][1]["message"]
        c = expect_ok_round(v1, "v1")
        expect_failed_round(x2, [c, c], message=f"bucket 1/{NUM_BUCKETS} {mismatch}", partial=[False, False])
        assert expect_ok_round(v2, "v2") == before[0]

    def test_single_phase_wrong_byte_count_fails_the_call_and_the_group_stays_usable(
        self, sync_ckpts: dict[str, str], sync_workers: list[str], tmp_path: Path
    ) -> None:
        """SGLang's call: a failed receive marks the worker partial (earlier calls of the sync
        applied their buckets); the next update on the same group repairs it."""
        report, _ = run_trainer(
            tmp_path,
            sync_workers,
            scenario="single_phase",
            rounds=[
                {"ckpt": sync_ckpts["c"], "format": "flattened_bucket", "version": "s1", "short_by": 64, "at": 3},
                {"ckpt": sync_ckpts["c"], "format": None, "version": "l1", "long_by": 16, "at": 0},
                {"ckpt": sync_ckpts["b"], "format": "flattened_bucket", "version": "v1", "mode": "two_phase"},
            ],
        )
        s1, l1, v1 = rounds_of(report)
        for rnd, verdict in ((s1, "fewer"), (l1, "more")):
            assert rnd["update"]["ok"] is False
            assert f"received {verdict} bytes than announced for bucket 1/1" in rnd["update"]["error"]
            assert rnd["after"]["health"] == [200, 200]
            assert rnd["after"]["partial"] == [True, True]
        expect_ok_round(v1, "v1")
