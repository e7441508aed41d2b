"""The colocated lifecycle: release without a host copy, resume, push the trainer's tensors.

slime's colocate sequence, end to end on CPU against real worker processes:
``pause_generation`` → ``release_memory_occupation`` (weights + KV, ``keep_weights: false``)
→ the trainer trains → ``resume_memory_occupation`` (weights) → ``update_weights_from_tensor``
(the JSON handle format, every tensor) → ``resume_memory_occupation`` (KV) →
``continue_generation`` → generate. Between the resume of the weights and the last update
the weights are ``partial``: the worker serves nothing, and a router keeps it pending.

Through the router, a refused call on such a worker changes nothing: no fence, no journal
entry, the worker stays pending, and the next updates bring it back into routing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from router.trainer.sender import sent_checksum
from router.trainer.tensor_handles import build_cpu_handles
from tests._router_fixtures import ADMIN_KEY, auth, generate_via, start_router, workers
from tests.procs import http_json
from worker.engine.model_worker import ModelWorker, RollbackFailed
from worker.engine.weight_state import WeightLedger, WeightState
from worker.model.checkpoint import read_checkpoint

PATH = "/update_weights_from_tensor"
PROMPT = [1, 5, 9, 3]


def _tensors(ckpt: Path) -> list[tuple[str, torch.Tensor]]:
    """The new checkpoint as a trainer holds it after its step."""
    return [(n, t.clone()) for n, t in read_checkpoint(ckpt, torch.float32)]


def _push(send: Any, named: list[tuple[str, torch.Tensor]]) -> Any:
    """Put ``named`` into shared memory and send the handle message; the segment lives until the answer."""
    body, segment = build_cpu_handles(named)
    try:
        return send(body)
    finally:
        segment.close()
        segment.unlink()


def test_slimes_colocate_sequence_without_a_host_copy(worker_factory, checkpoints) -> None:
    """release weights + KV (no host copy) → resume weights → update from tensor → resume KV → generate."""
    w = worker_factory(checkpoints["llama"])
    fresh = worker_factory(checkpoints["llama_b"])  # a fresh load of the checkpoint the trainer pushes
    w.ok("POST", "/pause_generation", {"mode": "retract"})
    released = w.ok("POST", "/release_memory_occupation", {"tags": ["weights", "kv_cache"], "keep_weights": False})
    assert sorted(released["released"]) == ["kv_cache", "weights"]
    assert w.ok("GET", "/health")["weight_state"] == "released"
    named = _tensors(checkpoints["llama_b"])  # the trainer trains meanwhile

    w.ok("POST", "/resume_memory_occupation", {"tags": ["weights"]})
    # Resumed storage holds no weights: nothing is served until every tensor has been pushed.
    assert w.ok("GET", "/health")["weight_state"] == "partial"
    assert w.info()["weights_partial"] is True
    status, body = w.post("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert status == 503 and "partial" in body["error"]["message"], body

    half = len(named) // 2
    for part, servable in ((named[:half], False), (named[half:], True)):
        answer = _push(lambda body: w.ok("POST", PATH, body), part)
        assert answer["success"] is True and answer["weights_partial"] is (not servable), answer
        assert (w.ok("GET", "/health")["weight_state"] == "serving") is servable
    w.ok("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]})
    w.ok("POST", "/continue_generation", {})

    assert w.checksum() == fresh.checksum() == sent_checksum(named)
    assert w.generate(PROMPT)["output_ids"] == fresh.generate(PROMPT)["output_ids"]


@pytest.fixture(scope="module")
def fleet(worker_fleet, checkpoints, tmp_path_factory):
    workers_ = worker_fleet(2, extra_args=["--admin-api-key", ADMIN_KEY], model=checkpoints["llama"])
    router, url = start_router(workers_.urls, admin_key=ADMIN_KEY, state_dir=tmp_path_factory.mktemp("colocate-state"))
    yield url
    router.stop()


def _call(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    return http_json("POST", url + path, body, headers=auth(), timeout=60)


def _ok(url: str, path: str, body: dict[str, Any]) -> Any:
    status, answer = _call(url, path, body)
    assert status == 200, (path, status, answer)
    return answer


def _fences(url: str) -> tuple[list[str], Any]:
    """The workers kept out of routing by a fence, and the journal's pending entry."""
    disabled = sorted(w["id"] for w in workers(url, ADMIN_KEY) if w["disabled"])
    return disabled, http_json("GET", url + "/weight_update_journal", headers=auth(), timeout=10)[1]["pending"]


