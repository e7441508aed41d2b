"""Pause modes with requests in flight, continue, abort by rid, and flush_cache.

The worker sleeps after every step (``--step-delay-ms``) so requests stay in
flight long enough to be paused; every wait is a bounded poll of /server_info.
"""

from __future__ import annotations

import pytest

from tests._worker_helpers import result

N_TOKENS = 40


@pytest.fixture(scope="module")
def pw(worker_factory, checkpoints):
    return worker_factory(checkpoints["llama"], "--step-delay-ms", "20")


@pytest.fixture(autouse=True)
def _unpaused(pw):
    yield
    pw.post("/continue_generation", {})


def _start(pw, pool, prompts, n=N_TOKENS, **fields):
    return [pool.submit(pw.generate, p, n, **fields) for p in prompts]


def test_abort_mode_returns_partial_outputs_and_new_requests_wait(pw, pool):
    futures = _start(pw, pool, ["a1", "a2", "a3"], 400)
    pw.wait_running(3)
    body = pw.ok("POST", "/pause_generation", {"mode": "abort"})
    assert body["status"] == "ok" and body["num_aborted"] == 3
    assert [r["success"] for r in body["rank_results"]] == [True]
    outs = [result(f) for f in futures]
    for out in outs:
        meta = out["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert 0 < meta["completion_tokens"] < 400
        assert len(out["output_ids"]) == meta["completion_tokens"]
    info = pw.info()
    assert info["is_paused"] is True and info["pause_mode"] == "abort"

    late = pool.submit(pw.generate, "late", 5)
    pw.wait_state(lambda s: s["num_waiting_reqs"] == 1, what="the late request to queue")
    assert not late.done()
    pw.ok("POST", "/continue_generation", {"torch_empty_cache": True})
    assert result(late)["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


def test_retract_recomputes_and_matches_uninterrupted_run(pw, pool):
    reference = [pw.generate(p, N_TOKENS)["output_ids"] for p in ("r1", "r2")]
    futures = _start(pw, pool, ["r1", "r2"])
    pw.wait_running(2, min_steps=5)
    body = pw.ok("POST", "/pause_generation", {"mode": "retract"})
    assert body["num_retracted"] == 2
    state = pw.state()
    assert state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 2
    assert pw.info()["pause_mode"] == "retract"
    # Retracted requests hold no KV: a flush is allowed (SGLang v0.5.15 refused it).
    assert pw.ok("POST", "/flush_cache")["success"] is True
    assert not any(f.done() for f in futures)
    pw.ok("POST", "/continue_generation", {})
    outs = [result(f) for f in futures]
    assert [o["output_ids"] for o in outs] == reference
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    assert all(o["meta_info"]["total_retractions"] == 1 for o in outs)


def test_in_place_freezes_with_kv_and_refuses_flush(pw, pool, checkpoints):
    reference = pw.generate("p1", N_TOKENS)["output_ids"]
    futures = _start(pw, pool, ["p1"])
    pw.wait_running(1)
    pw.ok("POST", "/pause_generation", {"mode": "in_place"})
    steps = pw.state()["steps"]
    state = pw.state()
    assert state["num_running_reqs"] == 1 and state["is_paused"]

    status, body = pw.post("/flush_cache")
    assert status == 400 and "active request" in body["error"]["message"]
    assert body["success"] is False and body["weights"] == "intact"  # the shape of every admin refusal
    status, body = pw.call("GET", "/flush_cache")
    assert status == 400
    status, body = pw.post("/update_weights_from_disk", {"model_path": str(checkpoints["llama"])})
    assert status == 400 and body["success"] is False and "active request" in body["message"]
    status, body = pw.post("/release_memory_occupation", {})
    assert status == 400

    assert pw.state()["steps"] == steps  # frozen: nothing stepped meanwhile
    assert not futures[0].done()
    pw.ok("POST", "/continue_generation", {})
    out = result(futures[0])
    assert out["output_ids"] == reference
    assert out["meta_info"]["total_retractions"] == 0


def test_unknown_pause_mode_is_400_and_changes_nothing(pw):
    status, body = pw.post("/pause_generation", {"mode": "freeze"})
    assert status == 400 and "mode" in body["error"]["message"]
    assert pw.info()["is_paused"] is False


def test_abort_request_by_rid_prefix(pw, pool):
    rids = ["grpA-1", "grpA-2", "grpB-1"]
    futures = {rid: pool.submit(pw.generate, rid, 60, rid=rid) for rid in rids}
    pw.wait_running(3)
    body = pw.ok("POST", "/abort_request", {"rid": "grpA"})
    assert sorted(body["aborted_rids"]) == ["grpA-1", "grpA-2"]
    outs = {rid: result(f) for rid, f in futures.items()}
    assert outs["grpA-1"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert outs["grpA-2"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert outs["grpB-1"]["meta_info"]["finish_reason"] == {"type": "length", "length": 60}
    # Unknown rids and an empty rid abort nothing and are not errors.
    assert pw.ok("POST", "/abort_request", {"rid": "nope"})["num_aborted"] == 0
    assert pw.ok("POST", "/abort_request", {})["num_aborted"] == 0


def test_abort_all_and_duplicate_rid(pw, pool):
    futures = [pool.submit(pw.generate, f"x{i}", 300, rid=f"dup-{i}") for i in range(2)]
    pw.wait_running(2)
    status, body = pw.post("/generate", {"text": "again", "rid": "dup-0"})
    assert status == 400 and "already in flight" in body["error"]["message"]
    assert pw.ok("POST", "/abort_request", {"abort_all": True})["num_aborted"] == 2
    assert all(result(f)["meta_info"]["finish_reason"]["type"] == "abort" for f in futures)


def test_flush_when_idle_and_health_while_paused(pw):
    assert pw.ok("GET", "/flush_cache")["success"] is True
    pw.ok("POST", "/pause_generation", {"mode": "in_place"})
    assert pw.ok("GET", "/health")["is_paused"] is True
    body = pw.ok("GET", "/health_generate")
    assert "paused" in body["message"]
    pw.ok("POST", "/continue_generation", {})
    assert pw.ok("GET", "/health_generate")["message"] == "ok"
