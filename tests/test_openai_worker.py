"""OpenAI-compatible routes on a real worker, called with the official ``openai`` client:
completions and chat, streaming and not, n > 1, stop strings, seeds, greedy equal to /generate,
usage, logprobs, weight_version, the chat template as transformers renders it, and 400s."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from router.contract.openai import ChatCompletionResponse, CompletionResponse
from tests._worker_helpers import sse_events
from tests.procs import http_json
from worker.model.tiny import TINY_CHAT_TEMPLATE, TINY_SPECIAL_TOKENS

MODEL = "tiny-chat"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2+2?"}]


def client_for(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def cw(worker_factory, chat_checkpoint):
    """A worker on the checkpoint with a chat template."""
    return worker_factory(chat_checkpoint, "--served-model-name", MODEL)


@pytest.fixture(scope="module")
def client(cw) -> openai.OpenAI:
    return client_for(cw.url)


def rendered(messages: list[dict[str, Any]]) -> str:
    """The prompt transformers' own renderer makes of ``messages`` with the tiny template."""
    from transformers.utils import chat_template_utils as hf

    special = {k: v for k, v in TINY_SPECIAL_TOKENS.items() if v is not None}
    if hasattr(hf, "render_jinja_template"):
        texts, _ = hf.render_jinja_template(
            [messages], chat_template=TINY_CHAT_TEMPLATE, add_generation_prompt=True, **special
        )
        return texts[0]
    template = hf._compile_jinja_template(TINY_CHAT_TEMPLATE)  # older transformers
    return template.render(messages=messages, tools=None, documents=None, add_generation_prompt=True, **special)


def test_models_lists_the_served_model(client, cw):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"