def test_router_keeps_partial_workers_pending_and_a_refusal_changes_nothing(fleet, checkpoints) -> None:
    url = fleet
    _ok(url, "/pause_generation", {"mode": "retract"})
    _ok(url, "/release_memory_occupation", {"tags": ["weights", "kv_cache"], "keep_weights": False})
    _ok(url, "/resume_memory_occupation", {"tags": ["weights"]})
    # The resume is a weight change: the router read the workers' state back and holds them pending.
    fleet_now = workers(url, ADMIN_KEY)
    assert all("partial" in (w["pending"] or "") for w in fleet_now), fleet_now
    assert _fences(url) == ([], None)
    assert generate_via(url, timeout=30)[0] == 503  # nothing routable

    # Refusals on workers whose weights were partial before: each says so, and changes nothing.
    named = _tensors(checkpoints["llama_b"])
    body, segment = build_cpu_handles(named)
    try:
        bucket = body["tensor_handles"]["buckets"][0]
        gone = {**bucket, "memory": {**bucket["memory"], "name": "psm_omni_no_such_segment"}}
        tensors0 = bucket["tensors"]
        misshapen = {**bucket, "tensors": [{**tensors0[0], "shape": [3, 5]}, *tensors0[1:]]}
        refusals = [
            (PATH, {"tensor_handles": {**body["tensor_handles"], "buckets": [gone]}}),
            # Refused by the model check, before any memory is opened.
            (PATH, {"tensor_handles": {**body["tensor_handles"], "buckets": [misshapen]}}),
            ("/update_weights_from_disk", {"model_path": str(checkpoints["llama"]) + "-no-such-dir"}),
        ]
        for path, refused in refusals:
            status, answer = _call(url, path, refused)
            assert status == 400, (path, status, [r.get("body") for r in answer.get("results", [])])
            for r in answer["results"]:
                assert r["body"]["weights"] == "intact" and r["body"]["weights_partial"] is True, (path, r)
            assert _fences(url) == ([], None), path
            assert all("partial" in (w["pending"] or "") for w in workers(url, ADMIN_KEY)), path
    finally:
        segment.close()
        segment.unlink()

    half = len(named) // 2
    _push(lambda b: _ok(url, PATH, b), named[:half])
    assert all("partial" in (w["pending"] or "") for w in workers(url, ADMIN_KEY))
    assert generate_via(url, timeout=30)[0] == 503
    _push(lambda b: _ok(url, PATH, b), named[half:])
    assert [(w["disabled"], w["pending"], w["weight_state"]) for w in workers(url, ADMIN_KEY)] == [
        (False, None, "serving")
    ] * 2
    _ok(url, "/resume_memory_occupation", {"tags": ["kv_cache"]})
    _ok(url, "/continue_generation", {})
    checks = _ok(url, "/weights_checker", {"action": "checksum"})
    assert checks["identical"] is True
    assert {c for per in checks["rank_checksums"].values() for c in per} == {sent_checksum(named)}
    assert generate_via(url)[0] == 200


def test_ledger_release_without_a_copy_is_partial_until_every_tensor_is_rewritten() -> None:
    ledger = WeightLedger(["a", "b"])
    ledger.released(discarded=True)
    assert ledger.state is WeightState.RELEASED and ledger.mixed
    ledger.resumed()
    assert ledger.state is WeightState.PARTIAL
    # An update that wrote nothing did not touch the weights: partial before, partial after, "intact".
    assert ledger.writing_failed() == "intact" and ledger.state is WeightState.PARTIAL
    assert ledger.committed(["a"]) == "partial" and not ledger.servable
    assert ledger.committed(["b"]) == "updated" and ledger.servable
    # With a copy, resume goes back to the state the weights were released from.
    ledger.released()
    assert not ledger.mixed
    ledger.resumed()
    assert ledger.servable


def test_a_failed_write_on_partial_weights_takes_no_backup_and_resets_the_rewrite(checkpoints) -> None:
    """Partial weights are written without a backup copy (nothing worth restoring); if the write
    fails, every tensor must be rewritten again before the worker serves."""
    import torch

    from worker.engine.weight_state import WeightState

    mw = ModelWorker(str(checkpoints["llama"]))
    named = _tensors(checkpoints["llama_b"])
    mw.ledger.released(discarded=True)
    mw.ledger.resumed()
    mw.apply_atomic(named[:1])
    assert mw.ledger.committed([named[0][0]]) == "partial"
    bad = [(named[1][0], torch.zeros(3, 5))]
    with pytest.raises(RollbackFailed, match="every tensor must be rewritten"):
        mw.apply_atomic(bad)
    assert mw.ledger.state is WeightState.PARTIAL
    # The first tensor's rewrite no longer counts: all but it is not enough.
    assert mw.ledger.committed([n for n, _ in named[1:]]) == "partial"
    assert mw.ledger.committed([n for n, _ in named]) == "updated"
