"""Which keys the generation answers carry, absent or null, built from the contract's models.

The worker builds its OpenAI, vLLM-token and SGLang ``/generate`` answers as the models of
``router.contract`` and sends the fields it set (``worker.http.wire``). Clients of vLLM and SGLang
tell an absent key from a null one, so each shape's keys are pinned here, on a request's output
made by hand (no model, no process), and every answer validates as the model the OpenAPI
document names.
"""

from __future__ import annotations

import types

import pytest

from router.contract.generate import GenerateResponse
from router.contract.openai import ChatCompletionResponse, CompletionResponse
from router.contract.openai_stream import ChatCompletionChunk
from router.contract.vllm_tokens import TokensGenerateResponse, TokensStreamResponse
from worker.engine.request import FinishReason, GenerationParams
from worker.generation_handle import GenerationHandle, VersionSpan
from worker.http import openai_answers as answers
from worker.http.openai_calls import Call, Choice, Kind
from worker.http.wire import dump

WORKER = types.SimpleNamespace(decode=lambda ids: "".join(chr(97 + i % 26) for i in ids), weight_version="v1")
CHOICE_KEYS = {"index", "logprobs", "finish_reason", "stop_reason", "weight_versions", "first_token_weight_version"}
ENVELOPE = ["id", "object", "created", "model", "weight_version", "metadata", "choices"]


def handle(n: int = 3, *, finished: bool = True, top: int = 0, logprob: bool = True) -> GenerationHandle:
    params = GenerationParams(max_new_tokens=n, return_logprob=logprob, top_logprobs_num=top)
    h = GenerationHandle(types.SimpleNamespace(rid="r", prompt_ids=[1, 2], params=params, adapter=None), channel=None)
    h.output_ids = list(range(n))
    h.logprobs = [-0.5] * n
    h.top_logprobs = [[(-0.5, i), (-1.0, i + 1)][:top] for i in range(n)]
    h.version_spans = [VersionSpan("v1", 0, n)] if n else []
    h.last_arrival = 1 if n else 0
    h.finish_reason = FinishReason.at_length(n) if finished else None
    return h


def call(kind: Kind, *, logprobs: int | None = None, token_ids: bool = False, usage: bool = False, **h: object) -> Call:
    made = handle(**h)
    choice = Choice(0, 0, "r", made.params, handle=made)
    return Call(kind, "id-1", 0, "m", [[1, 2]], [choice], None, logprobs, token_ids, False, usage)


def test_completion_answer_keys() -> None:
    body = dump(answers.response_body(call("completion"), WORKER))
    assert list(body) == [*ENVELOPE, "usage"]
    assert set(body["choices"][0]) == CHOICE_KEYS | {"text"}
    assert body["choices"][0]["logprobs"] is None and body["choices"][0]["stop_reason"] is None
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    with_ids = dump(answers.response_body(call("completion", token_ids=True, logprobs=1, top=1), WORKER))
    assert set(with_ids["choices"][0]) == CHOICE_KEYS | {"text", "token_ids", "prompt_token_ids"}
    assert list(with_ids["choices"][0]["logprobs"]) == ["tokens", "token_logprobs", "top_logprobs", "text_offset"]
    CompletionResponse.model_validate(with_ids)


def test_chat_answer_keys() -> None:
    body = dump(answers.response_body(call("chat", logprobs=0), WORKER))
    assert list(body) == [*ENVELOPE, "usage"]
    assert set(body["choices"][0]) == CHOICE_KEYS | {"message"}
    assert body["choices"][0]["logprobs"]["refusal"] is None
    assert set(body["choices"][0]["logprobs"]["content"][0]) == {"token", "logprob", "bytes", "top_logprobs"}
    with_ids = dump(answers.response_body(call("chat", token_ids=True), WORKER))
    assert list(with_ids)[-1] == "prompt_token_ids" and "token_ids" in with_ids["choices"][0]
    ChatCompletionResponse.model_validate(with_ids)


def test_tokens_answer_sends_every_field() -> None:
    body = dump(answers.response_body(call("tokens", logprobs=1, top=2), WORKER))
    assert set(body) == set(TokensGenerateResponse.model_fields)
    assert body["usage"]["prompt_tokens_details"] is None and body["prompt_token_ids"] is None
    entry = body["choices"][0]["logprobs"]["content"][0]
    assert body["choices"][0]["logprobs"].keys() == {"content"}
    assert entry["token"] == "token_id:0" and entry["bytes"] is None and len(entry["top_logprobs"]) == 1
    TokensGenerateResponse.model_validate(body)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streamed_chunk_keys(kind: Kind) -> None:
    running = call(kind, usage=True, finished=False)
    first = dump(answers.delta(running, WORKER, running.choices[0]))
    assert first["usage"] is None and "stop_reason" not in first["choices"][0]
    running.choices[0].running.finish_reason = FinishReason.stopped(99)
    last = dump(answers.delta(running, WORKER, running.choices[0]))
    assert last["choices"][0]["finish_reason"] == "stop" and last["choices"][0]["stop_reason"] is None
    if kind == "chat":
        assert last["choices"][0]["delta"] == {}
        opening = dump(answers.opening(running, WORKER, running.choices[0]))
        assert opening["choices"][0] == {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        ChatCompletionChunk.model_validate(last)
    usage = dump(answers.usage_chunk(running, WORKER))
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 5


def test_streamed_tokens_keys() -> None:
    running = call("tokens", token_ids=True, finished=False)
    first = dump(answers.delta(running, WORKER, running.choices[0]))
    assert list(first) == ["request_id", "weight_version", "choices", "usage", "prompt_token_ids"]
    assert first["usage"] is None and first["choices"][0]["finish_reason"] is None
    TokensStreamResponse.model_validate(first)


def test_generate_answer_keys() -> None:
    plain = dump(handle(logprob=False).build(WORKER.decode, "v1"))
    assert list(plain) == ["text", "output_ids", "meta_info"]
    assert not {"input_token_logprobs", "output_token_logprobs", "output_top_logprobs"} & set(plain["meta_info"])
    assert plain["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    with_logprobs = dump(handle().build(WORKER.decode, "v1"))["meta_info"]
    assert with_logprobs["input_token_logprobs"] == [] and "output_top_logprobs" not in with_logprobs
    streamed = dump(handle(top=2, finished=False).build(WORKER.decode, "v1", index=1))
    assert streamed["index"] == 1 and streamed["meta_info"]["finish_reason"] is None
    assert streamed["meta_info"]["output_top_logprobs"][0] == [[-0.5, 0, None], [-1.0, 1, None]]
    GenerateResponse.model_validate(streamed)