def test_greedy_completion_equals_generate_with_usage_and_weight_version(client, cw):
    expected = cw.generate("The policy says:", 12)
    resp = client.completions.create(
        model=MODEL, prompt="The policy says:", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    CompletionResponse.model_validate(resp.model_dump())
    assert resp.object == "text_completion" and resp.model == MODEL
    (choice,) = resp.choices
    assert choice.text == expected["text"]
    assert choice.finish_reason == "length" and choice.index == 0
    assert resp.usage.prompt_tokens == expected["meta_info"]["prompt_tokens"] == len(b"The policy says:")
    assert resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12
    body = resp.model_dump()
    assert body["weight_version"] == "default" and body["metadata"] == {"weight_version": "default"}
    # Token ids as the prompt: the same tokens, the same answer.
    by_ids = client.completions.create(
        model=MODEL,
        prompt=list(b"The policy says:"),
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert by_ids.choices[0].text == expected["text"]
    assert by_ids.model_dump()["choices"][0]["token_ids"] == expected["output_ids"]


def test_batch_of_prompts_with_n_choices(client, cw):
    resp = client.completions.create(
        model=MODEL, prompt=["ab", "xyz"], n=3, max_tokens=5, temperature=1.0, seed=7, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in resp.choices] == list(range(6))
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage.prompt_tokens == 2 + 3  # each prompt once, whatever n is
    assert resp.usage.completion_tokens == 6 * 5
    # A list of token-id lists is a batch too.
    ids = client.completions.create(model=MODEL, prompt=[list(b"ab"), list(b"xyz")], max_tokens=3, temperature=0)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5


def test_seed_makes_sampling_reproducible_and_n_choices_differ(client):
    def sample(seed: int) -> list[str]:
        resp = client.completions.create(
            model=MODEL, prompt="Once", n=4, max_tokens=16, temperature=1.0, seed=seed, extra_body={"ignore_eos": True}
        )
        return [c.text for c in resp.choices]

    first, again, other = sample(1234), sample(1234), sample(99)
    assert first == again
    assert first != other
    assert len(set(first)) > 1  # choice j samples with seed + j
    single = client.completions.create(
        model=MODEL, prompt="Once", max_tokens=16, temperature=1.0, seed=1234, extra_body={"ignore_eos": True}
    )
    assert single.choices[0].text == first[0]


def _stop_in(text: str) -> tuple[str, int]:
    """A printable ASCII character of ``text`` (after its start) and where it first occurs."""
    for k, ch in enumerate(text):
        if k > 0 and ch.isascii() and ch.isprintable() and text.index(ch) == k:
            return ch, k
    raise AssertionError(f"no usable stop character in {text!r}")


def test_stop_string_ends_and_trims_streaming_or_not(client, cw):
    full = cw.generate("Stop here:", 32)["text"]
    stop, k = _stop_in(full)
    resp = client.completions.create(
        model=MODEL, prompt="Stop here:", max_tokens=32, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == full[:k]
    assert choice.model_dump()["stop_reason"] == stop
    streamed = client.completions.create(
        model=MODEL,
        prompt="Stop here:",
        max_tokens=32,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == full[:k]
    assert chunks[-1].choices[0].finish_reason == "stop"
    # include_stop_str_in_output keeps it.
    kept = client.completions.create(
        model=MODEL,
        prompt="Stop here:",
        max_tokens=32,
        temperature=0,
        stop=stop,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    )
    assert kept.choices[0].text.startswith(full[:k] + stop)


def test_streaming_completion_matches_the_whole_answer(client, cw):
    whole = client.completions.create(
        model=MODEL, prompt=["hello", "bye"], max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    stream = client.completions.create(
        model=MODEL,
        prompt=["hello", "bye"],
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    texts = {0: "", 1: ""}
    finish: dict[int, str] = {}
    usage = None
    versions = set()
    for chunk in stream:
        versions.add(chunk.model_dump()["weight_version"])
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finish == {0: "length", 1: "length"}
    assert usage is not None and usage.model_dump() == whole.usage.model_dump()
    assert versions == {"default"}


def test_raw_stream_is_sse_ending_with_done(cw):
    events = sse_events(
        cw.url + "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3, "temperature": 0, "stream": True}
    )
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "text_completion" for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def test_echo_prepends_the_prompt(client, cw):
    plain = client.completions.create(model=MODEL, prompt="echo me", max_tokens=4, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt="echo me", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "echo me" + plain.choices[0].text


def test_chat_renders_the_template_as_transformers_does(client, cw):
    prompt = rendered(MESSAGES)
    assert prompt.endswith("<|im_start|>assistant\n") and "<|im_end|>" in prompt
    expected = cw.generate(list(prompt.encode()), 10)
    resp = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    ChatCompletionResponse.model_validate(resp.model_dump())
    assert resp.object == "chat.completion"
    (choice,) = resp.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected["text"]
    assert choice.finish_reason == "length"
    body = resp.model_dump()
    assert body["prompt_token_ids"] == list(prompt.encode())
    assert body["choices"][0]["token_ids"] == expected["output_ids"]
    assert resp.usage.prompt_tokens == len(prompt.encode()) and resp.usage.completion_tokens == 10
    assert body["weight_version"] == "default" and body["metadata"]["weight_version"] == "default"
    # Text parts of a content list are joined as one string.
    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]}]
    again = client.chat.completions.create(
        model=MODEL, messages=parts, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert again.choices[0].message.content == expected["text"]


def test_chat_streaming_and_n(client):
    whole = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0.8, seed=3, n=2, extra_body={"ignore_eos": True}
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0.8,
        seed=3,
        n=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts = {0: "", 1: ""}
    roles = set()
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            if c.delta.role:
                roles.add((c.index, c.delta.role))
            texts[c.index] += c.delta.content or ""
    assert roles == {(0, "assistant"), (1, "assistant")}
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert whole.usage.completion_tokens == 16


def test_logprobs_match_generate(client, cw):
    ref = cw.generate("logprobs", 6, return_logprob=True, top_logprobs_num=3)
    ref_lps = [lp for lp, _tok, _ in ref["meta_info"]["output_token_logprobs"]]
    resp = client.completions.create(
        model=MODEL, prompt="logprobs", max_tokens=6, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.token_logprobs == pytest.approx(ref_lps, abs=1e-5)
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    assert all(item.logprob <= 0 and len(item.top_logprobs) == 2 for item in content)
    assert all(item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob for item in content)
    bare = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
    assert bare.choices[0].logprobs is None


def test_bad_input_is_400_with_error_message(client, cw):
    cases: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"model": MODEL}),
        ("/v1/completions", {"prompt": "x", "n": 0}),
        ("/v1/completions", {"prompt": "x", "temperature": -1}),
        ("/v1/completions", {"prompt": "x", "max_tokens": "five"}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}),
        ("/v1/completions", {"prompt": [], "max_tokens": 1}),
        ("/v1/completions", {"prompt": [[1, 2], []], "max_tokens": 1}),
        ("/v1/completions", {"prompt": [100000], "max_tokens": 1}),
        ("/v1/completions", {"prompt": "x", "frequency_penalty": 0.5}),
        ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 5000}),
        ("/v1/completions", {"prompt": "x", "stop": [""]}),
        ("/v1/chat/completions", {"messages": []}),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": 1}},
        ),
    ]
    for path, body in cases:
        status, answer = http_json("POST", cw.url + path, body)
        assert status == 400, (path, body, status, answer)
        assert isinstance(answer["error"]["message"], str) and answer["error"]["message"], answer
    status, answer = http_json("POST", cw.url + "/v1/completions", raw=b"{not json")
    assert status == 400 and "malformed JSON" in answer["error"]["message"]
    # The template itself refuses a role it does not know (raise_exception).
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "developer", "content": "x"}], max_tokens=2)
    assert "unsupported role: developer" in json.dumps(err.value.body)


def test_chat_without_a_template_is_400(worker):
    plain = client_for(worker.url)
    with pytest.raises(openai.BadRequestError) as err:
        plain.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert "no chat template" in err.value.message
    # Completions still work there.
    assert plain.completions.create(model="x", prompt="hi", max_tokens=2).choices[0].text is not None


def test_openapi_lists_the_routes(cw):
    status, doc = http_json("GET", cw.url + "/openapi.json")
    assert status == 200
    assert {"/v1/models", "/v1/completions", "/v1/chat/completions"} <= set(doc["paths"])
