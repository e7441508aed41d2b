"""vLLM's token routes and ``/abort_requests``, on a worker and through a router (real processes, real HTTP).

``/inference/v1/generate`` (what SkyRL's ``RemoteInferenceClient`` and TRL post) answers vLLM's
``GenerateResponse``: greedy ``token_ids`` equal ``/generate``'s ``output_ids`` for the same ids, logprobs
as ``token_id:<id>`` entries equal ``/generate``'s, ``max_tokens`` left out means what the context
leaves (not 16), ``n`` choices with seeds, streaming; ``/tokenize`` and ``/detokenize`` answer vLLM's
shapes (the chat form equals the chat route's prompt ids); ``/abort_requests`` ends requests by the id
their answers carry, or all of them, summed over the fleet by the router. Every bad input is a 400
with ``error.message`` that changes nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from router.contract.vllm_tokens import TokenizeResponse, TokensGenerateResponse
from tests._router_fixtures import ADMIN_KEY, auth, running_fleet, wait_for, workers
from tests._tiers import process_fixture
from tests._worker_helpers import open_raw_request, sse_events
from tests.procs import http_json

SLOW = ["--step-delay-ms", "20", "--num-threads", "1"]
PROMPT = [1, 2, 3, 4, 5, 6]
GEN = "/inference/v1/generate"
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


@process_fixture(scope="module")
def fleet(chat_checkpoint: Path) -> Iterator[tuple[list[str], str]]:
    with running_fleet(chat_checkpoint, 2, worker_args=SLOW, admin_key=ADMIN_KEY) as fleet:
        yield fleet


def _greedy(worker: str, tokens: int, prompt: list[int] = PROMPT, **sampling: Any) -> dict[str, Any]:
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": tokens, "temperature": 0, **sampling},
    }
    status, out = http_json("POST", worker + "/generate", body)
    assert status == 200, out
    return out


def _tokens(base: str, sampling: dict[str, Any], **fields: Any) -> dict[str, Any]:
    headers = fields.pop("headers", None)
    status, out = http_json(
        "POST", base + GEN, {"token_ids": PROMPT, "sampling_params": sampling, **fields}, headers=headers
    )
    assert status == 200, out
    TokensGenerateResponse.model_validate(out)
    return out


def _idle(worker: str) -> bool:
    return http_json("GET", worker + "/server_info")[1]["internal_states"][0]["num_running_reqs"] == 0


def test_greedy_tokens_equal_generate_on_a_worker_and_through_the_router(fleet: tuple[list[str], str]) -> None:
    (worker, _), router = fleet
    expected = _greedy(worker, 8, ignore_eos=True)
    logprobs = [lp for lp, _, _ in expected["meta_info"]["output_token_logprobs"]]
    for base in (worker, router):
        sampling = {"temperature": 0, "max_tokens": 8, "ignore_eos": True, "logprobs": 0}
        out = _tokens(base, sampling, return_token_ids=True, model="ignored")
        assert out["request_id"].startswith("generate-tokens-") and out["model"] and out["created"] > 0
        (choice,) = out["choices"]
        assert choice["token_ids"] == expected["output_ids"], (base, choice, expected)
        assert choice["finish_reason"] == "length" and choice["index"] == 0
        content = choice["logprobs"]["content"]
        assert [c["token"] for c in content] == [f"token_id:{t}" for t in expected["output_ids"]]
        assert [c["logprob"] for c in content] == pytest.approx(logprobs, abs=1e-5)
        # vLLM lists max(k, 1) top entries per token, the sampled one first.
        assert all(c["top_logprobs"] == [{k: c[k] for k in ("token", "logprob", "bytes")}] for c in content)
        assert out["usage"] == {
            "prompt_tokens": 6,
            "completion_tokens": 8,
            "total_tokens": 14,
            "prompt_tokens_details": None,
        }
        assert out["prompt_token_ids"] == PROMPT and out["prompt_logprobs"] is None
        assert out["weight_version"] == "default"
        # Top-k: k entries, the sampled token first, then the most likely others.
        top = _tokens(base, {**sampling, "max_tokens": 2, "logprobs": 3})["choices"][0]["logprobs"]["content"]
        assert all(len(c["top_logprobs"]) == 3 and c["top_logprobs"][0]["token"] == c["token"] for c in top)
        # Without logprobs: null, and no prompt ids unless asked.
        plain = _tokens(base, {"temperature": 0, "max_tokens": 8, "ignore_eos": True})
        assert plain["choices"][0]["logprobs"] is None and plain["prompt_token_ids"] is None
        assert plain["choices"][0]["token_ids"] == expected["output_ids"]
        # vLLM's request id: X-Request-Id wins over the body's request_id.
        named = _tokens(base, {"max_tokens": 1}, request_id="mine")
        assert named["request_id"] == "generate-tokens-mine"
        header = _tokens(base, {"max_tokens": 1}, request_id="mine", headers={"X-Request-Id": "hdr-1"})
        assert header["request_id"] == "generate-tokens-hdr-1"


def test_max_tokens_left_out_is_what_the_context_leaves(fleet: tuple[list[str], str]) -> None:
    (worker, _), router = fleet
    expected = _greedy(worker, 1000)  # greedy until the checkpoint's EOS
    assert expected["meta_info"]["finish_reason"]["type"] == "stop" and len(expected["output_ids"]) > 16
    for base in (worker, router):
        (choice,) = _tokens(base, {"temperature": 0})["choices"]
        assert choice["token_ids"] == expected["output_ids"] and choice["finish_reason"] == "stop"


def test_n_choices_with_a_seed_and_streaming(fleet: tuple[list[str], str]) -> None:
    (worker, _), router = fleet
    sampling = {"temperature": 1.0, "max_tokens": 6, "ignore_eos": True, "n": 3, "seed": 11}
    first = _tokens(router, sampling)
    again = _tokens(worker, sampling)
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in first["choices"]] == [c["token_ids"] for c in again["choices"]]
    assert len({tuple(c["token_ids"]) for c in first["choices"]}) > 1  # seed, seed+1, seed+2
    assert first["usage"]["completion_tokens"] == 18

    for base in (worker, router):
        body = {
            "token_ids": PROMPT,
            "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
            "sampling_params": {**sampling, "logprobs": 1},
        }
        events = sse_events(base + GEN, body)
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if e["choices"]]
        assert chunks[0]["prompt_token_ids"] == PROMPT and all("prompt_token_ids" not in c for c in chunks[1:])
        streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
        finishes = {}
        for chunk in chunks:
            (choice,) = chunk["choices"]
            assert chunk["request_id"] == chunks[0]["request_id"] and chunk["usage"] is None
            streamed[choice["index"]] += choice["token_ids"]
            assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
            if choice["finish_reason"] is not None:
                finishes[choice["index"]] = choice["finish_reason"]
        assert streamed == {c["index"]: c["token_ids"] for c in first["choices"]}
        assert finishes == {0: "length", 1: "length", 2: "length"}
        usage = events[-2]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 18


BAD: list[tuple[Any, str]] = [
    ({"token_ids": PROMPT}, "sampling_params"),
    ({"token_ids": [], "sampling_params": {}}, "token_ids"),
    ({"token_ids": [1, -2], "sampling_params": {}}, "token_ids"),
    ({"token_ids": "1 2", "sampling_params": {}}, "token_ids"),
    ({"token_ids": [1, 10**6], "sampling_params": {}}, "outside the vocabulary"),
    ({"token_ids": PROMPT, "sampling_params": {}, "features": {"mm_hashes": {}, "mm_placeholders": {}}}, "multimodal"),
    ({"token_ids": PROMPT, "sampling_params": {}, "content_parts": [{"type": "image_url"}]}, "multimodal"),
    ({"token_ids": PROMPT, "sampling_params": {"prompt_logprobs": 1}}, "prompt_logprobs"),
    ({"token_ids": PROMPT, "sampling_params": {"presence_penalty": 0.5}}, "presence_penalty"),
    ({"token_ids": PROMPT, "sampling_params": {"logit_bias": {"3": 1.0}}}, "logit_bias"),
    ({"token_ids": PROMPT, "sampling_params": {"logprobs": 21}}, "logprobs"),
    ({"token_ids": PROMPT, "sampling_params": {"max_tokens": 0}}, "max_tokens"),
    ({"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "min_tokens": 3}}, "min_tokens"),
    ({"token_ids": PROMPT, "sampling_params": {"temperature": 2.5}}, "temperature"),
    ({"token_ids": PROMPT, "sampling_params": {"top_p": 0}}, "top_p"),
    ({"token_ids": PROMPT, "sampling_params": {"stop": [""]}}, "stop"),
    ({"token_ids": PROMPT, "sampling_params": {"stop": "x", "detokenize": False}}, "detokenize"),
    ({"token_ids": PROMPT, "sampling_params": {"n": 0}}, "n"),
    ({"token_ids": PROMPT, "sampling_params": {"max_tokens": 2000}}, "context length"),
    ({"token_ids": PROMPT, "sampling_params": {}, "priority": 1}, "priority"),
    ({"token_ids": PROMPT, "sampling_params": {}, "stream": "maybe"}, "stream"),
    ({"token_ids": PROMPT, "sampling_params": {}, "cache_salt": ""}, "cache_salt"),
    ([PROMPT], "JSON object"),
]


def test_bad_generate_bodies_are_400s_that_change_nothing(fleet: tuple[list[str], str]) -> None:
    (worker, _), router = fleet
    before = [w["disabled"] for w in workers(router, ADMIN_KEY)]
    for base in (worker, router):
        for body, word in BAD:
            status, answer = http_json("POST", base + GEN, body)
            assert status == 400, (base, body, answer)
            assert word in answer["error"]["message"], (body, answer)
        status, answer = http_json("POST", base + GEN, raw=b"{not json")
        assert status == 400 and "JSON" in answer["error"]["message"]
    assert _idle(worker) and [w["disabled"] for w in workers(router, ADMIN_KEY)] == before
    # Lax types, as vLLM's pydantic models take them: numeric strings and integral floats.
    lax = _tokens(router, {"temperature": "0", "max_tokens": 3.0, "ignore_eos": "true", "seed": "-1"})
    assert lax["choices"][0]["token_ids"] == _greedy(worker, 3, ignore_eos=True)["output_ids"]


def test_tokenize_and_detokenize(fleet: tuple[list[str], str]) -> None:
    (worker, _), router = fleet
    chat = {"model": "m", "messages": MESSAGES, "max_tokens": 1, "temperature": 0, "return_token_ids": True}
    status, answer = http_json("POST", worker + "/v1/chat/completions", chat)
    assert status == 200, answer
    chat_ids = answer["prompt_token_ids"]
    for base in (worker, router):
        status, out = http_json(
            "POST", base + "/tokenize", {"model": "m", "prompt": "hello", "add_special_tokens": True}
        )
        assert status == 200, out
        TokenizeResponse.model_validate(out)
        assert out["tokens"] == list(b"hello") and out["count"] == 5 and out["token_strs"] is None
        assert out["max_model_len"] == http_json("GET", worker + "/model_info")[1]["context_length"]
        strs = http_json("POST", base + "/tokenize", {"prompt": "hi", "return_token_strs": True})[1]
        assert strs["token_strs"] == ["h", "i"]
        # vLLM's chat form: the checkpoint's template, as the chat route renders it.
        status, out = http_json("POST", base + "/tokenize", {"messages": MESSAGES})
        assert status == 200 and out["tokens"] == chat_ids and out["count"] == len(chat_ids), out
        status, out = http_json("POST", base + "/detokenize", {"model": "m", "tokens": list(b"hello")})
        assert status == 200 and out == {"prompt": "hello"}
        for path, body, word in [
            ("/tokenize", {}, "prompt"),
            ("/tokenize", {"prompt": 5}, "prompt"),
            ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "exactly one"),
            ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
            ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ 1 }}"}, "chat_template"),
            ("/tokenize", {"prompt": "a", "add_special_tokens": "maybe"}, "add_special_tokens"),
            ("/detokenize", {}, "tokens"),
            ("/detokenize", {"tokens": [-1]}, "tokens"),
            ("/detokenize", {"tokens": [10**6]}, "outside the vocabulary"),
        ]:
            status, answer = http_json("POST", base + path, body)
            assert status == 400 and word in answer["error"]["message"], (base, path, body, answer)


def _in_flight(base: str, request_id: str, out: list[Any], tokens: int = 300) -> threading.Thread:
    body = {
        "token_ids": PROMPT,
        "request_id": request_id,
        "sampling_params": {"temperature": 0, "max_tokens": tokens, "ignore_eos": True},
    }
    thread = threading.Thread(target=lambda: out.append(http_json("POST", base + GEN, body, timeout=120)), daemon=True)
    thread.start()
    return thread


def _wait_running(urls: list[str], count: int) -> None:
    def running() -> int:
        return sum(http_json("GET", u + "/server_info")[1]["internal_states"][0]["num_running_reqs"] for u in urls)

    wait_for(lambda: running() >= count, 30, what=f"{count} request(s) running")


def test_abort_requests_by_id_and_all(fleet: tuple[list[str], str]) -> None:
    workers_, router = fleet
    worker = workers_[0]
    # On a worker, by the id the answer carries; an unknown id aborts nothing.
    out: list[Any] = []
    thread = _in_flight(worker, "job-1", out)
    _wait_running([worker], 1)
    status, answer = http_json("POST", worker + "/abort_requests", {"request_ids": ["generate-tokens-nope"]})
    assert status == 200 and answer["status"] == "aborted" and answer["aborted"] == 0
    status, answer = http_json("POST", worker + "/abort_requests", {"request_ids": ["generate-tokens-job-1"]})
    assert status == 200 and answer["aborted"] == 1, answer
    thread.join(60)
    status, body = out[0]
    assert status == 200 and body["request_id"] == "generate-tokens-job-1"
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < 300

    # Through the router: every worker aborts everything, and the counts add up.
    outs: list[list[Any]] = [[], [], []]
    threads = [_in_flight(router, f"all-{i}", outs[i]) for i in range(3)]
    _wait_running(workers_, 3)
    status, answer = http_json("POST", router + "/abort_requests", {}, headers=auth())
    assert status == 200 and answer["status"] == "aborted" and answer["aborted"] == 3, answer
    assert sum(r["body"]["aborted"] for r in answer["results"]) == 3 and answer["worker_count"] == 2
    for thread, got in zip(threads, outs, strict=True):
        thread.join(60)
        assert got[0][0] == 200 and got[0][1]["choices"][0]["finish_reason"] == "abort"

    # Bad bodies are 400s on both; the router fences nothing and needs its admin key.
    for base, headers in ((worker, None), (router, auth())):
        for bad in ({"request_ids": 5}, {"request_ids": [1, 2]}, {"request_ids": {"a": 1}}):
            status, answer = http_json("POST", base + "/abort_requests", bad, headers=headers)
            assert status == 400 and "request_ids" in answer["error"]["message"], (base, bad, answer)
    assert http_json("POST", router + "/abort_requests", {})[0] == 401
    assert not any(w["disabled"] for w in workers(router, ADMIN_KEY))
    assert all(_idle(u) for u in workers_)


@pytest.mark.parametrize("request_id", [None, "leaving"])
def test_a_caller_that_leaves_the_router_is_aborted_on_its_worker(
    fleet: tuple[list[str], str], request_id: str | None
) -> None:
    """The router aborts a token generation by its id (``/abort_requests``), the one it assigned if need be."""
    workers_, router = fleet

    def aborted() -> int:
        return sum(http_json("GET", u + "/server_info")[1]["internal_states"][0]["aborted_requests"] for u in workers_)

    before = aborted()
    body: dict[str, Any] = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 400, "ignore_eos": True}}
    if request_id is not None:
        body["request_id"] = request_id
    sock = open_raw_request(router, GEN, body)
    try:
        _wait_running(workers_, 1)
    finally:
        sock.close()
    wait_for(lambda: aborted() == before + 1, 15, what="the request aborted on its worker")
    assert all(_idle(u) for u in workers_)
