"""/generate on a real worker: greedy determinism, batches, streaming, logprobs,
stop conditions, continuous batching and client disconnects."""

from __future__ import annotations

import itertools
import math
import subprocess

import pytest

from router.contract.admin import ModelInfo
from router.contract.generate import GenerateResponse
from tests._worker_helpers import open_raw_request, result, sse_events
from tests.procs import cli
from worker.model import load_tokenizer

STEP_DELAY_MS = "5"  # long enough for concurrent requests to share steps


@pytest.fixture(scope="module")
def gw(worker_factory, checkpoints):
    return worker_factory(checkpoints["llama"], "--step-delay-ms", STEP_DELAY_MS)


def test_ready_line_is_logged_once(gw):
    assert gw.proc.log_text(20000).count(f"omni-worker ready on {gw.url}") == 1


def test_greedy_is_deterministic_and_text_decodes_output_ids(gw, checkpoints):
    first = gw.generate("The policy says:", 24)
    second = gw.generate("The policy says:", 24)
    GenerateResponse.model_validate(first)
    assert first["output_ids"] == second["output_ids"]
    assert len(first["output_ids"]) == 24
    assert first["text"] == load_tokenizer(checkpoints["llama"]).decode(first["output_ids"])
    meta = first["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 24}
    assert meta["prompt_tokens"] == len(b"The policy says:")
    assert meta["completion_tokens"] == 24
    assert meta["cached_tokens"] == 0
    assert meta["weight_version"] == "default"
    assert meta["e2e_latency"] > 0
    assert first["meta_info"]["id"] != second["meta_info"]["id"]


def test_input_ids_equal_text_and_batch_matches_singles(gw):
    single = gw.generate("abc", 12)
    by_ids = gw.generate(list(b"abc"), 12)
    assert by_ids["output_ids"] == single["output_ids"]
    other = gw.generate("xyz!", 12)
    batch = gw.ok(
        "POST",
        "/generate",
        {
            "text": ["abc", "xyz!"],
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
            "rid": ["b-1", "b-2"],
        },
    )
    assert isinstance(batch, list) and len(batch) == 2
    assert [b["output_ids"] for b in batch] == [single["output_ids"], other["output_ids"]]
    assert [b["meta_info"]["id"] for b in batch] == ["b-1", "b-2"]
    ids_batch = gw.ok(
        "POST",
        "/generate",
        {
            "input_ids": [list(b"abc"), list(b"xyz!")],
            "sampling_params": [
                {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
                {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
            ],
        },
    )
    assert ids_batch[0]["output_ids"] == single["output_ids"]
    assert ids_batch[1]["output_ids"] == other["output_ids"][:3]


def test_streaming_is_cumulative_and_ends_with_done(gw):
    reference = gw.generate("stream me", 20)
    events = sse_events(
        gw.url + "/generate",
        {
            "text": "stream me",
            "stream": True,
            "sampling_params": {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True},
        },
    )
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths)
    for earlier, later in itertools.pairwise(chunks):
        assert later["output_ids"][: len(earlier["output_ids"])] == earlier["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["output_ids"] == reference["output_ids"]
    assert chunks[-1]["text"] == reference["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 20}


def test_streaming_batch_carries_index(gw):
    events = sse_events(
        gw.url + "/generate",
        {
            "text": ["a", "b"],
            "stream": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
        },
    )
    assert events[-1] == "[DONE]"
    finals = {c["index"]: c for c in events[:-1] if c["meta_info"]["finish_reason"]}
    assert set(finals) == {0, 1}
    assert finals[0]["output_ids"] == gw.generate("a", 5)["output_ids"]


def test_logprobs_are_triples_and_greedy_picks_the_best(gw):
    out = gw.generate("logprobs", 8, return_logprob=True, top_logprobs_num=3)
    meta = out["meta_info"]
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == out["output_ids"]
    assert all(t[2] is None and t[0] <= 0.0 and math.isfinite(t[0]) for t in triples)
    assert meta["input_token_logprobs"] == []
    for (lp, tok, _), top in zip(triples, meta["output_top_logprobs"], strict=True):
        assert len(top) == 3 and top[0][1] == tok and top[0][0] == pytest.approx(lp)


def test_seeded_sampling_is_reproducible(gw):
    sampling = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 1234}
    a = gw.generate("sample", 16, sampling=sampling)
    b = gw.generate("sample", 16, sampling=sampling)
    c = gw.generate("sample", 16, sampling={**sampling, "seed": 99})
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] != c["output_ids"]


def test_stop_token_and_stop_string(gw):
    base = gw.generate("stops", 16)["output_ids"]
    stop_at = base[5]
    first = base.index(stop_at)
    out = gw.generate("stops", 16, sampling={"stop_token_ids": [stop_at]})
    assert out["output_ids"] == base[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}

    # A stop string made of a printable byte of the greedy output.
    printable = next((t for t in base[1:] if 32 <= t < 127), None)
    if printable is not None:
        stop = chr(printable)
        out = gw.generate("stops", 16, sampling={"stop": [stop]})
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert stop not in out["text"]


def test_concurrent_requests_are_batched(gw, pool):
    before = gw.state()["max_batch_size_seen"]
    futures = [pool.submit(gw.generate, f"prompt {i}", 24) for i in range(6)]
    outs = [result(f) for f in futures]
    assert all(o["meta_info"]["completion_tokens"] == 24 for o in outs)
    assert gw.state()["max_batch_size_seen"] >= max(before, 2)
    # Batching does not change a greedy result.
    assert outs[3]["output_ids"] == gw.generate("prompt 3", 24)["output_ids"]


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_its_request(gw, stream):
    aborted_before = gw.state()["aborted_requests"]
    body = {
        "text": "going away",
        "stream": stream,
        "sampling_params": {"max_new_tokens": 800, "ignore_eos": True, "temperature": 0},
    }
    sock = open_raw_request(gw.url, "/generate", body)
    try:
        gw.wait_running(1, min_steps=2)
    finally:
        sock.close()
    state = gw.wait_state(lambda s: s["num_running_reqs"] == 0, what="the disconnected request to end")
    assert state["aborted_requests"] == aborted_before + 1


def test_context_limits_are_400(gw):
    status, body = gw.post("/generate", {"input_ids": [1] * 1024, "sampling_params": {"max_new_tokens": 1}})
    assert status == 400 and "context length" in body["error"]["message"]
    status, body = gw.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 5000}})
    assert status == 400 and "maximum context length" in body["error"]["message"]
    status, body = gw.post("/generate", {"input_ids": [1, 99999]})
    assert status == 400 and "vocabulary" in body["error"]["message"]


def test_qwen2_bfloat16_worker_on_a_cli_made_checkpoint(worker_factory, tmp_path):
    out_dir = tmp_path / "qwen2-cli"
    made = subprocess.run(
        [cli("omni-worker"), "make-tiny", str(out_dir), "--arch", "qwen2", "--seed", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    assert (out_dir / "config.json").is_file() and (out_dir / "model.safetensors").is_file()
    qw = worker_factory(out_dir, "--dtype", "bfloat16")
    out = qw.generate("qwen", 10)
    assert out["output_ids"] == qw.generate("qwen", 10)["output_ids"]
    info = ModelInfo.model_validate(qw.info())
    assert info.architectures == ["Qwen2ForCausalLM"] and info.dtype == "bfloat16"
    checker = qw.ok("POST", "/weights_checker", {"action": "checksum"})
    assert {m["dtype"] for m in checker["tensor_metadata"].values()} == {"bfloat16"}
